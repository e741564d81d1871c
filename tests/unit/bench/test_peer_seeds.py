"""bench/peers/seeds.py: each seed's rates, ratio and paired differences read from a peer_trl
result (the committed cpu-smol one, docs/results/peer_trl_smol.json, as the shape), their mean
and spread over seeds, the curve drawn, and the per-seed command it runs."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest

from bench.peers.seeds import main, peer_argv, seed_row

pytestmark = pytest.mark.unit
RESULT = Path(__file__).resolve().parents[3] / "docs" / "results" / "peer_trl_smol.json"


def _result(ours_rate: float, trl_rate: float, exact_diff: float) -> dict:
    res = copy.deepcopy(json.loads(RESULT.read_text())["cpu-smol"])
    res["ours"]["rate"]["samples_per_min"] = ours_rate
    res["trl"]["rate"]["samples_per_min"] = trl_rate
    for row in res["eval"]["comparisons"]:
        row["diff"]["exact"] = {"diff": exact_diff, "se": 0.02}
    return res


def test_one_seed_row_reads_the_rates_the_last_points_and_both_comparisons() -> None:
    res = json.loads(RESULT.read_text())["cpu-smol"]
    row = seed_row(res)
    assert row["ratio"] == pytest.approx(25.062282759106857 / 5.25, rel=1e-2)
    assert row["start_exact"] == pytest.approx(11.328125)
    assert row["exact"] == pytest.approx({"ours": 17.96875, "trl": 5.859375})
    assert row["samples"] == {"ours": 256, "trl": 256}
    assert row["same_samples"]["diff"] == pytest.approx(12.109375)
    assert row["same_wall"]["point"] == "11.0 min of training"
    assert row["same_wall"]["diff"] == pytest.approx(100 * (0.1796875 - 0.11328125))
    same = [c for c in res["eval"]["comparisons"] if "wall_s" not in c][-1]
    assert row["reward"] == {"ours": same["ours"]["reward"], "trl": same["trl"]["reward"]}
    assert row["reward_same_samples"] == same["diff"]["reward"]


def test_the_report_gives_each_seed_and_the_spread_and_draws_the_curve(tmp_path: Path) -> None:
    for seed, (ours, trl, diff) in enumerate([(30.0, 10.0, 0.10), (24.0, 12.0, 0.02)]):
        (tmp_path / f"seed{seed}").mkdir()
        data = {"cpu-smol": _result(ours, trl, diff)}
        (tmp_path / f"seed{seed}" / "peer.json").write_text(json.dumps(data))
    (tmp_path / "seed7").mkdir()  # unfinished: no peer.json, left out
    assert main(["--out", str(tmp_path), "--report"]) == 0
    result = json.loads((tmp_path / "result.json").read_text())
    assert sorted(result["seeds"]) == ["0", "1"]
    assert result["seeds"]["0"]["ratio"] == pytest.approx(3.0)
    assert result["summary"]["ratio"]["mean"] == pytest.approx(2.5)
    assert result["summary"]["ratio"]["sd"] == pytest.approx(2**0.5 / 2)
    assert result["summary"]["same_samples"]["mean"] == pytest.approx(6.0)
    table = (tmp_path / "table.md").read_text()
    assert "| 0 | 30.0 / 10.0 | 3.00x |" in table
    assert "| mean of 2 | | 2.50x (sd 0.71, 2.00 to 3.00) |" in table
    reward = result["seeds"]["0"]["reward_same_samples"]["diff"]
    assert result["summary"]["reward_same_samples"]["mean"] == pytest.approx(reward)
    assert f"({reward:+.1f} ± " in table.splitlines()[2]  # seed 0's row: the reward column
    png = (tmp_path / "curve.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000


def test_a_seed_runs_peer_trl_with_its_own_seed_out_and_work_dir(tmp_path: Path) -> None:
    argv = peer_argv(tmp_path, 2, ["--preset", "cpu-smol", "--trl-generation", "vllm-colocate"])
    assert argv[:3] == [sys.executable, "-m", "bench.peers.peer_trl"]
    tail = argv[3:]
    assert tail[:4] == ["--preset", "cpu-smol", "--trl-generation", "vllm-colocate"]
    assert tail[tail.index("--seed") + 1] == "2"
    assert tail[tail.index("--out") + 1] == str(tmp_path / "seed2" / "peer.json")
    assert tail[tail.index("--work-dir") + 1] == str(tmp_path / "seed2" / "work")
    with pytest.raises(SystemExit, match="sets --out, --work-dir, --seed itself"):
        peer_argv(tmp_path, 0, ["--seed=3"])
    each = peer_argv(tmp_path, 1, ["--trl-result", "old/seed{seed}/peer.json"])
    assert each[3:5] == ["--trl-result", "old/seed1/peer.json"]  # that seed's recorded run


def test_no_finished_seed_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="no finished seed"):
        main(["--out", str(tmp_path), "--report"])


def test_a_recorded_trl_side_is_reported_as_unpaired(tmp_path: Path) -> None:
    res = _result(30.0, 10.0, 0.05) | {"trl_result": "/old/seed0/peer.json"}
    for row in res["eval"]["comparisons"]:
        row["diff"]["exact"]["paired"] = False
        row["diff"]["reward"] = {"diff": -3.0, "se": None, "paired": False}
    (tmp_path / "seed0").mkdir()
    (tmp_path / "seed0" / "peer.json").write_text(json.dumps({"cpu-smol": res}))
    assert main(["--out", str(tmp_path), "--report"]) == 0
    table = (tmp_path / "table.md").read_text()
    assert "(-3.0 (unpaired, SE unknown))" in table.splitlines()[2]
    assert "TRL's side recorded by earlier runs (--trl-result; seeds 0)" in table
    assert json.loads((tmp_path / "result.json").read_text())["seeds"]["0"]["same_samples"] == {
        "diff": 5.0,
        "se": 2.0,
        "paired": False,
    }
