"""bench.learning.seeds: the phase times it reads from the launcher's console, what it copies
into a seed's artifacts, and the per-seed and across-seed table it builds."""

from __future__ import annotations

import json
import shlex
import statistics
from pathlib import Path

import pytest

from bench.learning import seeds
from settings import paths

pytestmark = pytest.mark.unit


def test_phase_times_read_the_launchers_done_lines() -> None:
    console = "\n".join(
        [
            "[run_all] SFT | 449/450 steps (99%) | loss 0.5 | 17:40 elapsed",
            "[run_all] SFT done | 450/450 steps (100%) | loss 0.498 | 17:52 elapsed",
            "[run_all] GRPO done | 120/120 steps | reward 0.8 | 1:13:55 elapsed",
            "[run_all] something else | 0:03 elapsed",
        ]
    )
    assert seeds.phase_times(console) == {"SFT": 17 * 60 + 52, "GRPO": 3600 + 13 * 60 + 55}


def test_a_seed_gets_the_base_model_and_the_dataset_never_an_sft_model(tmp_path: Path) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    for d in (paths.TINY_MODEL_DIR, paths.DATA_DIR, paths.SFT_MODEL_DIR):
        (src / d.relative_to(paths.ARTIFACTS)).mkdir(parents=True)
        (src / d.relative_to(paths.ARTIFACTS) / "f").write_text(d.name)
    seeds.seed_artifacts(src, dst)
    assert (dst / paths.TINY_MODEL_DIR.relative_to(paths.ARTIFACTS) / "f").read_text()
    assert (dst / paths.DATA_DIR.relative_to(paths.ARTIFACTS) / "f").exists()
    assert not (dst / paths.SFT_MODEL_DIR.relative_to(paths.ARTIFACTS)).exists()


def _finished(out: Path, seed: int, sft: dict, rl: dict, wall: float) -> None:
    for name, m in (("eval_sft", sft), ("eval_rl", rl)):
        (out / f"seed{seed}" / name).mkdir(parents=True)
        metrics = {**m, "n": len(m["per_sample"]["exact"])}
        (out / f"seed{seed}" / name / "metrics.json").write_text(json.dumps(metrics))
    (out / f"seed{seed}" / "times.json").write_text(json.dumps({"wall_s": wall}))


def _m(exact: list[int], reward: list[float], type_acc: float, f1: float) -> dict:
    return {
        "per_sample": {"exact": exact, "reward": reward},
        "type_accuracy": type_acc,
        "macro_f1": f1,
    }


def test_the_table_pairs_each_seed_and_spreads_the_gains(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "seeds"
    # seed 0: exact 1/4 -> 3/4 (+50 points), seed 1: 2/4 -> 2/4 (+0); rewards and aggregates
    _finished(
        out,
        0,
        _m([1, 0, 0, 0], [1, 0, 0, 0], 0.5, 0.4),
        _m([1, 1, 1, 0], [2, 2, 2, 0], 0.75, 0.5),
        600,
    )
    _finished(
        out,
        1,
        _m([1, 1, 0, 0], [1, 1, 0, 0], 0.5, 0.4),
        _m([1, 0, 1, 0], [1, 0, 1, 0], 0.25, 0.3),
        900,
    )
    (out / "seed2").mkdir()  # unfinished: left out
    assert seeds.main(["--out", str(out), "--report"]) == 0
    result = json.loads((out / "result.json").read_text())
    assert sorted(result["seeds"]) == ["0", "1"]
    s0 = result["seeds"]["0"]
    assert s0["exact"]["sft"] == 25 and s0["exact"]["rl"] == 75 and s0["exact"]["diff"] == 50
    assert s0["exact"]["se"] == pytest.approx(100 * statistics.stdev([0, 1, 1, 0]) / 2)
    assert s0["reward"]["diff"] == pytest.approx(1.25)
    assert s0["type_accuracy"]["diff"] == pytest.approx(25.0)
    gains = result["rl_minus_sft"]
    assert gains["exact"] == {
        "mean": 25.0,
        "sd": pytest.approx(statistics.stdev([50, 0])),
        "min": 0.0,
        "max": 50.0,
    }
    assert gains["type_accuracy"]["mean"] == pytest.approx(0.0)
    assert gains["macro_f1"]["min"] == pytest.approx(-10.0)
    table = (out / "table.md").read_text()
    assert "| 0 | 10 min | 25.0 -> 75.0 (+50.0 ± 28.9 pts, 3.00x)" in table
    assert "| mean of 2 |  | RL - SFT +25.0 pts (sd 35.4, +0.0 to +50.0)" in table
    assert table.strip() in capsys.readouterr().out


def test_no_finished_seed_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="no finished seed"):
        seeds.main(["--out", str(tmp_path), "--report"])


