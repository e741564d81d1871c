"""launch/run_all.sh end to end on the CPU preset with a tiny budget, in an isolated artifacts
folder (so it builds its own tiny model, dataset and a 3-step SFT): the four services start in
order and log, the trainer syncs its weights into vLLM, the evaluation table and the reward
curve are written, and every process it started is gone afterwards."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from launch.procs import REPO_ROOT

pytestmark = pytest.mark.integration
STEPS = 2


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_run_all_cpu_tiny_shared_vllm(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    env = dict(os.environ, SHOP_R1_ARTIFACTS=str(tmp_path / "artifacts"))
    argv = [str(REPO_ROOT / "launch" / "run_all.sh"), "--weight-bridge-mode", "shared_vllm",
            "--steps", str(STEPS), "--sft-steps", "3", "--num-sessions", "200", "--eval-samples", "4",
            "--keep-constant-groups", "--run-dir", str(run_dir)]  # fmt: skip
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert f"tail -f {run_dir}/api.log" in out

    for name in ("sft", "api", "vllm", "env", "trainer"):
        assert (run_dir / f"{name}.log").stat().st_size > 0, name
    assert (
        "Uvicorn running" in (run_dir / "api.log").read_text()
        or "startup" in (run_dir / "api.log").read_text().lower()
    )
    rows = [json.loads(x) for x in (run_dir / "trainer" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert rows[-1]["policy_version"] == STEPS  # the weight version advanced with every step

    pids = json.loads((run_dir / "pids.json").read_text())
    assert set(pids) == {"api", "vllm", "env", "trainer"}
    assert all(_gone(p["pid"]) for p in pids.values()), pids

    table = (run_dir / "eval.md").read_text()
    for label in ("exact match", "type accuracy", "macro-F1", "format rate", "mean reward"):
        assert f"| {label} |" in table
    assert f"weight version {STEPS}" in table  # RL = the trainer's final weights
    for split in ("sft", "rl"):
        assert json.loads((run_dir / f"eval_{split}" / "metrics.json").read_text())["n"] == 4
    assert (run_dir / "reward_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
