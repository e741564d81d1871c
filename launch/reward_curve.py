"""The reward curve of ``launch/run_all.sh`` (``reward_curve.png`` in the run directory): the
trainer's batch reward per GRPO step (``trainer/metrics.jsonl``) and, from the env's group
metrics (``env_metrics.jsonl``), the format / type / exact-match rates of the rollouts per
policy version. The run's page (launch/report.py) draws its own curves as inline SVG.
"""

from __future__ import annotations

import json
from pathlib import Path


def _env_rates(env_metrics: Path) -> dict[str, list[tuple[int, float]]]:
    """Per policy version, the mean over the env's pushed groups of each [0, 1] rate."""
    by_version: dict[int, list[dict]] = {}
    for line in env_metrics.read_text().splitlines():
        row = json.loads(line) if line.strip() else {}
        if row.get("kind") == "group" and row.get("pushed", True):
            by_version.setdefault(int(row["policy_version"]), []).append(row)
    out: dict[str, list[tuple[int, float]]] = {}
    for key in ("valid", "type_match", "exact_match"):
        out[key] = [
            (v, sum(float(r.get(key, 0.0)) for r in rs) / len(rs))
            for v, rs in sorted(by_version.items())
        ]
    return out


def reward_curve(metrics_path: Path, png: Path, env_metrics: Path | None = None) -> None:
    """The trainer's batch reward per step and, from the env's group metrics
    (``env_metrics.jsonl`` beside ``png`` unless given), the format / type / exact-match rates
    of the rollouts per policy version."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    env_metrics = env_metrics or png.parent / "env_metrics.jsonl"
    rates = _env_rates(env_metrics) if env_metrics.exists() else {}
    fig, axes = plt.subplots(1, 2 if rates else 1, figsize=(11 if rates else 6, 3.8))
    ax = axes[0] if rates else axes
    steps = [r["step"] for r in rows]
    ax.plot(steps, [r["score_mean"] for r in rows], marker="o", ms=3, label="batch mean")
    k = max(1, len(rows) // 10)  # a running mean: one batch is a handful of prompts
    run = [
        sum(r["score_mean"] for r in rows[max(0, i - k + 1) : i + 1]) / min(k, i + 1)
        for i in range(len(rows))
    ]
    ax.plot(steps, run, lw=2, label=f"running mean ({k})")
    if max(r["score_mean"] for r in rows) > 10:  # DARS: one ROUGE hit is worth ~1000
        ax.set_yscale("symlog", linthresh=1.0)
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("Shop-R1 reward (symlog above 1)")
    ax.set_title("Training batches: total reward")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    if rates:
        labels = {"valid": "valid format", "type_match": "type match", "exact_match": "exact"}
        for key, pts in rates.items():
            axes[1].plot(
                [v for v, _ in pts], [y for _, y in pts], marker="o", ms=3, label=labels[key]
            )
        axes[1].set_ylim(0, 1)
        axes[1].set_xlabel("policy version of the rollouts")
        axes[1].set_ylabel("rate in the env's pushed groups")
        axes[1].set_title("Rollouts: reward components")
        axes[1].legend(fontsize=8)
        axes[1].grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
