"""Tables and plots of docs/BENCHMARKS.md from the JSON results under docs/results/.

    .venv/bin/python bench/report.py          # no measurement: reads JSON, writes PNG + tables

Each table is written between ``<!-- table:NAME -->`` and ``<!-- /table:NAME -->`` markers
in docs/BENCHMARKS.md (the prose around them is left alone); plots go to docs/results/*.png.
A result file that does not exist yet leaves its table with a "not measured" line.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.common import RESULTS  # noqa: E402

DOC = REPO / "docs" / "BENCHMARKS.md"
TARGET_LABEL = {
    "atropos": "Atropos run-api 0.4.0 (in memory)",
    "ours-atropos": "ours, Atropos routes (SQLite, fsync)",
    "ours-native": "ours, native routes (SQLite, fsync)",
}
PART_LABEL = {
    "wait_s": "wait for data",
    "step_s": "compute",
    "checkpoint_s": "checkpoint",
    "sync_s": "weight sync",
}


def load(name: str) -> dict[str, Any]:
    path = RESULTS / name
    return json.loads(path.read_text()) if path.exists() else {}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _load_note(points: list[dict[str, Any]], locked: bool = True) -> str:
    loads = [p["machine"]["loadavg"][0] for p in points if "machine" in p]
    loads += [
        p[k]["loadavg"][0] for p in points for k in ("machine_before", "machine_after") if k in p
    ]
    if not loads:
        return ""
    m = next((p.get("machine") or p.get("machine_before") for p in points), {})
    flags = m.get("bf16_flags")
    cpu = m.get("cpu", "?") + (
        f"; bf16 flags: {' '.join(flags) or 'none'}" if flags is not None else ""
    )
    return (
        f"Machine: {m.get('cpus')} CPUs ({cpu}), {m.get('mem_gib', '?')} GiB; "
        f"1-min load average during the runs {min(loads):.1f}..{max(loads):.1f} "
        + (
            "(shared box; everything ran under `flock /tmp/heavy.lock`)."
            if locked
            else "(shared box; not under the heavy-job lock: the wall times include waiting for "
            "a core, the CPU seconds much less so)."
        )
    )


# -- API ----------------------------------------------------------------------------------


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
    main = "\n".join(rows) + "\n\n" + _load_note(mains)
    rows = [
        "| server | sweep (values in this order) | ingest seq/s | serve seq/s |",
        "|---|---|---|---|",
    ]
    for t in TARGET_LABEL:
        ing = [d.get(f"{t}/gs{g}/b64") for g in (4, 8, 16)]
        if all(ing):
            rows.append(
                f"| {TARGET_LABEL[t]} | group size 4 / 8 / 16 (batch 64) | "
                + " / ".join(f"{p['ingest']['sequences_per_s']:.0f}" for p in ing)
                + " | "
                + " / ".join(f"{p['serve']['sequences_per_s']:.0f}" for p in ing)
                + " |"
            )
        srv = [d.get(f"{t}/gs8/b{b}") for b in (32, 64, 128)]
        if all(srv):
            rows.append(
                f"| {TARGET_LABEL[t]} | batch 32 / 64 / 128 (group size 8) | "
                + " / ".join(f"{p['ingest']['sequences_per_s']:.0f}" for p in srv)
                + " | "
                + " / ".join(f"{p['serve']['sequences_per_s']:.0f}" for p in srv)
                + " |"
            )
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
    status_env = "\n".join(rows) + ("\n\n" + _load_note(points) if points else "")
    prof = d.get("profile/ours-atropos")
    if not prof:
        return status_env, "_not measured yet_"
    rows = [
        f"| stage (one request of {prof['per_push']} groups x {prof['seq_len']} tokens) | ms |",
        "|---|---|",
    ]
    rows += [f"| {name.strip()} | {ms:.2f} |" for name, ms in prof["stages_ms"].items()]
    return status_env, "\n".join(rows) + "\n\n" + _load_note([prof])


def api_plot(d: dict[str, Any], png: Path) -> None:
    if not d:
        return
    plt = _plt()
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


# -- rollout ------------------------------------------------------------------------------


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
    return "\n".join(rows) + "\n\n" + _load_note(list(d.values()))


def rollout_plot(d: dict[str, Any], png: Path) -> None:
    if not d:
        return
    plt = _plt()
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


# -- trainer ------------------------------------------------------------------------------


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
    return "\n".join(rows) + "\n\n" + _load_note(list(d.values()))


def breakdown_plot(d: dict[str, Any], png: Path) -> None:
    if not d:
        return
    plt = _plt()
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
    return "\n".join(rows) + "\n\n" + _load_note(list(d.values()))


def precision_table(d: dict[str, Any]) -> str:
    """GRPO step per ``--precision`` (bench/precision_step.py), native and with oneDNN held to
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
    return "\n".join(rows) + "\n\n" + _load_note(list(d.values()), locked=False)


