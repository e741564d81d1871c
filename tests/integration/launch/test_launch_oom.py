"""An OOM-killed trainer under ``launch/run_all.sh``, for real, and the relaunch that resumes.

The launcher runs the CPU preset (3 GRPO steps, the shared fixture's 3-step SFT model). Once
the trainer has checkpointed step 1 it stops itself (SIGSTOP, the test-only fault point
``checkpointed`` of procutil/faults.py), so its next step cannot begin however fast the box;
the test moves the stopped process into a memory cgroup with a 48 MiB limit
(bench/faults/memcg.py) and continues it: its next training step allocates far more, and the
kernel's OOM killer kills it. The launcher must say so: the trainer exited with -9, it was
the OOM killer (the kernel's own line for that PID), the memory figures, and the command that
continues the run. Where this process may not create a memory cgroup or read the kernel's
log, the test SIGKILLs the stopped trainer itself and checks that the launcher does *not* call
that an OOM kill (and still says how to continue).

Then ``run_all.sh --resume --run-dir <the same run>``: SFT is not run again (no ``sft`` step,
the SFT model's files untouched), the SFT evaluation is not redone, the trainer resumes from
its checkpoint (``resumed from .../step_00000N``) and the run ends with all 3 steps.

The first launch starts its services as forks of one template (the CPU default,
launch/forked.py), the relaunch plainly (``--no-fork-services``, as GPU runs always do).
Both launches run in bridge mode ``none`` (vLLM keeps its weights; the trainer only advances
the served weight version), and the relaunch ends with test_launch_run_all's ``check_run``:
these are the suite's launcher runs of that mode.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from bench.faults.memcg import MemoryCgroup
from launch.exits import kernel_log
from launch.lifeline import is_stopped, proc_info
from procutil.faults import FAULT_ENV
from tests.integration.launch.test_launch_run_all import artifacts_env, check_run, launcher
from tests.integration.launcher_harness import LauncherRun

pytestmark = pytest.mark.integration
STEPS = 3
__all__ = ["artifacts_env", "launcher"]  # fixtures shared with test_launch_run_all


def test_an_oom_killed_trainer_is_named_and_a_relaunch_resumes_without_sft(
    artifacts_env: dict[str, str], launcher: Callable[..., LauncherRun], tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    flags = ["--training-steps", str(STEPS), "--keep-constant-groups", "--eval-samples", "2"]
    # fp32 named: the servers' dtype is the same on every CPU (auto: bf16 where it is native)
    flags += ["--weight-bridge-mode", "none", "--eval-server", "own", "--eval-dtype", "float32"]
    sft = Path(artifacts_env["SHOP_R1_ARTIFACTS"]) / "models" / "tiny-qwen2-sft"
    sft_mtime = (sft / "model.safetensors").stat().st_mtime_ns
    ckpt = run_dir / "trainer" / "checkpoints" / "step_000001"
    # The kernel's line names the PID and the cgroup whatever the launcher sampled; without
    # it, naming the cgroup would need a launcher sample between the move and the kill.
    real = MemoryCgroup.available() and bool(kernel_log()[0])
    env = {**artifacts_env, FAULT_ENV: "checkpointed:self"}  # it stops after checkpoint 1
    run = launcher(run_dir, env, *flags)

    def trainer_stopped() -> bool:  # pids.json has no trainer row until it started
        row = run.pids().get("trainer")
        return row is not None and is_stopped(int(row["pid"]))

    run.wait_until(trainer_stopped, "the trainer to stop itself")
    assert ckpt.is_dir() and not (ckpt.parent / "step_000002").exists()
    pid = int(run.pids()["trainer"]["pid"])
    assert proc_info(pid).ppid != run.pid  # a fork of the launcher's template (CPU default)
    if real:
        with MemoryCgroup(f"t29-trainer-{pid}", 48 << 20) as cg:
            cg.add(pid)  # its next step's activations do not fit: the kernel kills it
            os.kill(pid, signal.SIGCONT)
            assert run.wait() == 1, run.tails()
    else:
        time.sleep(1.0)  # let the launcher sample it once more
        os.kill(pid, signal.SIGKILL)
        assert run.wait() == 1, run.tails()
    out = run.output()
    assert "[run_all] FAILED: trainer exited with -9" in out, out[-3000:]
    if real:
        assert "trainer was killed by the kernel's OOM killer (out of memory)." in out, out[-3000:]
        assert "memory: its resident memory peaked at" in out and "allows 48 MiB" in out
        assert f"Killed process {pid} " in out, out[-3000:]  # the kernel's own line
    else:
        assert "trainer was killed by SIGKILL" in out and "OOM killer (out" not in out
    step = max(int(p.name[5:]) for p in ckpt.parent.glob("step_*"))
    hint = f"to continue this run: launch/run_all.sh --resume --run-dir {run_dir}"
    left = STEPS - step  # what the hint says --resume will do (launch.prepare.resume_plan)
    plan = f"GRPO resumes from its step-{step} checkpoint ({left} step{'s' * (left != 1)} left)"
    assert hint in out and "SFT is done (its model is reused)" in out and plan in out, out[-3000:]

    # the relaunch starts its services plainly (python -m): the start GPU runs always use
    again = launcher(run_dir, artifacts_env, "--resume", "--no-fork-services", *flags)
    assert again.wait() == 0, again.tails()
    out2 = again.output()
    assert "services start plainly" in out2 and "as forks" in out, out2[-3000:]
    check_run(run_dir, out2, ["vllm"], steps=STEPS, resumed=True, eval_servers=("vllm_eval_rl",))
    assert "[bridge] mode=none" in (run_dir / "vllm.log").read_text()
    assert "[run_all] sft:" not in out2 and "SFT evaluation: reusing" in out2, out2[-3000:]
    # each evaluation asked a server of its own (--eval-server own): the SFT's in the first
    # launch, the RL one (the trainer's last checkpoint) in the relaunch
    for label in ("sft", "rl"):  # each server's own log, in bridge mode none
        assert "[bridge] mode=none" in (run_dir / f"vllm_eval_{label}.log").read_text()
    line = "[run_all] RL evaluation on a vLLM server of its own (vllm_eval_rl"
    assert line in out2 and ", float32 (launch.eval_server, launch.eval_dtype)" in out2, out2[
        -3000:
    ]
    for label in ("sft", "rl"):  # both served alike: the SFT one was read back for that
        metrics = json.loads((run_dir / f"eval_{label}" / "metrics.json").read_text())
        assert metrics["server_dtype"] == "float32", label
    table = (run_dir / "eval.md").read_text()
    final = ckpt.parent / f"step_{STEPS:06d}" / "model"
    rl = f"RL = the trainer's final weights ({run_dir / 'trainer'}) loaded from {final} by an "
    assert rl + "evaluation server in float32" in table
    assert (sft / "model.safetensors").stat().st_mtime_ns == sft_mtime  # SFT not redone
    trainer_log = (run_dir / "trainer.log").read_text()
    assert f"resumed from {ckpt.parent / f'step_{step:06d}'} at step {step}" in trainer_log
    rows = [json.loads(x) for x in (run_dir / "trainer" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == STEPS and rows[-1]["policy_version"] == STEPS
    assert (ckpt.parent / f"step_{STEPS:06d}").is_dir()
    print(f"OOM_LAUNCH real={real} killed at step {step}:\n" + out[out.find("FAILED") :][:3000])
