"""The rollout-overhead table and plot of docs/results/rollout_overhead.md (``bench/report/build.py``; results
of ``bench/rollout/overhead.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.report.shared import load_note, pyplot


def rollout_table(d: dict[str, Any]) -> str:
    if not d:
        return "_not measured yet_"
    rows = [
        "| model | group size | prompts in flight | prompts x pairs | direct tok/s | through "
        "tok/s | overhead (median) | per-pair overhead range |",
        "|---|---|---|---|---|---|---|---|",
    ]
    order = {"tiny": 0, "small": 1, "base": 2}
    for key in sorted(
        d, key=lambda k: (order.get(k.split("/")[0], 9), d[k]["group_size"], d[k]["concurrency"])
    ):
        p = d[key]
        rows.append(
            f"| {p['model']} ({p['params'] / 1e6:.0f}M) | {p['group_size']} | "
            f"{p['concurrency']} | {p['groups']} x {len(p['direct'])} | "
            f"{p['direct_median']:.0f} | {p['through_median']:.0f} | "
            f"{100 * p['overhead']:+.1f}% | {100 * p['overhead_pair_min']:+.1f}% .. "
            f"{100 * p['overhead_pair_max']:+.1f}% |"
        )
    return "\n".join(rows) + "\n\n" + load_note(list(d.values()))


def rollout_plot(d: dict[str, Any], png: Path) -> None:
    if not d:
        return
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    sweeps = [
        (
            "group size (tiny, 4 prompts in flight)",
            "group_size",
            [p for p in d.values() if p["model"] == "tiny" and p["concurrency"] == 4],
        ),
        (
            "prompts in flight (tiny, group size 8)",
            "concurrency",
            [p for p in d.values() if p["model"] == "tiny" and p["group_size"] == 8],
        ),
        (
            "parameters, M (group size 8, 4 in flight)",
            "params",
            [p for p in d.values() if p["group_size"] == 8 and p["concurrency"] == 4],
        ),
    ]
    for ax, (label, key, pts) in zip(axes, sweeps, strict=True):
        pts = sorted(pts, key=lambda p: p[key])
        x = [p[key] / 1e6 if key == "params" else p[key] for p in pts]
        ax.plot(x, [p["direct_median"] for p in pts], "o-", label="direct to vLLM")
        ax.plot(x, [p["through_median"] for p in pts], "s--", label="env service + API")
        for xi, p in zip(x, pts, strict=True):
            ax.annotate(
                f"{100 * p['overhead']:+.1f}%",
                (xi, p["through_median"]),
                textcoords="offset points",
                xytext=(0, -14),
                ha="center",
                fontsize=8,
            )
        if key == "params":
            ax.set_xscale("log")
            ax.set_yscale("log")
        ax.set_xlabel(label)
        ax.set_ylabel("completion tokens/s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Rollout throughput, direct vs through the stack (labels: overhead)")
    fig.tight_layout()
    fig.savefig(png, dpi=90)
    plt.close(fig)
