"""The tables and the plot of ``bench/sync/bridge_sync.py``'s results
(docs/results/bridge_bench.md, docs/bridge_sync.png).
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

from bench.sync.modes import FULL_WEIGHT, median_of


def _ms(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v * 1e3:.1f}" if v < 0.1 else f"{v * 1e3:.0f}"


def table(results: dict) -> str:
    """The markdown table of docs/results/bridge_bench.md."""
    lines = [
        "| model | mode | sync, ms: best / median | transfer, ms (median) | server pause = stall, "
        "ms: best / median | largest token gap during sync, ms: median (typical step) | MiB "
        "| transfer / memcpy | sync / (memcpy + apply) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    other_floors = []
    for name, res in results.items():
        for m in res["modes"]:
            med, best = m["median"], m["best"]
            fl = m.get("floors") or floors_of(res)
            memcpy, apply = fl.get("memcpy_s"), fl.get("apply_floor_s")
            if fl != floors_of(res) and m["key"] != "lora":  # LoRA has no ratio
                other_floors.append(
                    f"{name} {m['label']}: memcpy {_ms(memcpy)}, apply {_ms(apply)}"
                )
            full = m["key"] in FULL_WEIGHT
            ratio_t = f"{med['transfer_s'] / memcpy:.1f}x" if full and memcpy else "-"
            has_floor = m["key"] != "lora" and memcpy and apply
            ratio_s = f"{med['sync_s'] / (memcpy + apply):.2f}x" if has_floor else "-"
            pause = (
                "no pause"
                if m["key"] == "lora"
                else (f"{_ms(best['server_pause_s'])} / {_ms(med['server_pause_s'])}")
            )
            lines.append(
                f"| {name} ({res.get('params', 0) / 1e6:.0f}M) | {m['label']} "
                f"| {_ms(best['sync_s'])} / {_ms(med['sync_s'])} "
                f"| {_ms(med['transfer_s']) if full else '-'} | {pause} "
                f"| {_ms(med['client_gap_s'])} ({_ms(med['median_token_gap_s'])}) "
                f"| {med['bytes'] / 2**20:.1f} | {ratio_t} | {ratio_s} |"
            )
    lines.append("")
    lines.append("| model | memcpy floor, ms | apply floor (load_weights + repack + lm_head), ms |")
    lines.append("|---|---|---|")
    for name, res in results.items():
        lines.append(f"| {name} | {_ms(res.get('memcpy_s'))} | {_ms(res.get('apply_floor_s'))} |")
    notes = [
        f"- {name} {m['label']}: {note}"
        for name, res in results.items()
        for m in res["modes"]
        if (note := freeze_note(m))
    ]
    if notes:
        lines += ["", *notes]
    if other_floors:
        lines.append("")
        lines.append(
            "Measured in an earlier run, against that run's floors (ms): "
            + "; ".join(other_floors)
            + "."
        )
    return "\n".join(lines) + "\n"


FREEZE_S = 0.5
"""A round whose idle probe overslept longer than this hit a freeze of the whole box."""


def freeze_note(m: dict) -> str | None:
    """One line on the rounds of mode ``m`` that a box freeze hit, and the medians of the
    others (None when no round was hit, or the rounds predate the probe)."""
    steady = m.get("rounds", [])[0 if m["key"] == "restart" else 1 :]
    hit = [r for r in steady if (r.get("box_freeze_s") or 0.0) > FREEZE_S]
    if not hit:
        return None
    rest = [r for r in steady if r not in hit]
    lengths = sorted(r["box_freeze_s"] for r in hit)
    note = (
        f"{len(hit)} of {len(steady)} rounds hit a box freeze (an idle probe process stopped "
        f"{lengths[0]:.1f}-{lengths[-1]:.1f} s: the whole machine, not the bridge)"
    )
    if not rest:
        return note + "."
    sync = median_of([r["sync_s"] for r in rest])
    gap = median_of([r["client_gap_s"] for r in rest])
    return (
        note + f"; the other rounds: sync median {_ms(sync)} ms, largest token gap {_ms(gap)} ms."
    )


def floors_of(res: dict) -> dict:
    """The memcpy and apply floors a result was measured against (those it has)."""
    return {k: res[k] for k in ("memcpy_s", "apply_floor_s") if k in res}


def breakdown_table(results: dict) -> str:
    """Median breakdown of the full-weight shared_vllm syncs."""
    cols = [
        "pack_s",
        "stage_call_s",
        "send_s",
        "worker_wait_s",
        "server_pause_enter_s",
        "server_apply_rpc_s",
        "worker_load_s",
        "worker_finalize_s",
        "worker_lm_head_s",
        "server_version_s",
        "server_resume_s",
        "server_pause_s",
        "apply_call_s",
        "sync_s",
    ]
    lines = [
        "| model | mode | path | " + " | ".join(c.removesuffix("_s") for c in cols) + " |",
        "|---" * (len(cols) + 3) + "|",
    ]
    for name, res in results.items():
        for m in res["modes"]:
            if m["key"] not in FULL_WEIGHT:
                continue
            vals = " | ".join(_ms(m["median"].get(c)) for c in cols)
            lines.append(f"| {name} | {m['label']} | {m.get('path')} | {vals} |")
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(results)
    fig, axes = plt.subplots(1, len(models), figsize=(7.5 * len(models), 5.6), squeeze=False)
    for ax, name in zip(axes[0], models, strict=True):
        res = results[name]
        labels = [textwrap.fill(m["label"], 17) for m in res["modes"]]
        best = [(m["best"]["sync_s"] or m["median"]["sync_s"]) * 1e3 for m in res["modes"]]
        sync = [m["median"]["sync_s"] * 1e3 for m in res["modes"]]
        # no pause (LoRA) draws no bar: a log axis has no zero
        pause = [(m["median"]["server_pause_s"] or float("nan")) * 1e3 for m in res["modes"]]
        full = FULL_WEIGHT
        transfer = [
            m["median"]["transfer_s"] * 1e3 if m["key"] in full else 0 for m in res["modes"]
        ]
        xs = range(len(labels))
        w = 0.2
        ax.bar([x - 1.5 * w for x in xs], best, w, label="sync latency (best)")
        ax.bar([x - 0.5 * w for x in xs], sync, w, label="sync latency (median)")
        ax.bar([x + 0.5 * w for x in xs], pause, w, label="stall: server pause (median)")
        ax.bar([x + 1.5 * w for x in xs], transfer, w, label="transfer (median)")
        ax.axhline(res["memcpy_s"] * 1e3, color="k", ls="--", label="memcpy of the weights")
        ax.axhline(
            (res["memcpy_s"] + res["apply_floor_s"]) * 1e3,
            color="r",
            ls=":",
            label="memcpy + apply floor",
        )
        ax.set_xticks(list(xs), labels, fontsize=7)
        ax.set_ylabel("ms (log)")
        ax.set_yscale("log")
        ax.set_title(f"{name} ({res['params'] / 1e6:.0f}M params, {res['bytes'] / 2**20:.0f} MiB)")
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def save(results: dict, out: Path, plot_path: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    out.with_suffix(".md").write_text(
        "# Weight-bridge benchmark (generated by bench/sync/bridge_sync.py)\n\n"
        + table(results)
        + "\n## Breakdown of the full-weight syncs (medians, ms)\n\n"
        + breakdown_table(results)
    )
    plot(results, plot_path)
