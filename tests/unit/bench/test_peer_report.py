"""bench/peers' reading of finished runs: the rates and breakdowns from the trainers' step rows,
ours' side from its run's files, the wall-time picks, paired and unpaired comparisons, a
recorded TRL side accepted only with the same start and settings, and the table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.peers.differences import NOT_MATCHED
from bench.peers.evaluate import recorded_steps, same_start
from bench.peers.peer_trl import recorded_trl
from bench.peers.report import (
    OURS_PARTS,
    TRL_PARTS,
    at_wall_time,
    breakdown,
    compare,
    elapsed,
    markdown,
    plus_minus,
    steady_rate,
    timeline,
    unpaired,
)
from bench.peers.settings import matched, resolve, resolve_plan, run_all_argv

pytestmark = pytest.mark.unit


def _rows(ends: list[float], ckpt: list[float], other: float = 10.0) -> list[dict]:
    return [
        {"step": i + 1, "time": e, "wait_s": 0.0, "step_s": other, "checkpoint_s": c, "sync_s": 0}
        for i, (e, c) in enumerate(zip(ends, ckpt, strict=True))
    ]


def test_steady_rate_and_breakdown() -> None:
    tl = timeline(_rows([110.0, 122.0, 137.0], [0.0, 2.0, 5.0]), OURS_PARTS)
    r = steady_rate(tl, 8)
    assert r["samples"] == 16 and r["seconds"] == 27.0 and r["checkpoint_seconds"] == 7.0
    assert r["samples_per_min"] == pytest.approx(16 / 27 * 60)
    assert r["samples_per_min_without_checkpoints"] == pytest.approx(16 / 20 * 60)
    bd = breakdown(tl, OURS_PARTS)
    assert bd["checkpoint"] == 3.5 and bd["trainer compute"] == 10.0 and bd["total"] == 13.5
    assert elapsed(tl) == {0: 0.0, 1: 10.0, 2: 22.0, 3: 37.0}  # step 1 began at 100
    with pytest.raises(ValueError):
        steady_rate(tl[:1], 8)


def test_skipped_updates_are_not_steps() -> None:
    rows = _rows([110.0, 122.0], [0.0, 0.0])
    rows.insert(1, {"step": 1, "time": 115.0, "skipped_update": True})
    assert [e["step"] for e in timeline(rows, OURS_PARTS)] == [1, 2]


def test_our_side_is_read_from_the_runs_files(tmp_path: Path) -> None:
    """side_ours reads no log: steps from the trainer's metrics.jsonl, groups generated,
    pushed and dropped from the env's env_metrics.jsonl, start time from ours_meta.json."""
    import json

    from bench.peers.peer_trl import side_ours

    plan = resolve(run_all_argv("cpu-tiny", tmp_path / "ours", 2, 1, 9), 1)
    run = tmp_path / "ours"
    (run / "trainer").mkdir(parents=True)
    rows = _rows([110.0, 122.0], [0.0, 1.0])
    (run / "trainer" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    groups = [
        {"kind": "group", "pushed": i % 3 != 0, "completion_tokens": 10 + i} for i in range(9)
    ]
    env_rows = [{"kind": "eval"}, *groups]
    (run / "env_metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in env_rows))
    meta = {"launched": 90.0, "loadavg_before": [1, 1, 1], "loadavg_after": [2, 2, 2]}
    (tmp_path / "ours_meta.json").write_text(json.dumps(meta))
    out = side_ours(plan, tmp_path)
    trained = 2 * plan.prompts_per_step
    assert out["groups"] == {"pushed": 6, "dropped_constant": 3, "trained": trained}
    assert out["generated_per_trained"] == round(9 / trained, 2)
    assert out["completion_tokens"] == 14.0 and out["startup_s"] == 10.0
    assert out["precision"].startswith(("fp32 (", "bf16 (")) and "thread" in out["threads"]


def test_wall_time_picks_the_latest_checkpoint_written_by_then() -> None:
    times = {0: 0.0, 2: 50.0, 4: 100.0, 6: 150.0}
    assert at_wall_time(times, [2, 4, 6], 120.0) == 4
    assert at_wall_time(times, [2, 4, 6], 150.0) == 6
    assert at_wall_time(times, [2, 4, 6], 40.0) == 0  # nothing yet: the start model


def test_paired_comparison_is_ours_minus_trl() -> None:
    trl = {"exact": [0, 0, 1, 0], "reward": [1.0, 2.0, 3.0, 4.0], "train_reward": [0, 0, 0, 0]}
    ours = {"exact": [1, 0, 1, 0], "reward": [2.0, 3.0, 4.0, 5.0], "train_reward": [1, 1, 1, 1]}
    c = compare(trl, ours)
    assert c["exact"]["diff"] == 0.25 and c["reward"]["diff"] == 1.0
    assert c["reward"]["se"] == 0.0 and c["exact"]["se"] == pytest.approx(0.25)


def test_markdown_names_the_box_and_the_smoke_label() -> None:
    tl_o = timeline(_rows([110.0, 120.0], [0.0, 1.0]), OURS_PARTS)
    trl_rows_ = [
        {"step": i, "time": t, **dict.fromkeys(TRL_PARTS, 1.0)} for i, t in ((1, 200.0), (2, 230.0))
    ]
    tl_t = timeline(trl_rows_, TRL_PARTS)
    side = lambda tl, parts: {  # noqa: E731
        "rate": steady_rate(tl, 8),
        "breakdown": breakdown(tl, parts),
    }
    zero = {"diff": 0.0, "se": 0.0}
    vec = {"exact": 0.1, "reward": 1.0, "train_reward": 0.5, "n": 4}
    res = {
        "smoke": True,
        "preset": "cpu-tiny",
        "trl_version": "1.16.0",
        "steps": 2,
        "command": "bench/peers/peer_trl.py --smoke",
        "machine": {"cpu": "Some CPU", "cpus": 2, "loadavg": [1.0], "time_utc": "now"},
        "settings": {
            "model": "/m/tiny",
            "prompts_per_step": 2,
            "group_size": 4,
            "samples_per_step": 8,
            "lr": 1e-4,
            "advantages": "Dr. GRPO",
            "kl_beta": 0.0,
            "temperature": 0.7,
            "max_tokens": 96,
            "reward": "no_dars",
        },
        "not_matched": NOT_MATCHED,
        "ours": side(tl_o, OURS_PARTS),
        "trl": side(tl_t, TRL_PARTS),
        "eval": {
            "rows": 4,
            "sft": vec,
            "comparisons": [
                {
                    "point": "16 samples",
                    "samples_ours": 16,
                    "samples_trl": 16,
                    "ours": vec,
                    "trl": vec,
                    "diff": dict.fromkeys(("exact", "reward", "train_reward"), zero),
                }
            ],
        },
    }
    md = markdown(res)
    assert md.startswith("# GRPO: this stack vs TRL 1.16.0")
    assert "SMOKE TEST" in md and "Some CPU" in md and "| 16 samples | 16 / 16 |" in md
    assert "3.00x" in md  # 8 samples in 10 s vs 8 in 30 s


def test_unpaired_comparison_against_a_recorded_side() -> None:
    trl = {"exact": 0.25, "reward": 2.0, "train_reward": 0.5, "n": 4}
    ours = {"exact": [1, 1, 0, 0], "reward": [2.0, 3.0, 4.0, 5.0], "train_reward": [1, 1, 1, 1]}
    c = unpaired(trl, ours)
    assert c["exact"]["diff"] == pytest.approx(0.25) and c["exact"]["paired"] is False
    assert c["exact"]["se"] == pytest.approx((0.25 * 0.75 / 4 + 0.5 * 0.5 / 4) ** 0.5)
    assert c["reward"] == {"diff": 1.5, "se": None, "paired": False}
    assert plus_minus(c["reward"]) == "+1.50 (unpaired, SE unknown)"
    assert plus_minus(c["exact"], 100, 1) == "+25.0 ± 33.1"


def test_a_recorded_trl_side_needs_the_same_start_and_settings(tmp_path: Path) -> None:
    plan = resolve_plan(1, preset="cpu-tiny", run_dir=tmp_path / "ours", steps=2, keep=9, seed=3)
    start = {"exact": 0.0703125, "reward": 41.16, "train_reward": 41.16, "n": 256}
    rec = {"rows": 256, "points": {"sft_step000000": start, "trl_step000002": start}}
    same_start(rec, 256, start)  # the same model on the same rows: accepted
    with pytest.raises(SystemExit, match="not the same start model or rows"):
        same_start(rec, 256, start | {"exact": 0.07421875})
    with pytest.raises(SystemExit, match="not the same start model or rows"):
        same_start(rec, 128, start)
    assert recorded_steps(rec) == {2: None}
    result = {"settings": matched(plan) | {"model": "/elsewhere"}, "steps": 2, "save_every": 1}
    path = tmp_path / "peer.json"
    path.write_text(json.dumps({"cpu-tiny": result | {"eval": rec, "trl": {}}}))
    assert recorded_trl(path, plan)["eval"] == rec  # another path to the model is fine
    path.write_text(json.dumps({"cpu-tiny": result | {"eval": rec, "settings": {"seed": 4}}}))
    with pytest.raises(SystemExit, match="TRL ran with other settings"):
        recorded_trl(path, plan)
    path.write_text(json.dumps({"cpu-smol": result | {"eval": rec}}))
    with pytest.raises(SystemExit, match="no evaluated cpu-tiny result"):
        recorded_trl(path, plan)
