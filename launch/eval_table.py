"""The SFT-vs-RL table of ``launch/run_all.sh`` (``eval.md`` in the run directory): every
metric of both evaluations (launch/evaluation.py) in markdown, with its 95% interval or
standard error, the relative change, and the paired differences on the same held-out rows
(env_server.eval_stats.paired_difference).
"""

from __future__ import annotations

METRICS = [
    ("exact_match", "exact match", "pct"),
    ("type_accuracy", "type accuracy", "pct"),
    ("macro_f1", "macro-F1", "pct"),
    ("format_rate", "format rate", "pct"),
    ("mean_reward", "mean reward (paper: DARS 1000)", "reward"),
    ("reward_components.format", "reward part: format (0.5)", "part"),
    ("reward_components.type", "reward part: type (0.3)", "part"),
    ("reward_components.attr_presence", "reward part: attribute presence", "part"),
    ("reward_components.attr_rouge", "reward part: attribute ROUGE-L (unscaled)", "part"),
    ("reward_components.dars", "reward part: DARS x ROUGE-L (hard attribute)", "reward"),
    ("reward_components.no_dars", "reward without the DARS part", "part"),
    ("binary_reward", "binary reward (exact action, paper ablation)", "part"),
]
"""Rows of the SFT-vs-RL table: (key in env_server.evaluate's metrics.json, dotted for nested
keys; label; how to print it). A key missing from either side's metrics is left out."""


def _metric(m: dict, key: str) -> float | None:
    for part in key.split("."):
        if not isinstance(m, dict) or part not in m:
            return None
        m = m[part]
    return float(m)  # type: ignore[arg-type]


def _cell(m: dict, key: str, kind: str) -> str:
    v = _metric(m, key)
    assert v is not None
    if kind == "pct":
        ci = m.get(f"{key}_ci95")
        return f"{v:.1%}" + (f" [{ci[0]:.1%}, {ci[1]:.1%}]" if ci else "")
    if kind == "reward":
        se = m.get(f"{key}_se")
        return f"{v:.2f}" + (f" ± {se:.2f}" if se is not None else "")
    return f"{v:.3f}"


def _paired_line(sft: dict, rl: dict, key: str, label: str, scale: float, unit: str) -> str:
    from env_server.eval_stats import paired_difference

    a, b = sft.get("per_sample", {}).get(key), rl.get("per_sample", {}).get(key)
    if not a or not b or len(a) != len(b):
        return ""
    d, se = paired_difference(a, b)
    z = f", {d / se:+.1f} SE" if se else ""
    return (
        f"- {label}, RL - SFT on the same {len(a)} rows (paired): "
        f"{scale * d:+.2f}{unit} ± {scale * se:.2f}{unit} (SE){z}\n"
    )


def eval_table(sft: dict, rl: dict, note: str) -> str:
    """Markdown table of every metric for SFT and RL (95% CI for exact match, ± SE for the
    reward), the relative change, then the paired differences of exact match and reward."""
    rows = ["| metric | SFT | RL | change |", "|---|---|---|---|"]
    for key, label, kind in METRICS:
        a, b = _metric(sft, key), _metric(rl, key)
        if a is None or b is None:
            continue
        rel = f"{100 * (b - a) / abs(a):+.0f}%" if a else "n/a"
        if kind == "pct":
            rel = f"{100 * (b - a):+.1f} pts ({rel})"
        rows.append(f"| {label} | {_cell(sft, key, kind)} | {_cell(rl, key, kind)} | {rel} |")
    paired = _paired_line(sft, rl, "exact", "exact match", 100, " points")
    paired += _paired_line(sft, rl, "reward", "mean reward", 1, "")
    paired += _paired_line(sft, rl, "reward_no_dars", "reward without the DARS part", 1, "")
    oracle = sft.get("oracle_exact_match")
    if oracle is not None:
        paired += f"- best reachable exact match on these rows (simulated users): {oracle:.1%}\n"
    return "\n".join(rows) + "\n\n" + paired + f"\n{note}\n"
