"""The trainer tables and plots of docs/results/trainer_*.md (``bench/report/build.py``; results of
``bench/trainer/breakdown.py``, ``bench/trainer/step.py`` and ``bench/trainer/precision.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.report.shared import load_note, pyplot

PART_LABEL = {
    "wait_s": "wait for data",
    "step_s": "compute",
    "checkpoint_s": "checkpoint",
    "sync_s": "weight sync",
}


def breakdown_table(d: dict[str, Any]) -> str:
    if not d:
        return "_not measured yet_"
    rows = [
        "| mode | steps | median step s | wait for data | (s/step) | compute | checkpoint "
        "| weight sync | mean staleness | groups dropped as stale |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key in sorted(d):
        p = d[key]
        s = p["steady"]
        mode = (
            "synchronous (max_staleness 0)"
            if p["max_staleness"] == 0
            else f"async (max_staleness {p['max_staleness']})"
        )
        rows.append(
            f"| {mode} | {s['steps']} (+1) | {s['step_time_median_s']:.1f} | "
            f"**{100 * s['wait_frac']:.1f}%** | {s['wait_s'] / s['steps']:.2f} | "
            f"{100 * s['step_frac']:.0f}% | "
            f"{100 * s['checkpoint_frac']:.0f}% | {100 * s['sync_frac']:.0f}% | "
            f"{s['staleness_mean']:.2f} | {p['dropped_stale_groups']} |"
        )
    return "\n".join(rows) + "\n\n" + load_note(list(d.values()))


def breakdown_plot(d: dict[str, Any], png: Path) -> None:
    if not d:
        return
    plt = pyplot()
    keys = sorted(d)
    fig, ax = plt.subplots(figsize=(7, 4))
    bottom = [0.0] * len(keys)
    for part, label in PART_LABEL.items():
        vals = [100 * d[k]["steady"][part.replace("_s", "_frac")] for k in keys]
        ax.bar(range(len(keys)), vals, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.axhline(10, color="k", ls=":", lw=1)
    ax.set_xticks(range(len(keys)), [f"max_staleness {d[k]['max_staleness']}" for k in keys])
    ax.set_ylabel("% of trainer wall time (steps 2..N)")
    ax.set_title("GRPO trainer time breakdown, cpu-tiny preset")
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(png, dpi=90)
    plt.close(fig)


def step_table(d: dict[str, Any]) -> str:
    if not d:
        return "_not measured yet_"
    rows = [
        "| model | batch (sequences) | group size | tokens/sequence | compute s (median) "
        "| trained tokens/s | checkpoint s |",
        "|---|---|---|---|---|---|---|",
    ]
    order = {"tiny": 0, "small": 1, "base": 2}
    for key in sorted(
        d,
        key=lambda k: (
            d[k]["seq_len"],
            order.get(d[k]["model"], 9),
            d[k]["batch_sequences"],
            d[k]["group_size"],
        ),
    ):
        p = d[key]
        rows.append(
            f"| {p['model']} ({p['params'] / 1e6:.0f}M) | {p['batch_sequences']} | "
            f"{p['group_size']} | {p['seq_len']} | {p['compute_median_s']:.2f} | "
            f"{p['tokens_per_s']:.0f} | {p['checkpoint_median_s']:.2f} |"
        )
    return "\n".join(rows) + "\n\n" + load_note(list(d.values()))


def precision_table(d: dict[str, Any]) -> str:
    """GRPO step per ``--precision`` (bench/trainer/precision.py), native and with oneDNN held to
    AVX2 (``ONEDNN_MAX_CPU_ISA=AVX2``: bf16 emulated, as on a CPU without native bf16)."""
    if not d:
        return "_not measured yet_"
    rows = [
        "| oneDNN ISA | batch x tokens | precision | resolved to | wall s (median) "
        "| CPU s (median) | CPU s vs fp32 | 512x512 matmul GFLOP/s fp32 / bf16 (1 thread) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    order = {"fp32": 0, "auto": 1, "bf16": 2}

    def run(p: dict[str, Any]) -> tuple:
        return (p["onednn_max_cpu_isa"] or "", p["batch_sequences"], p["seq_len"])

    fp32 = {run(p): p["cpu_median_s"] for p in d.values() if p["precision"] == "fp32"}
    for p in sorted(d.values(), key=lambda p: (*run(p), order[p["precision"]])):
        base = fp32.get(run(p))
        ratio = f"x{p['cpu_median_s'] / base:.2f}" if base else "-"
        mm = p.get("matmul_512_gflops_1_thread")
        mm_cell = f"{mm['fp32']} / {mm['bf16']}" if mm else "-"
        rows.append(
            f"| {p['onednn_max_cpu_isa'] or 'native'} | {p['batch_sequences']} x {p['seq_len']} "
            f"| {p['precision']} | {p['compute_dtype']} | {p['wall_median_s']:.2f} "
            f"| {p['cpu_median_s']:.2f} | {ratio} | {mm_cell} |"
        )
    return "\n".join(rows) + "\n\n" + load_note(list(d.values()), locked=False)


def step_plot(d: dict[str, Any], png: Path) -> None:
    if not d:
        return
    plt = pyplot()
    pts = list(d.values())
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    sweeps = [
        (
            "parameters, M (batch 8, group 4)",
            "params",
            [p for p in pts if p["batch_sequences"] == 8 and p["group_size"] == 4],
        ),
        (
            "batch size, sequences (tiny, group 4)",
            "batch_sequences",
            [p for p in pts if p["model"] == "tiny" and p["group_size"] == 4],
        ),
        (
            "group size (tiny, 512 tok/seq)",
            "group_size",
            [p for p in pts if p["model"] == "tiny" and p["seq_len"] == 512],
        ),
    ]
    for ax, (label, key, sel) in zip(axes, sweeps, strict=True):
        # One line per sequence length; on the group-size panel one per batch size.
        line = "batch_sequences" if key == "group_size" else "seq_len"
        for v in sorted({p[line] for p in sel}):
            s = sorted((p for p in sel if p[line] == v), key=lambda p: p[key])
            x = [p[key] / 1e6 if key == "params" else p[key] for p in s]
            name = f"batch {v}" if line == "batch_sequences" else f"{v} tok/seq"
            ax.plot(x, [p["compute_median_s"] for p in s], "o-", label=name)
        if key == "params":
            ax.set_xscale("log")
            ax.set_yscale("log")
        else:
            ax.set_ylim(bottom=0)
        ax.set_xlabel(label)
        ax.set_ylabel("GRPO step compute, s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Trainer step time (scoring + reference + loss/backward + AdamW), fp32 CPU")
    fig.tight_layout()
    fig.savefig(png, dpi=90)
    plt.close(fig)
