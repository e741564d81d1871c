"""The run's page: ``report.html`` in the run directory, one self-contained file (no network,
no server) built from what the run wrote.

    python -m launch.report runs/<run>            # (re)build runs/<run>/report.html

Sections, each from its files (a missing file leaves a note instead):

- summary: model, bridge mode, steps done (``trainer/trainer_config.json``,
  ``trainer/metrics.jsonl``, ``weight_versions.json``);
- the SFT-vs-RL table (``eval.md``, as launch/run_all.sh printed it);
- reward and format-rate curves per GRPO step (``trainer/metrics.jsonl``, inline SVG);
- the action-type confusion matrices of both evaluations (``eval_sft|eval_rl/metrics.json``);
- browsable sample rollouts (``trainer/rollouts.jsonl``, trainer/rollout_log.py): filter by
  step, by verdict (valid / invalid / exact) and by text; ``report.html#step=3&verdict=invalid
  &q=cart`` opens with those filters.

``launch/run_all.sh`` writes it at the end of every run.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
from datetime import datetime
from html import escape
from pathlib import Path
from typing import Any

from launch.report_assets import CSS, SCRIPT

REPORT_NAME = "report.html"


def _jsonl(path: Path) -> list[dict[str, Any]]:
    """Rows of a JSONL file (a torn last line of a killed run is skipped); [] if missing."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _note(text: str) -> str:
    return f'<p class="note">{escape(text)}</p>'


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _fmt(v: float | None, spec: str) -> str:
    return "n/a" if v is None else format(v, spec)