@pytest.mark.parametrize("split", ["test", "validation", None])
def test_each_seed_says_what_rl_changed_per_action_and_where_the_shopper_leaves(
    tmp_path: Path, split: str | None
) -> None:
    """SFT answers every row of the split with its gold action; RL clicks wherever the gold
    action is ``terminate``: RL loses exactly those rows and clicks on all of them. The split
    is the one the evaluations name (``None``: metrics from before they named it, the test
    split)."""
    from env_server.data.dataset import load_or_build

    art = tmp_path / "art"
    data = art / paths.DATA_DIR.relative_to(paths.ARTIFACTS)
    rows = load_or_build(data, 12)[split or "test"].to_list()
    leaving = [r for r in rows if json.loads(r["action"])["type"] == "terminate"]
    assert leaving and len(leaving) < len(rows)
    click = {"type": "click", "name": "add_to_cart"}
    out = tmp_path / "seeds" / "seed0"
    for name, wrong in (("eval_sft", False), ("eval_rl", True)):
        (out / name).mkdir(parents=True)
        with open(out / name / "predictions.jsonl", "w") as f:
            for r in rows:
                gold = json.loads(r["action"])
                action = click if wrong and gold["type"] == "terminate" else gold
                text = json.dumps({"rationale": "I look.", "action": action})
                f.write(
                    json.dumps(
                        {"session_id": r["session_id"], "step": r["step"], "completion": text}
                    )
                    + "\n"
                )
        exact = [int(not (wrong and json.loads(r["action"])["type"] == "terminate")) for r in rows]
        m = {**_m(exact, [float(e) for e in exact], 1.0, 1.0), "n": len(rows)}
        if split:
            m["split"] = split
        (out / name / "metrics.json").write_text(json.dumps(m))
    assert (
        seeds.main(["--out", str(tmp_path / "seeds"), "--report", "--from-artifacts", str(art)])
        == 0
    )
    actions = json.loads((tmp_path / "seeds" / "result.json").read_text())["seeds"]["0"]["actions"]
    assert actions["net_exact_by_gold_type"]["terminate"] == -len(leaving)
    assert all(v == 0 for k, v in actions["net_exact_by_gold_type"].items() if k != "terminate")
    assert actions["where_the_shopper_leaves"]["RL"] == {"click": len(leaving)}
    assert actions["where_the_shopper_leaves"]["SFT"] == {"terminate": len(leaving)}
    table = (tmp_path / "seeds" / "table.md").read_text()
    assert f"it clicks on {len(leaving)} (SFT 0)" in table
    assert f"the first {len(rows)} steps of the {split or 'test'} split" in table
    assert "mean of" not in table  # one seed: no spread to show


def test_seeds_that_answered_different_splits_are_an_error(tmp_path: Path) -> None:
    out = tmp_path / "seeds"
    for seed, split in ((0, "test"), (1, "validation")):
        _finished(out, seed, _m([1, 0], [1, 0], 0.5, 0.5), _m([1, 1], [1, 1], 1.0, 1.0), 60)
        for name in ("eval_sft", "eval_rl"):
            path = out / f"seed{seed}" / name / "metrics.json"
            path.write_text(json.dumps({**json.loads(path.read_text()), "split": split}))
    with pytest.raises(SystemExit, match="seeds answered different splits"):
        seeds.main(["--out", str(out), "--report"])
    path = out / "seed1" / "eval_rl" / "metrics.json"  # one seed's two evaluations differ
    path.write_text(json.dumps({**json.loads(path.read_text()), "split": "test"}))
    with pytest.raises(SystemExit, match="SFT and the RL evaluation answered different splits"):
        seeds.main(["--out", str(out), "--report"])


def test_a_finished_run_keeps_what_it_shows_beside_its_console(tmp_path: Path) -> None:
    run = tmp_path / "run"
    for f in ("eval.md", "eval_rl/metrics.json", "config/env.yaml", "trainer/metrics.jsonl"):
        (run / f).parent.mkdir(parents=True, exist_ok=True)
        (run / f).write_text(f)
    (run / "trainer" / "checkpoints").mkdir()
    seeds.keep(tmp_path)
    assert (tmp_path / "eval_rl" / "metrics.json").read_text() == "eval_rl/metrics.json"
    assert (tmp_path / "config" / "env.yaml").exists() and (tmp_path / "eval.md").exists()
    assert (tmp_path / "trainer_metrics.jsonl").read_text() == "trainer/metrics.jsonl"
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "trainer").exists()


