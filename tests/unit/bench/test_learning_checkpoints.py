"""bench.learning.checkpoints: the trainer's wall time to each step, and the table of a run's
checkpoints paired with its SFT evaluation (built from constructed files: no model runs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.learning import checkpoints

pytestmark = pytest.mark.unit


def _metrics(exact: list[int], reward: list[float], split: str = "validation") -> dict:
    n = len(exact)
    return {
        "n": n,
        "split": split,
        "exact_match": sum(exact) / n,
        "type_accuracy": 0.5,
        "macro_f1": 0.25,
        "mean_reward": sum(reward) / n,
        "per_sample": {"exact": exact, "reward": reward},
    }


def test_wall_time_counts_from_the_wait_for_the_first_batch(tmp_path: Path) -> None:
    (tmp_path / "trainer").mkdir()
    rows = [
        {"step": 1, "time": 1000.0, "wait_s": 40.0, "step_s": 60.0, "sync_s": 1.0},
        {"step": 2, "time": 1070.0, "wait_s": 0.0, "step_s": 69.0, "sync_s": 1.0},
    ]
    text = "\n".join(json.dumps(r) for r in rows) + "\n"
    (tmp_path / "trainer" / "metrics.jsonl").write_text(text)
    assert checkpoints.wall_to_step(tmp_path) == {1: 101.0, 2: 171.0}


def test_the_table_pairs_every_checkpoint_with_the_sft_rows() -> None:
    sft = _metrics([0, 1, 0, 0], [0.0, 100.0, 0.0, 0.0])
    step10 = _metrics([1, 1, 0, 0], [10.0, 100.0, 0.0, 0.0])
    rows = [
        checkpoints.row("SFT", 0, None, sft, sft),
        checkpoints.row("GRPO checkpoint", 10, 600.0, step10, sft),
    ]
    assert rows[1]["exact_vs_sft"] == pytest.approx(0.25) and rows[1]["reward_vs_sft"] == 2.5
    text = checkpoints.table(rows, "validation", 4)
    assert text.startswith("4 validation steps, greedy;")
    lines = text.splitlines()
    assert lines[-2].startswith("| SFT | 0 |  | 25.0% |  |")
    assert lines[-1].startswith("| GRPO checkpoint | 10 | 10.0 min | 50.0% | +25.0 ± 25.0 |")
    with pytest.raises(ValueError):  # another number of rows cannot be paired
        checkpoints.row("x", 1, None, _metrics([1, 0], [1.0, 0.0]), sft)
