"""bench.learning.trained_groups: the groups a run's env scored, per gold action type and half
of the run's policy versions, from its env_metrics.jsonl and the train split."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.learning import trained_groups
from settings import paths

pytestmark = pytest.mark.unit


def _group(row: dict, version: int, pushed: bool, type_match: float) -> str:
    g = {"kind": "group", "row": {"session_id": row["session_id"], "step": row["step"]}}
    return json.dumps({**g, "policy_version": version, "pushed": pushed, "type_match": type_match})


def test_groups_are_counted_per_gold_type_and_half(tmp_path: Path, capsys) -> None:
    from env_server.data.dataset import load_or_build

    data = tmp_path / "art" / paths.DATA_DIR.relative_to(paths.ARTIFACTS)
    rows = load_or_build(data, 12)["train"].to_list()
    by_type: dict[str, dict] = {}
    for r in rows:
        by_type.setdefault(json.loads(r["action"])["type"], r)
    leave, click = by_type["terminate"], by_type["click"]
    run = tmp_path / "run"
    run.mkdir()
    lines = [
        _group(leave, 0, True, 0.75),  # versions 0-3: halves 0-1 and 2-3
        _group(leave, 1, False, 1.0),  # dropped as constant: sampled all the same, counted
        _group(leave, 2, True, 0.25),
        _group(leave, 3, True, 0.0),
        _group(click, 0, True, 0.5),
        json.dumps({"kind": "summary", "pushed": 4, "dropped": 1}),
    ]
    (run / "env_metrics.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "groups.json"
    assert trained_groups.main([str(run), "--data", str(data), "--json", str(out)]) == 0
    got = json.loads(out.read_text())[str(run)]
    assert got["halves_split_at"] == 2
    assert got["by_gold_type"]["terminate"] == {
        "groups": [2, 2],
        "pushed": [1, 2],
        "type_match": [pytest.approx(0.875), pytest.approx(0.125)],
    }
    assert got["by_gold_type"]["click"] == {
        "groups": [1, 0],
        "pushed": [1, 0],
        "type_match": [0.5, None],
    }
    printed = capsys.readouterr().out
    assert "| terminate | 2 (1) | 0.88 | 2 (2) | 0.12 |" in printed
    assert "| click | 1 (1) | 0.50 | 0 (0) | - |" in printed


def test_a_row_outside_the_train_split_is_an_error(tmp_path: Path) -> None:
    from env_server.data.dataset import load_or_build

    data = tmp_path / "art" / paths.DATA_DIR.relative_to(paths.ARTIFACTS)
    test_row = load_or_build(data, 12)["test"].to_list()[0]
    run = tmp_path / "run"
    run.mkdir()
    (run / "env_metrics.jsonl").write_text(_group(test_row, 0, True, 1.0) + "\n")
    with pytest.raises(SystemExit, match="not in the train split"):
        trained_groups.main([str(run), "--data", str(data)])