def summary(run_dir: Path, steps: list[dict[str, Any]]) -> str:
    cfg = _json(run_dir / "trainer" / "trainer_config.json") or {}
    versions = _json(run_dir / "weight_versions.json")
    k = max(1, min(10, len(steps) // 3 or 1))
    first, last = steps[:k], steps[-k:]

    def avg(rows: list[dict[str, Any]], key: str) -> float | None:
        return _mean([float(r[key]) for r in rows if isinstance(r.get(key), int | float)])

    syncs = [float(r["sync_s"]) for r in steps if isinstance(r.get("sync_s"), int | float)]
    facts = [
        ("model", cfg.get("model_name", "n/a")),
        (
            "weight bridge",
            (cfg.get("weights") or {}).get("type")  # a run before issue 47: the old pair
            or cfg.get("weight_bridge_mode", "n/a")
            + (" (single copy)" if cfg.get("single_copy") else ""),
        ),
        ("GRPO steps", f"{len(steps)} of {cfg.get('training_steps', '?')}"),
        (
            f"batch reward, first / last {k} steps",
            f"{_fmt(avg(first, 'score_mean'), '.3f')} / {_fmt(avg(last, 'score_mean'), '.3f')}",
        ),
        (
            f"format rate, first / last {k} steps",
            f"{_fmt(avg(first, 'format_rate'), '.1%')} / {_fmt(avg(last, 'format_rate'), '.1%')}",
        ),
        ("weight sync, median", f"{statistics.median(syncs):.3f} s" if syncs else "n/a"),
        ("weight version per server", json.dumps(versions) if versions else "n/a"),
    ]
    cells = "".join(
        f'<div class="fact"><div class="k">{escape(a)}</div><div class="v">{escape(str(b))}'
        "</div></div>"
        for a, b in facts
    )
    return f'<section id="summary"><h2>Run</h2><div class="facts">{cells}</div></section>'


def eval_section(run_dir: Path) -> str:
    from markdown_it import MarkdownIt

    path = run_dir / "eval.md"
    if not path.exists():
        body = _note("No SFT-vs-RL evaluation in this run (--eval-samples 0, or it stopped).")
    else:
        body = MarkdownIt("commonmark", {"html": False}).enable("table").render(path.read_text())
    return f'<section id="eval"><h2>SFT vs RL on held-out steps</h2>{body}</section>'


def curves_svg(steps: list[dict[str, Any]]) -> str:
    """Batch reward (and its running mean) and the rollouts' format rate per GRPO step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    x = [r["step"] for r in steps]
    reward = [float(r.get("score_mean", float("nan"))) for r in steps]
    k = max(1, len(steps) // 10)
    running = [statistics.fmean(reward[max(0, i - k + 1) : i + 1]) for i in range(len(reward))]
    fmt = [(r["step"], float(r["format_rate"])) for r in steps if "format_rate" in r]
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
    axes[0].plot(x, reward, marker="o", ms=3, label="batch mean")
    axes[0].plot(x, running, lw=2, label=f"running mean ({k})")
    if max(reward, default=0) > 10:  # DARS: one ROUGE hit is worth ~1000
        axes[0].set_yscale("symlog", linthresh=1.0)
    axes[0].set_title("Reward of the training batches")
    axes[1].plot(
        [s for s, _ in fmt], [v for _, v in fmt], marker="o", ms=3, color="C2", label="valid format"
    )
    axes[1].set_ylim(-0.02, 1.02)
    axes[1].set_title("Format rate of the training batches")
    for ax in axes:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("GRPO step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    buf = io.StringIO()
    fig.savefig(buf, format="svg")
    plt.close(fig)
    svg = buf.getvalue()
    return svg[svg.index("<svg") :]


def curves_section(steps: list[dict[str, Any]]) -> str:
    body = curves_svg(steps) if steps else _note("No GRPO step was logged.")
    return (
        f'<section id="curves"><h2>Reward and format rate per step</h2>'
        f'<div class="chart">{body}</div></section>'
    )


def confusion_table(m: dict[str, Any]) -> str:
    labels = m["confusion"]["labels"]
    matrix = m["confusion"]["matrix"]
    top = max((v for row in matrix.values() for v in row.values()), default=0) or 1
    head = "".join(f"<th>{escape(p)}</th>" for p in labels)
    rows = []
    for gold, row in matrix.items():
        cells = "".join(
            f'<td style="background: rgba(31, 119, 180, {0.08 + 0.85 * row[p] / top:.2f});'
            f'{" color: white;" if row[p] > top / 2 else ""}">{row[p]}</td>'
            for p in labels
        )
        rows.append(f"<tr><th>{escape(gold)}</th>{cells}</tr>")
    return (
        f'<table class="confusion"><tr><th>gold \\ predicted</th>{head}</tr>{"".join(rows)}</table>'
    )


def confusion_section(run_dir: Path) -> str:
    parts = []
    for label in ("sft", "rl"):
        m = _json(run_dir / f"eval_{label}" / "metrics.json")
        if m and "confusion" in m:
            title = (
                f"{label.upper()}: {m['n']} rows, exact match {m['exact_match']:.1%}, "
                f"type accuracy {m['type_accuracy']:.1%}"
            )
            parts.append(f'<div class="cm"><h3>{escape(title)}</h3>{confusion_table(m)}</div>')
    body = "".join(parts) or _note("No evaluation metrics in this run.")
    return (
        f'<section id="confusion"><h2>Action types: confusion matrix</h2>'
        f'<div class="cms">{body}</div></section>'
    )


def _action(a: Any) -> str:
    if not isinstance(a, dict):
        return "-" if a is None else str(a)
    attrs = " ".join(f"{k}={json.dumps(v)}" for k, v in a.items() if k != "type")
    return f"{a.get('type', '?')} {attrs}".strip()


def rollout_item(r: dict[str, Any]) -> str:
    verdict = "exact" if r.get("exact") else ("invalid" if r.get("valid") is False else "valid")
    reward = r.get("reward") or {}
    terms = "".join(
        f"<tr><td>{escape(k)}</td><td>{float(v):.3f}</td></tr>" for k, v in reward.items()
    )
    error = f'<p class="err">format error: {escape(str(r["error"]))}</p>' if r.get("error") else ""
    return (
        f'<details class="rollout {verdict}" data-step="{int(r.get("step", 0))}" '
        f'data-verdict="{verdict}">'
        f'<summary><span class="badge {verdict}">{verdict}</span> step {r.get("step")} '
        f"· policy v{r.get('policy_version')} · score {float(r.get('score', 0)):.3f} · "
        f"<b>{escape(_action(r.get('action')))}</b> "
        f'<span class="gold">gold: {escape(_action(r.get("gold_action")))}</span></summary>'
        f'<div class="body">{error}<div class="cols">'
        f"<div><h4>prompt (end)</h4><pre>{escape(r.get('prompt_tail', ''))}</pre></div>"
        f"<div><h4>completion</h4><pre>{escape(r.get('completion', ''))}</pre>"
        f'<h4>reward terms</h4><table class="terms">{terms or "<tr><td>n/a</td></tr>"}</table>'
        f"</div></div></div></details>"
    )


def rollouts_section(rows: list[dict[str, Any]]) -> str:
    if not rows:
        body = _note("No rollout samples (trainer/rollouts.jsonl is missing or empty).")
        return f'<section id="rollouts"><h2>Sample rollouts</h2>{body}</section>'
    steps = sorted({int(r.get("step", 0)) for r in rows})
    options = "".join(f'<option value="{s}">step {s}</option>' for s in steps)
    controls = (
        '<div class="controls"><select id="f-step"><option value="">all steps</option>'
        f'{options}</select><select id="f-verdict"><option value="">all</option>'
        '<option value="valid">valid</option><option value="invalid">invalid</option>'
        '<option value="exact">exact match</option></select>'
        '<input id="f-text" type="search" placeholder="search text">'
        f'<span class="count"><span id="shown">{len(rows)}</span> of {len(rows)} shown</span>'
        "</div>"
    )
    items = "".join(rollout_item(r) for r in rows)
    return (
        f'<section id="rollouts"><h2>Sample rollouts</h2>{controls}'
        f'<div id="rollout-list">{items}</div></section>'
    )


def build_report(run_dir: Path, out: Path | None = None) -> Path:
    """Write the run's page (``run_dir/report.html`` unless ``out``); returns its path."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"no run directory {run_dir}")
    steps = [r for r in _jsonl(run_dir / "trainer" / "metrics.jsonl") if "step" in r]
    rollouts = _jsonl(run_dir / "trainer" / "rollouts.jsonl")
    title = f"Shop-R1 run {run_dir.name}"
    page = (
        f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{escape(title)}'
        f"</title><style>{CSS}</style></head><body>"
        f'<header><h1>{escape(title)}</h1><span class="where">{escape(str(run_dir))}</span>'
        "</header><main>"
        + summary(run_dir, steps)
        + eval_section(run_dir)
        + curves_section(steps)
        + confusion_section(run_dir)
        + rollouts_section(rollouts)
        + f"</main><footer>launch/report.py, {datetime.now():%Y-%m-%d %H:%M:%S}; logs and "
        "raw files beside this page</footer>"
        f"<script>{SCRIPT}</script></body></html>"
    )
    out = out or run_dir / REPORT_NAME
    tmp = out.with_suffix(".tmp")
    tmp.write_text(page)
    tmp.replace(out)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        "python -m launch.report",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run_dir", type=Path, help="a run directory of launch/run_all.sh")
    p.add_argument(
        "--out", type=Path, default=None, help=f"where to write (default: RUN_DIR/{REPORT_NAME})"
    )
    args = p.parse_args(argv)
    try:
        path = build_report(args.run_dir, args.out)
    except FileNotFoundError as e:
        p.error(str(e))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