def step_plot(d: dict[str, Any], png: Path) -> None:
    if not d:
        return
    plt = _plt()
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


def _mode_memcpy_floor(mode: dict[str, Any], res: dict[str, Any]) -> float:
    """The memcpy floor of the run that measured ``mode`` (bench/bridge_sync.py keeps each
    mode's floors; older results have the model's only)."""
    return mode.get("floors", {}).get("memcpy_s", res.get("memcpy_s", float("nan")))


def bridge_summary(d: dict[str, Any]) -> str:
    if not d:
        return "_no bridge results yet (docs/results/bridge_bench.json)_"
    rows = [
        "| model | mode | sync median ms | server pause median ms | memcpy floor ms |",
        "|---|---|---|---|---|",
    ]
    for name, res in d.items():
        if not isinstance(res, dict) or "modes" not in res:
            continue
        for m in res["modes"]:
            med = m.get("median", {})
            pause = med.get("server_pause_s")
            rows.append(
                f"| {name} ({m.get('params', res.get('params', 0)) / 1e6:.0f}M) | {m.get('label')} | "
                f"{1e3 * med.get('sync_s', float('nan')):.0f} | "
                f"{'-' if pause is None else f'{1e3 * pause:.0f}'} | "
                f"{1e3 * _mode_memcpy_floor(m, res):.1f} |"
            )
    return "\n".join(rows)


# -- document -----------------------------------------------------------------------------


def fill(doc: str, name: str, body: str) -> str:
    pattern = re.compile(rf"(<!-- table:{name} -->\n).*?(<!-- /table:{name} -->)", re.S)
    if not pattern.search(doc):
        print(f"warning: no <!-- table:{name} --> marker in {DOC}", file=sys.stderr)
        return doc
    return pattern.sub(lambda m: m.group(1) + body.rstrip() + "\n" + m.group(2), doc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--doc", type=Path, default=DOC, help="markdown file with table markers")
    args = ap.parse_args()
    api, ro = load("api_compare.json"), load("rollout_overhead.json")
    tb, ts = load("trainer_breakdown.json"), load("trainer_step.json")
    api_plot(api, RESULTS / "api_compare.png")
    rollout_plot(ro, RESULTS / "rollout_overhead.png")
    breakdown_plot(tb, RESULTS / "trainer_breakdown.png")
    step_plot(ts, RESULTS / "trainer_step.png")
    api_main, api_sweep = api_tables(api)
    api_status_env, api_profile = api_extra_tables(api)
    tables = {
        "api": api_main,
        "api_sweep": api_sweep,
        "api_status_env": api_status_env,
        "api_profile": api_profile,
        "rollout": rollout_table(ro),
        "breakdown": breakdown_table(tb),
        "step": step_table(ts),
        "precision": precision_table(load("trainer_precision.json")),
        "bridge": bridge_summary(load("bridge_bench.json")),
    }
    doc = args.doc.read_text() if args.doc.exists() else ""
    for name, body in tables.items():
        doc = fill(doc, name, body)
    args.doc.write_text(doc)
    print(f"updated {args.doc} and the plots in {RESULTS}")
    if tb:  # the figure the issue sets a target for
        for k, p in sorted(tb.items()):
            print(f"{k}: wait {100 * p['steady']['wait_frac']:.1f}% of trainer wall time")
    if ro:
        print(
            "rollout overhead median:",
            f"{100 * statistics.median(p['overhead'] for p in ro.values()):+.1f}%",
        )


if __name__ == "__main__":
    main()
