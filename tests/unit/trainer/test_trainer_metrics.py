"""Step metrics reach the JSONL log (NaN as null) and TensorBoard event files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainer.metrics import MetricsLogger

pytestmark = pytest.mark.unit


def test_jsonl_and_tensorboard_events(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    m = MetricsLogger(tmp_path / "metrics.jsonl", tb_dir=tmp_path / "tb")
    m.log(1, {"loss": 0.5, "kl": float("nan"), "batch_id": "b1"})
    m.log(2, {"loss": 0.25, "kl": 0.01, "batch_id": "b2"})
    m.close()

    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["kl"] is None and rows[1]["kl"] == 0.01 and rows[1]["batch_id"] == "b2"

    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    loss = [(e.step, e.value) for e in acc.Scalars("loss")]
    assert loss == [(1, 0.5), (2, 0.25)]
    assert [e.step for e in acc.Scalars("kl")] == [2]  # the NaN was not written
