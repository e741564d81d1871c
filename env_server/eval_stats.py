"""What an evaluation of Shop-R1 predictions reports (paper Tables 2-3, env_server/evaluate.py
runs it): exact match, action-type accuracy, precision/F1 per action type, macro-F1, the mean
reward and its parts (``reward_components``), standard errors, a 95% Wilson interval for exact
match, paired differences between two evaluations of the same rows, the printed table and the
confusion plot.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from env_server.actions import ACTION_TYPES, actions_equal
from env_server.reward import (
    ParsedOutput,
    RewardBreakdown,
    RewardConfig,
    parse_output,
    score,
)

INVALID = "invalid"
"""Predicted label of a completion that fails the format check."""


def compute_metrics(
    golds: Sequence[Mapping[str, Any]], completions: Sequence[str]
) -> dict[str, Any]:
    """Metrics of raw completions against gold actions (a format failure counts as wrong).

    Macro-F1 averages the F1 of the three action types; an invalid prediction is a false
    negative of its gold type and a false positive of none.
    """
    if len(golds) != len(completions) or not golds:
        raise ValueError(
            f"need as many completions as golds (>0), got {len(completions)}/{len(golds)}"
        )
    labels = [*ACTION_TYPES, INVALID]
    confusion = {g: dict.fromkeys(labels, 0) for g in ACTION_TYPES}
    exact = {t: 0 for t in ACTION_TYPES}
    support = {t: 0 for t in ACTION_TYPES}
    cfg = RewardConfig()
    rewards: list[float] = []
    no_dars: list[float] = []
    hits: list[int] = []
    parts = dict.fromkeys(REWARD_COMPONENTS, 0.0)
    for gold, text in zip(golds, completions, strict=True):
        parsed = parse_output(text)
        pred = parsed.action["type"] if isinstance(parsed, ParsedOutput) else INVALID
        confusion[gold["type"]][pred] += 1
        support[gold["type"]] += 1
        hit = isinstance(parsed, ParsedOutput) and actions_equal(parsed.action, gold)
        exact[gold["type"]] += hit
        hits.append(int(hit))
        r = score(text, dict(gold), cfg)
        rewards.append(r.total)
        split = reward_components(r, gold["type"], cfg)
        no_dars.append(split["no_dars"])
        for k, v in split.items():
            parts[k] += v
    per_type = {}
    for t in ACTION_TYPES:
        tp = confusion[t][t]
        predicted = sum(confusion[g][t] for g in ACTION_TYPES)
        p = tp / predicted if predicted else 0.0
        r = tp / support[t] if support[t] else 0.0
        per_type[t] = {
            "support": support[t],
            "precision": p,
            "recall": r,  # = type accuracy on this type's steps
            "f1": 2 * p * r / (p + r) if p + r else 0.0,
            "exact_match": exact[t] / support[t] if support[t] else 0.0,
        }
    present = [t for t in ACTION_TYPES if support[t]]
    n = len(golds)
    em = sum(hits) / n
    return {
        "n": n,
        "exact_match": em,
        "exact_match_se": math.sqrt(em * (1 - em) / n),
        "exact_match_ci95": list(wilson_interval(sum(hits), n)),
        "type_accuracy": sum(confusion[t][t] for t in ACTION_TYPES) / n,
        "macro_f1": sum(per_type[t]["f1"] for t in present) / len(present),
        "format_rate": 1.0 - sum(confusion[g][INVALID] for g in ACTION_TYPES) / n,
        "mean_reward": sum(rewards) / n,
        "mean_reward_se": standard_error(rewards),
        # The paper's 'binary' ablation reward (1 for an exact action match) is exact match
        # itself; named here so the reward table shows both rewards side by side.
        "binary_reward": em,
        "reward_components": {k: v / n for k, v in parts.items()},
        "per_type": per_type,
        "confusion": {"labels": labels, "matrix": {g: confusion[g] for g in ACTION_TYPES}},
        "per_sample": {"exact": hits, "reward": rewards, "reward_no_dars": no_dars},
    }


REWARD_COMPONENTS = ("format", "type", "attr_presence", "attr_rouge", "dars", "no_dars")
"""Parts of the mean reward in ``metrics["reward_components"]``: ``format`` (0.5), ``type``
(0.3), ``attr_presence`` (name/text given), ``attr_rouge`` (the ROUGE-L credit that DARS does
not scale: a type_and_submit's name), ``dars`` (DARS x ROUGE-L of the hard attribute: a
click's name, a type_and_submit's text) and ``no_dars`` (the total without the DARS part)."""


def reward_components(r: RewardBreakdown, gold_type: str, cfg: RewardConfig) -> dict[str, float]:
    """One completion's reward split into :data:`REWARD_COMPONENTS` (they sum to ``total``,
    ``no_dars`` aside). The hard attribute is the one ``cfg.dars_factor`` scales."""
    dars = r.name_similarity if gold_type == "click" else r.text_similarity
    rouge = r.name_similarity if gold_type == "type_and_submit" else 0.0
    if cfg.mode == "binary":
        dars = rouge = 0.0
    return {
        "format": r.format,
        "type": r.type,
        "attr_presence": r.name + r.text,
        "attr_rouge": rouge,
        "dars": dars,
        "no_dars": r.total - dars,
    }


def standard_error(values: Sequence[float]) -> float:
    """Standard error of the mean (sample standard deviation / sqrt(n)); 0 for n < 2."""
    n = len(values)
    if n < 2:
        return 0.0
    mean = sum(values) / n
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n)


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval of a proportion (95% for z = 1.96); sound near 0 and 1 and for
    small n, where the normal approximation gives bounds outside [0, 1]."""
    if n <= 0 or not 0 <= successes <= n:
        raise ValueError(f"need 0 <= successes <= n and n > 0, got {successes}/{n}")
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def paired_difference(a: Sequence[float], b: Sequence[float]) -> tuple[float, float]:
    """Mean of ``b - a`` over the same rows and its standard error (paired: the rows' own
    difficulty cancels, so this is much tighter than comparing two independent means)."""
    if len(a) != len(b) or not a:
        raise ValueError(f"need two equally long non-empty samples, got {len(a)} and {len(b)}")
    d = [y - x for x, y in zip(a, b, strict=True)]
    return sum(d) / len(d), standard_error(d)


