"""The trainer's checkpoints under faults, end to end: ``python -m trainer grpo`` against a real
API and a real patched vLLM server (bridge mode ``none``), on fabricated groups that every run
trains in the same order (bench/faults/lineage.py), compared with an uninterrupted run.

- **A full checkpoint disk**: the checkpoints' filesystem (a small tmpfs; where mounting is
  not allowed, the trainer's ``RLIMIT_FSIZE``) fills up after step 2. The next checkpoint
  fails loudly (exit 74, one ``STOPPED:`` line naming the free space, the last checkpoint's
  size, the intact previous checkpoint and the unacked batch), leaves no partial files; the
  previous checkpoint is complete and holds the uninterrupted run's weights; the API acked
  nothing of the failed step (the batch is leased, then leased again). After the space
  returns, ``--resume`` continues from it and ends with the uninterrupted run's weights,
  every batch trained once.
- **A torn checkpoint**: SIGKILL at a random point inside a checkpoint write (CI: 2 trials in
  one process, 1 at 2 ranks with DCP, a random rank or the whole group killed; the full count,
  20 each, is ``python -m bench.faults.torn_checkpoint``, docs/FAULT_TOLERANCE.md). After every
  kill each published checkpoint is complete and the newest equals the uninterrupted run's
  at its step; the resumed run starts from it; at the end every acked batch was trained once
  and the weights equal the uninterrupted run's (bitwise in one process; within 1e-5 at 2
  ranks, whose sums run in another order than the one-process reference's).
- **torchrun killed**: torchrun starts each rank in a session of its own, so a SIGKILL to
  torchrun's process group reaches torchrun alone; the ranks must die with it
  (trainer/agent_death.py) instead of training on, orphaned, beside a resumed trainer.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from bench.faults.lineage import (
    Lineage,
    exactly_once,
    fabricate_groups,
    max_diff,
    reference,
    torn_run,
    wait_gone,
)
from bench.faults.small_disk import SmallDisk, limit_file_size
from launch.lifeline import descendants, signal_group
from launch.procs import ManagedProcess, tail
from launch.vllm_server import BridgeServer
from settings.ports import free_port
from tests.integration.grpo_harness import TOKEN as SERVER_TOKEN
from tests.integration.grpo_harness import reset_none_server

pytestmark = pytest.mark.integration
STEPS = 6
TRIALS = {1: 2, 2: 1}
"""Kills per CI run, by trainer processes (bench/faults/torn_checkpoint.py runs 20 each)."""


@dataclass
class Services:
    model: Path
    vllm_url: str
    groups: list[dict]
    ref: Lineage
    window_s: float
    root: Path


@pytest.fixture(scope="module")
def services(
    _none_server: BridgeServer, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Services]:
    """The session's vLLM server in mode ``none`` (tests/conftest.py; it only takes the runs'
    checkpoints as their sync target, so it need not be the module's own: that start was 46 s
    of the module), reset to the start weights at version 0, and the uninterrupted reference
    run."""
    root = tmp_path_factory.mktemp("ckpt_faults")
    server = reset_none_server(_none_server, tiny_model_dir)
    ref = None
    try:
        groups = fabricate_groups(tiny_model_dir, STEPS + 4)
        url = server.base_url  # every run syncs into it, with its token
        ref = Lineage(
            root,
            "reference",
            tiny_model_dir,
            url,
            groups,
            STEPS,
            keep=STEPS,
            bridge_token=SERVER_TOKEN,
            forked=True,
        )
        window = reference(ref)
        yield Services(tiny_model_dir, server.base_url, groups, ref, window, root)
    finally:
        if ref is not None:
            ref.stop()


def test_a_full_checkpoint_disk_stops_the_trainer_and_resume_continues_exactly(
    services: Services, tmp_path: Path
) -> None:
    s = services
    lin = Lineage(
        tmp_path,
        "disk",
        s.model,
        s.vllm_url,
        s.groups,
        STEPS,
        bridge_token=SERVER_TOKEN,
        forked=True,
    )
    disk = SmallDisk(lin.save / "checkpoints", 160 << 20) if SmallDisk.can_mount() else None
    try:
        with disk or contextlib.nullcontext():
            proc = lin.start_trainer(resume=False)
            deadline = time.monotonic() + 600
            while not any(r["step"] == 2 for r in lin.metrics()):  # step 2 done and synced
                assert proc.alive() and time.monotonic() < deadline, tail(proc.log_path, 40)
                time.sleep(0.02)
            os.kill(proc.pid, signal.SIGSTOP)  # fill the disk before step 3's checkpoint
            if disk:
                disk.fill(leave=8 << 20)  # a checkpoint of the tiny model takes ~45 MB
            else:
                limit_file_size(proc.pid, 4 << 20)  # below its 15 MB weights file
            os.kill(proc.pid, signal.SIGCONT)
            assert proc.wait_exit() == 74, tail(proc.log_path, 60)  # EX_IOERR, not a crash
            proc.stop()
            log = proc.log_path.read_text()
            stop = [line for line in log.splitlines() if "STOPPED: checkpoint" in line]
            assert len(stop) == 1 and "Traceback" not in log, log[-4000:]
            failed = int(re.search(r"checkpoint step_(\d+) could not be written", stop[0])[1])
            why = "No space left on device" if disk else "File too large"
            assert why in stop[0] and f"step_{failed - 1:06d}, is intact" in stop[0], stop[0]
            assert "None of the 1 batch(es) trained since the last checkpoint was acked" in stop[0]
            assert lin.complete_steps()[-1] == failed - 1  # nothing half-written is left
            leftovers = [p.name for p in (lin.save / "checkpoints").iterdir()]
            assert not [n for n in leftovers if n.startswith(".tmp")], leftovers
            assert max_diff(lin.checkpoint(failed - 1), s.ref.checkpoint(failed - 1)) == 0.0
            states = dict(lin.query("SELECT state, COUNT(*) FROM batches GROUP BY state"))
            assert states == {"acked": failed - 1, "leased": 1}, states  # nothing acked for it
            if disk:
                disk.release()  # the space is back (the trainer's new process: no limit)
            proc = lin.start_trainer(resume=True)
            assert lin.resumed_step(proc) == failed - 1
            assert proc.wait_exit() == 0, tail(proc.log_path, 60)
            proc.stop()
            counts = exactly_once(lin, s.ref, tol=0.0)
        assert counts["batches_expired"] == 1  # the failed step's lease, leased again
        print(f"CKPT_DISK_FULL failed at step {failed}: {stop[0][:400]} | {counts}")
    finally:
        lin.stop()


@pytest.mark.parametrize("procs", [1, 2], ids=["one_process", "two_ranks_dcp"])
def test_sigkill_inside_checkpoint_writes_resumes_exactly(
    services: Services, tmp_path: Path, procs: int
) -> None:
    s = services
    lin = Lineage(
        tmp_path,
        f"torn{procs}",
        s.model,
        s.vllm_url,
        s.groups,
        STEPS,
        procs,
        bridge_token=SERVER_TOKEN,
        forked=True,  # a one-process trainer; torchrun's ranks start plain
    )
    try:
        window = max(0.2, procs * s.window_s)  # a sharded write takes longer
        out = torn_run(lin, s.ref, random.Random(29 + procs), TRIALS[procs], window, 1e-5)
        if procs == 1:
            assert out["final_max_weight_diff"] == 0.0  # bitwise the uninterrupted run
        assert all(t["resumed_at"] == t["last_complete"] for t in out["trials"])
        print(f"TORN_CHECKPOINT procs={procs} {out}")
    finally:
        lin.stop()


def test_a_sigkill_to_torchrun_takes_its_ranks(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The 2-rank trainer waiting for its API (nothing listens); SIGKILL to torchrun's process
    group: both ranks are gone within ``ORPHAN_S`` (before trainer/agent_death.py they ran on
    for good, and the torn-checkpoint trials saw two trainers in one lineage)."""
    nobody = f"http://127.0.0.1:{free_port()}"
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    argv += ["-m", "trainer", "grpo", "--model-name", str(tiny_model_dir), "--device", "cpu"]
    argv += ["--save-path", str(tmp_path / "trainer"), "--api-url", nobody, "--overwrite"]
    argv += ["--inference-url", nobody, "--weight-bridge-mode", "none", "--no-tensorboard"]
    argv += ["--reconnect-timeout", "900", "--wait-timeout", "900"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    proc = ManagedProcess("torchrun", argv, tmp_path / "trainer.log", env=env).start()
    try:
        deadline = time.monotonic() + 600  # two ranks importing torch on a loaded 2-core box
        while not all(f"rank {r} of 2" in proc.log_path.read_text() for r in (0, 1)):
            assert proc.alive() and time.monotonic() < deadline, tail(proc.log_path, 40)
            time.sleep(0.2)
        ranks = [p for p in descendants(proc.pid) if "trainer" in _cmdline(p.pid)]
        assert len(ranks) == 2, ranks
        assert all(p.pgrp != proc.pid for p in ranks)  # out of reach of a signal to the group
        signal_group(proc.pid, signal.SIGKILL)
        proc.popen.wait(timeout=60)
        t0 = time.monotonic()
        wait_gone(ranks, "torchrun")  # raises if a rank is still running after ORPHAN_S
        print(f"TORCHRUN_KILLED ranks {[p.pid for p in ranks]} gone {time.monotonic() - t0:.2f} s")
    finally:
        proc.stop()


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""
