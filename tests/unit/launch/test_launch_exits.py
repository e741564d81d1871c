"""The launcher's account of a process that died (launch/exits.py), on real processes:

- an OOM kill for real: a child allocating memory in a memory cgroup with a 64 MiB limit
  (bench/faults/memcg.py) is killed by the kernel, and ``explain`` names the OOM killer, quotes the
  kernel's line for that PID, and gives the figures (its peak, the cgroup's limit, the
  machine's memory). Where this process may not create a cgroup, it is skipped with the reason
  and only the cases below run;
- a SIGKILL that was not the OOM killer's is not called one;
- a trainer that stopped on a failed checkpoint write (exit 74) is named by its own line;
- so is one that stopped on a weight sync's missed deadline (exit 75), and the launcher's
  stop of a frozen (SIGSTOPped) process ends it by its SIGTERM, not the SIGKILL.
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import pytest

from bench.faults.memcg import MemoryCgroup
from launch.exits import MemoryWatch, explain, kernel_log
from launch.procs import ManagedProcess

pytestmark = pytest.mark.unit
HOG = (
    "import time\n"
    "time.sleep(float(__import__('sys').argv[1]))\n"
    "chunks = []\n"
    "while True:\n"
    "    chunks.append(bytearray(8 << 20))\n"
    "    time.sleep(0.02)\n"
)


def hog(tmp_path: Path, delay: float) -> ManagedProcess:
    """A process that waits ``delay`` seconds, then allocates 8 MiB every 20 ms forever."""
    argv = [sys.executable, "-c", HOG, str(delay)]
    return ManagedProcess("trainer", argv, tmp_path / "trainer.log").start()


def watch_until_dead(proc: ManagedProcess, watch: MemoryWatch, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while proc.alive():
        watch.sample()
        assert time.monotonic() < deadline, "the process was not killed"
        time.sleep(0.05)


def test_a_real_oom_kill_is_named_with_the_kernels_line_and_the_figures(tmp_path: Path) -> None:
    if not MemoryCgroup.available():
        pytest.skip("no writable memory cgroup here (needs root and a cgroup filesystem)")
    with MemoryCgroup(f"t29-oom-{time.monotonic_ns()}", 64 << 20) as cg:
        proc = hog(tmp_path, 1.0)
        try:
            watch = MemoryWatch(proc.pid)
            watch.sample()  # seen in its own cgroup first, as the launcher sees a service
            cg.add(proc.pid)
            watch_until_dead(proc, watch)
        finally:
            proc.stop()
        assert proc.popen.returncode == -9
        text = explain("trainer", proc.popen.returncode, proc.log_path, watch)
    assert text.startswith("trainer was killed by the kernel's OOM killer"), text
    assert "its memory cgroup" in text and "allows 64 MiB" in text, text
    assert "its resident memory peaked at" in text and "this machine has" in text, text
    records, source = kernel_log()
    if records:  # the kernel log is readable here: its line for this PID is quoted
        assert f"Killed process {proc.pid} " in text and "anon-rss" in text, text
    else:
        assert "cgroup: OOM kills counted in" in text, (source, text)
    print(text)


def test_a_sigkill_by_someone_else_is_not_called_an_oom_kill(tmp_path: Path) -> None:
    proc = hog(tmp_path, 60.0)
    try:
        watch = MemoryWatch(proc.pid)
        watch.sample()
        proc.popen.send_signal(signal.SIGKILL)
        proc.popen.wait(timeout=30)
    finally:
        proc.stop()
    text = explain("env", proc.popen.returncode, proc.log_path, watch)
    assert text.startswith("env was killed by SIGKILL"), text
    assert "OOM killer (out of memory)" not in text
    records, _ = kernel_log()
    if records:
        assert "shows no OOM kill of its processes: something else killed it" in text, text
    else:
        assert "not readable here" in text and "sudo dmesg" in text, text


def test_a_failed_checkpoint_write_is_named(tmp_path: Path) -> None:
    log = tmp_path / "trainer.log"
    line = "2026-11-26 ERROR trainer: STOPPED: checkpoint step_000007 could not be written to X"
    log.write_text(f"step 6 loss 0.1\n{line}\n")
    text = explain("trainer", 74, log, MemoryWatch(1))
    assert text.startswith("trainer stopped because a checkpoint could not be written")
    assert "step_000007" in text
    assert explain("trainer", 0, tmp_path / "missing.log", None) == ""


def test_a_weight_sync_timeout_is_named(tmp_path: Path) -> None:
    log = tmp_path / "trainer.log"
    line = (
        "2026-11-28 ERROR trainer: STOPPED: weight sync to http://127.0.0.1:9001 timed out in "
        "phase 'apply' after 30 s (--sync-deadline.apply; is the server stopped or overloaded?)"
    )
    log.write_text(f"step 6 loss 0.1\n{line}\n")
    text = explain("trainer", 75, log, MemoryWatch(1))
    assert text.startswith("trainer stopped because an inference server did not answer")
    assert "timed out in phase 'apply' after 30 s" in text and "--resume" in text


def test_stop_wakes_a_frozen_process_so_its_sigterm_ends_it(tmp_path: Path) -> None:
    """A SIGSTOPped process keeps a SIGTERM pending until it is continued: ``stop`` sends
    SIGCONT with it, so the process exits on the SIGTERM at once (-15), not on the SIGKILL
    after the grace period."""
    argv = [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(600)"]
    proc = ManagedProcess("frozen", argv, tmp_path / "frozen.log").start()
    deadline = time.monotonic() + 60
    while "up" not in proc.log_path.read_text():
        assert time.monotonic() < deadline and proc.alive()
        time.sleep(0.05)
    import os

    os.kill(proc.pid, signal.SIGSTOP)
    assert proc.stop(timeout=120) == -signal.SIGTERM