def oracle_exact_match(alternatives: Sequence[str]) -> float | None:
    """Expected exact match of the best possible predictor on simulated data (else None).

    The simulated shopper draws each gold action from a known distribution; always naming the
    most likely action is right with probability max_a p(a). Real data carries no such bound.
    """
    probs = [json.loads(a) for a in alternatives]
    if not probs or any(not p for p in probs):
        return None
    return sum(p[0][1] for p in probs) / len(probs)


def format_table(m: Mapping[str, Any]) -> str:
    """The paper-style table: overall metrics, then one line per action type."""
    lines = [
        f"steps {m['n']}  exact match {100 * m['exact_match']:.2f}%  "
        f"type accuracy {100 * m['type_accuracy']:.2f}%  macro-F1 {100 * m['macro_f1']:.2f}%  "
        f"valid format {100 * m['format_rate']:.1f}%  mean reward {m['mean_reward']:.2f}",
    ]
    if "exact_match_ci95" in m:
        lo, hi = m["exact_match_ci95"]
        parts = "  ".join(f"{k} {v:.3f}" for k, v in m["reward_components"].items())
        lines += [
            f"exact match 95% CI [{100 * lo:.1f}%, {100 * hi:.1f}%]  mean reward "
            f"{m['mean_reward']:.2f} +- {m['mean_reward_se']:.2f} (SE)",
            f"reward parts: {parts}",
        ]
    lines.append(
        f"{'type':<16}{'support':>8}{'exact':>9}{'type acc':>10}{'precision':>11}{'F1':>8}"
    )
    for t, r in m["per_type"].items():
        lines.append(
            f"{t:<16}{r['support']:>8}{100 * r['exact_match']:>8.2f}%{100 * r['recall']:>9.2f}%"
            f"{100 * r['precision']:>10.2f}%{100 * r['f1']:>7.2f}%"
        )
    if m.get("oracle_exact_match") is not None:
        lines.append(
            f"(best reachable exact match on this simulated split: "
            f"{100 * m['oracle_exact_match']:.2f}%)"
        )
    return "\n".join(lines)


def plot_confusion(m: Mapping[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = m["confusion"]["labels"]
    golds = list(m["confusion"]["matrix"])
    grid = [[m["confusion"]["matrix"][g][p] for p in labels] for g in golds]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.imshow(grid, cmap="Blues")
    ax.set_xticks(range(len(labels)), labels, rotation=20)
    ax.set_yticks(range(len(golds)), golds)
    ax.set_xlabel("predicted type")
    ax.set_ylabel("gold type")
    top = max(max(r) for r in grid) or 1
    for i, row in enumerate(grid):
        for j, v in enumerate(row):
            color = "white" if v > top / 2 else "black"  # readable on dark cells
            ax.text(j, i, str(v), ha="center", va="center", color=color)
    ax.set_title(f"Action types (exact match {100 * m['exact_match']:.1f}%)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
