"""Evaluation statistics: the reward split into its parts, standard errors, the Wilson
interval, the paired SFT-vs-RL difference, and the launcher's table and reward curve."""

from __future__ import annotations

import json
import math

import pytest

from env_server.eval_stats import (
    REWARD_COMPONENTS,
    compute_metrics,
    format_table,
    paired_difference,
    standard_error,
    wilson_interval,
)
from env_server.reward import score
from launch.eval_table import eval_table
from launch.reward_curve import reward_curve

pytestmark = pytest.mark.unit


def out(action: dict) -> str:
    return json.dumps({"rationale": "I want this.", "action": action})


GOLDS = [
    {"type": "click", "name": "add_to_cart"},
    {"type": "type_and_submit", "name": "search_input", "text": "wireless headphones"},
    {"type": "type_and_submit", "name": "search_input", "text": "wireless headphones"},
    {"type": "terminate"},
]
OUTS = [
    out({"type": "click", "name": "add_to_cart"}),  # exact: 0.5 + 0.3 + 0.2 + 1000 x 1
    # right type, name exact, text ROUGE-L 2/3 < 0.75: 0.5 + 0.3 + 0.1 + 0.1 + 0.1 x 1
    out({"type": "type_and_submit", "name": "search_input", "text": "wireless earbuds"}),
    out({"type": "terminate"}),  # valid, wrong type: 0.5
    "not json",  # 0
]


def test_reward_components_sum_to_the_total() -> None:
    m = compute_metrics(GOLDS, OUTS)
    parts = m["reward_components"]
    assert set(parts) == set(REWARD_COMPONENTS)
    assert parts["format"] == pytest.approx(3 * 0.5 / 4)
    assert parts["type"] == pytest.approx(2 * 0.3 / 4)
    assert parts["attr_presence"] == pytest.approx((0.2 + 0.1 + 0.1) / 4)
    assert parts["attr_rouge"] == pytest.approx(0.1 / 4)
    assert parts["dars"] == pytest.approx(1000.0 / 4)
    summed = sum(v for k, v in parts.items() if k != "no_dars")
    assert summed == pytest.approx(m["mean_reward"])
    assert parts["no_dars"] == pytest.approx(m["mean_reward"] - parts["dars"])
    totals = [score(t, g).total for g, t in zip(GOLDS, OUTS, strict=True)]
    assert m["per_sample"]["exact"] == [1, 0, 0, 0]
    assert m["per_sample"]["reward"] == pytest.approx(totals)
    # the reward without its DARS part, row by row: its mean is the no_dars part
    assert sum(m["per_sample"]["reward_no_dars"]) / 4 == pytest.approx(parts["no_dars"])
    assert m["per_sample"]["reward_no_dars"][0] == pytest.approx(totals[0] - 1000.0)
    assert m["binary_reward"] == m["exact_match"] == pytest.approx(0.25)
    assert m["mean_reward_se"] == pytest.approx(standard_error(totals))
    assert "reward parts: format 0.375" in format_table(m)


def test_standard_errors_and_wilson_interval() -> None:
    assert standard_error([1.0, 3.0]) == pytest.approx(1.0)  # sd sqrt(2) / sqrt(2)
    assert standard_error([5.0]) == 0.0
    lo, hi = wilson_interval(0, 10)
    assert lo == 0.0 and 0.25 < hi < 0.35  # the normal approximation would give [0, 0]
    lo, hi = wilson_interval(50, 100)
    assert lo == pytest.approx(0.5 - hi + 0.5) and hi == pytest.approx(
        0.5962, abs=1e-4
    )  # (0.4038, 0.5962)
    m = compute_metrics(GOLDS, OUTS)
    assert m["exact_match_se"] == pytest.approx(math.sqrt(0.25 * 0.75 / 4))
    assert m["exact_match_ci95"] == pytest.approx(list(wilson_interval(1, 4)))
    with pytest.raises(ValueError):
        wilson_interval(3, 2)


def test_paired_difference_cancels_row_difficulty() -> None:
    # Every row gains exactly 1: the paired SE is 0 although both samples vary a lot.
    d, se = paired_difference([0.0, 10.0, 20.0], [1.0, 11.0, 21.0])
    assert d == pytest.approx(1.0) and se == 0.0
    d, se = paired_difference([0, 0, 1, 1], [1, 0, 1, 1])
    assert d == pytest.approx(0.25) and se == pytest.approx(0.25)
    with pytest.raises(ValueError):
        paired_difference([1.0], [1.0, 2.0])


def test_eval_table_shows_every_part_and_the_paired_gain() -> None:
    sft = compute_metrics(GOLDS, ["bad"] * 2 + OUTS[2:])
    rl = compute_metrics(GOLDS, OUTS)
    sft["oracle_exact_match"] = 0.5
    table = eval_table(sft, rl, "note")
    assert "| exact match | 0.0% [0.0%, 49.0%] | 25.0% [4.6%, 69.9%] | +25.0 pts (n/a) |" in table
    for label in ("format (0.5)", "type (0.3)", "DARS x ROUGE-L", "without the DARS", "binary"):
        assert label in table
    assert "exact match, RL - SFT on the same 4 rows (paired): +25.00 points ± 25.00" in table
    gain = sum(rl["per_sample"]["reward_no_dars"][:2]) / 4  # rows 0-1: 'bad' in the SFT run
    line = f"reward without the DARS part, RL - SFT on the same 4 rows (paired): {gain:+.2f} ±"
    assert line in table
    assert "best reachable exact match on these rows (simulated users): 50.0%" in table
    # Metrics without the new keys (an older metrics.json) still give the basic rows.
    old = {
        k: sft[k]
        for k in ("exact_match", "type_accuracy", "macro_f1", "format_rate", "mean_reward")
    }
    assert "| macro-F1 |" in eval_table(old, old, "n") and "paired" not in eval_table(old, old, "")


def test_reward_curve_plots_trainer_and_env_metrics(tmp_path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(
        "".join(
            json.dumps({"step": s, "score_mean": 0.5 + 100 * (s % 2)}) + "\n" for s in range(1, 7)
        )
    )
    env = tmp_path / "env_metrics.jsonl"
    env.write_text(
        "".join(
            json.dumps(
                {
                    "kind": "group",
                    "policy_version": v,
                    "valid": 0.5,
                    "type_match": 0.25,
                    "exact_match": 0.0,
                }
            )
            + "\n"
            for v in (0, 0, 1, 3)
        )
        + '{"kind": "summary"}\n'
    )
    png = tmp_path / "reward_curve.png"
    reward_curve(metrics, png)
    assert png.stat().st_size > 10_000
    alone = tmp_path / "alone" / "curve.png"
    alone.parent.mkdir()
    reward_curve(metrics, alone)  # no env metrics beside it: the trainer's panel only
    assert alone.stat().st_size > 5_000