def test_a_stopped_bench_interrupts_the_whole_run(tmp_path: Path) -> None:
    """Stopping the bench (here: an exception raised in its wait, as SIGTERM does) sends
    SIGINT to the run's whole process group, so the launcher under ``make`` stops its run
    as on Ctrl-C. The grandchild stands in for the launcher: a Python process that sets its
    SIGINT handler itself, as launch.run_all does (a pytest-xdist worker starts its children
    with SIGINT ignored), then says it is ready; nothing waits on a timer."""
    import os
    import signal
    import sys
    import threading

    ready, got = tmp_path / "ready", tmp_path / "got"
    code = (
        "import pathlib, signal, sys\n"
        "def stop(*_):\n"
        f"    pathlib.Path({str(got)!r}).write_text('int\\n'); sys.exit(130)\n"
        "signal.signal(signal.SIGINT, stop)\n"
        f"pathlib.Path({str(ready)!r}).touch()\n"
        "while True: signal.pause()\n"
    )
    inner = shlex.join([sys.executable, "-c", code])
    argv = ["bash", "-c", f"bash -c {shlex.quote(inner)}; true"]  # a grandchild, as under make

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    def when_ready() -> None:
        while not ready.exists():
            threading.Event().wait(0.05)
        os.kill(os.getpid(), signal.SIGUSR1)

    old = signal.signal(signal.SIGUSR1, interrupt)
    try:
        threading.Thread(target=when_ready, daemon=True).start()
        with open(tmp_path / "console.log", "w") as console, pytest.raises(KeyboardInterrupt):
            seeds.run_in_group(argv, dict(os.environ), console)
    finally:
        signal.signal(signal.SIGUSR1, old)
    assert got.read_text() == "int\n"


def test_a_reused_sft_model_is_copied_in_timed_and_checked_against_the_run(
    tmp_path: Path,
) -> None:
    src, artifacts, run_dir = tmp_path / "val" / "sft1", tmp_path / "art", tmp_path / "run"
    (src / "checkpoints" / "step_000030").mkdir(parents=True)
    (src / "model.safetensors").write_text("weights")
    steps = [
        {"step": 1, "time": 1000.0, "step_s": 30.0},
        {"step": 2, "time": 1025.5, "step_s": 25.5},
    ]
    (src / "metrics.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    settings = {"seed": 1, "stratify": "action_type", "lr": 1e-4, "save_path": str(src)}
    (src / "trainer_config.json").write_text(json.dumps(settings))
    got = seeds.reuse_sft(src, artifacts)
    assert got == {"from": str(src), "train_s": 55.5, "steps": 2}
    sft = artifacts / paths.SMOL_SFT_MODEL_DIR.relative_to(paths.ARTIFACTS)
    assert (sft / "model.safetensors").read_text() == "weights"
    assert not (sft / "checkpoints").exists()
    (run_dir / "config").mkdir(parents=True)
    ran = dict(settings, save_path=str(sft))  # paths differ: that is fine
    (run_dir / "config" / "trainer_sft.yaml").write_text(json.dumps({"trainer": {"sft": ran}}))
    seeds.check_reused_sft(src, run_dir)
    ran["stratify"] = "none"
    (run_dir / "config" / "trainer_sft.yaml").write_text(json.dumps({"trainer": {"sft": ran}}))
    with pytest.raises(SystemExit, match="stratify 'action_type' \\(run: 'none'\\)"):
        seeds.check_reused_sft(src, run_dir)
    with pytest.raises(SystemExit, match="no SFT model at"):
        seeds.reuse_sft(tmp_path / "missing", artifacts)


def test_a_killed_bench_takes_its_run_with_it(tmp_path: Path) -> None:
    """SIGKILL of the bench (no handler runs) still stops the run: its lifeline reaper sends
    the run's process group SIGTERM. The grandchild stands in for the launcher under make; the
    test waits for conditions (files written), bounded only against a hang."""
    import contextlib
    import os
    import signal
    import subprocess
    import sys
    import time

    ready, got = tmp_path / "ready", tmp_path / "got"
    code = (
        "import os, pathlib, signal, sys\n"
        "def stop(*_):\n"
        f"    pathlib.Path({str(got)!r}).write_text('term\\n'); sys.exit(143)\n"
        "signal.signal(signal.SIGTERM, stop)\n"
        f"pathlib.Path({str(ready)!r}).write_text(str(os.getpgid(0)))\n"
        "while True: signal.pause()\n"
    )
    inner = shlex.join([sys.executable, "-c", code])
    argv = ["bash", "-c", f"bash -c {shlex.quote(inner)}; true"]
    bench = (
        "import os\n"
        "from bench.learning import seeds\n"
        f"with open({str(tmp_path / 'console.log')!r}, 'w') as console:\n"
        f"    seeds.run_in_group({argv!r}, dict(os.environ), console)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", bench], cwd=seeds.REPO)
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert proc.poll() is None, f"the bench exited {proc.returncode} before its run"
            assert time.monotonic() < deadline, "the run never started"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 120
        while not got.exists():
            assert time.monotonic() < deadline, "the run outlived its killed bench"
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if ready.exists() and not got.exists():  # failed: stop the run the bench left
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.killpg(int(ready.read_text()), signal.SIGKILL)
    assert got.read_text() == "term\n"
