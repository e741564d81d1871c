"""The batching-API tables and plot of docs/results/api_throughput.md (``bench/report/build.py``; results of
``bench/api/throughput.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.report.shared import load_note, pyplot

TARGET_LABEL = {
    "atropos": "Atropos run-api 0.4.0 (in memory)",
    "ours-atropos": "ours, Atropos routes (SQLite, fsync)",
    "ours-native": "ours, native routes (SQLite, fsync)",
}


def api_tables(d: dict[str, Any]) -> tuple[str, str]:
    if not d:
        return "_not measured yet_", "_not measured yet_"
    rows = [
        "| server | ingest groups/s | ingest seq/s | push p50 / p99 ms | serve seq/s "
        "| batch p50 / p99 / max ms |",
        "|---|---|---|---|---|---|",
    ]
    for t in TARGET_LABEL:
        p = d.get(f"{t}/gs8/b64")
        if p:
            i, s = p["ingest"], p["serve"]
            rows.append(
                f"| {TARGET_LABEL[t]} | {i['groups_per_s']:.0f} | "
                f"{i['sequences_per_s']:.0f} | {i['p50_ms']:.0f} / {i['p99_ms']:.0f} | "
                f"{s['sequences_per_s']:.0f} | {s['p50_ms']:.0f} / {s['p99_ms']:.0f} / "
                f"{s['max_ms']:.0f} |"
            )
    mains = [d[f"{t}/gs8/b64"] for t in TARGET_LABEL if f"{t}/gs8/b64" in d]
    main = "\n".join(rows) + "\n\n" + load_note(mains)
    rows = [
        "| server | sweep (values in this order) | ingest seq/s | serve seq/s |",
        "|---|---|---|---|",
    ]
    for t in TARGET_LABEL:
        sweeps = (
            ("group size 4 / 8 / 16 (batch 64)", [f"{t}/gs{g}/b64" for g in (4, 8, 16)]),
            ("batch 32 / 64 / 128 (group size 8)", [f"{t}/gs8/b{b}" for b in (32, 64, 128)]),
        )
        for sweep, keys in sweeps:
            points = [d.get(k) for k in keys]
            if all(points):
                rates = [
                    " / ".join(f"{p[phase]['sequences_per_s']:.0f}" for p in points)
                    for phase in ("ingest", "serve")
                ]
                rows.append(f"| {TARGET_LABEL[t]} | {sweep} | {rates[0]} | {rates[1]} |")
    return main, "\n".join(rows)


def api_extra_tables(d: dict[str, Any]) -> tuple[str, str]:
    """``/status-env`` latency vs history, and the ingest profile by stage."""
    rows = ["| server | groups served before | /status-env p50 ms | p99 ms |", "|---|---|---|---|"]
    points = sorted(
        (v for k, v in d.items() if k.startswith("status-env/")),
        key=lambda p: (p["target"], p["history_groups"]),
    )
    for p in points:
        rows.append(
            f"| {TARGET_LABEL[p['target']]} | {p['history_groups']} | "
            f"{p['p50_ms']:.1f} | {p['p99_ms']:.1f} |"
        )
    status_env = "\n".join(rows) + ("\n\n" + load_note(points) if points else "")
    prof = d.get("profile/ours-atropos")
    if not prof:
        return status_env, "_not measured yet_"
    rows = [
        f"| stage (one request of {prof['per_push']} groups x {prof['seq_len']} tokens) | ms |",
        "|---|---|",
    ]
    rows += [f"| {name.strip()} | {ms:.2f} |" for name, ms in prof["stages_ms"].items()]
    return status_env, "\n".join(rows) + "\n\n" + load_note([prof])


def api_plot(d: dict[str, Any], png: Path) -> None:
    if not d:
        return
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    targets = [t for t in TARGET_LABEL if f"{t}/gs8/b64" in d]
    xs = range(len(targets))
    ing = [d[f"{t}/gs8/b64"]["ingest"]["sequences_per_s"] for t in targets]
    srv = [d[f"{t}/gs8/b64"]["serve"]["sequences_per_s"] for t in targets]
    axes[0].bar([x - 0.2 for x in xs], ing, 0.4, label="ingest")
    axes[0].bar([x + 0.2 for x in xs], srv, 0.4, label="serve")
    axes[0].set_xticks(list(xs), [TARGET_LABEL[t].split(" (")[0] for t in targets], fontsize=8)
    axes[0].set_ylabel("sequences/s")
    axes[0].set_title("group size 8, batch 64 (512-token sequences)")
    axes[0].legend()
    for t in targets:
        g = [x for x in (4, 8, 16) if f"{t}/gs{x}/b64" in d]
        axes[1].plot(
            g,
            [d[f"{t}/gs{x}/b64"]["ingest"]["sequences_per_s"] for x in g],
            "o-",
            label=TARGET_LABEL[t],
        )
        b = [x for x in (32, 64, 128) if f"{t}/gs8/b{x}" in d]
        axes[2].plot(
            b,
            [d[f"{t}/gs8/b{x}"]["serve"]["sequences_per_s"] for x in b],
            "o-",
            label=TARGET_LABEL[t],
        )
    axes[1].set_xlabel("group size")
    axes[1].set_ylabel("ingest sequences/s")
    axes[1].set_xticks([4, 8, 16])
    axes[2].set_xlabel("batch size (sequences)")
    axes[2].set_ylabel("serve sequences/s")
    axes[2].set_xticks([32, 64, 128])
    for ax in axes[1:]:
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=90)
    plt.close(fig)
