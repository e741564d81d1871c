"""A SIGTERM while the server starts ends it (vllm_patching/startup_signals.py).

vLLM 0.32's own handler for that window raises ``KeyboardInterrupt``, which under uvloop
left the API server waiting for its engine core for good once the engine core was starting
(no exit 25 s after the signal; a launcher's stop waited its 20 s and SIGKILLed it). The
window is made certain, not timed: the engine core stops itself (SIGSTOP) right after its
server forks it (the test-only fault point ``engine_core_forked``, procutil/faults.py), so the
server cannot finish starting; then the server is stopped as the launcher stops it (SIGTERM to
its group, then SIGCONT, SIGKILL only after the wait). It must exit by the SIGTERM (-15), and
its engine core go too (waited for: a SIGKILLed process takes a moment to end); a SIGKILL (-9)
would mean the SIGTERM was not enough. Plain and forked starts of the server.
"""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import psutil
import pytest

from launch.lifeline import is_stopped
from launch.vllm_server import cpu_env, spawn_bridge_server
from procutil.faults import FAULT_ENV

pytestmark = pytest.mark.integration
LIMIT_S = 300.0
"""How long the engine core may take to be forked (a start on a busy box)."""
STOP_WAIT_S = 60.0
"""The stop's wait between SIGTERM and SIGKILL: the handler needs at most its children's
grace (5 s) and an exit; without it the server never exits on the SIGTERM."""
STOPPED = re.compile(r"SIGSTOP pid (\d+) at 'engine_core_forked'")
"""The fault point's line in the server's log, naming the engine core's PID."""


def _stopped_core(server_pid: int, log: Path) -> psutil.Process | None:
    """The server's engine core once it has stopped itself at the fault point, else None."""
    found = STOPPED.search(log.read_text(errors="replace"))
    if found is None or not is_stopped(int(found[1])):
        return None
    core = psutil.Process(int(found[1]))
    assert core.ppid() == server_pid, (core, server_pid)  # the server's own child
    return core


def _ended(proc: psutil.Process) -> bool:
    """Gone, or a zombie (ended; its reaping is its new parent's business)."""
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.parametrize("forked", [False, True], ids=["plain", "forked"])
def test_a_sigterm_while_the_engine_core_starts_ends_the_server(
    tiny_model_dir: Path, tmp_path: Path, forked: bool
) -> None:
    log_path = tmp_path / "vllm.log"
    env = {**cpu_env(None), FAULT_ENV: "engine_core_forked:self"}
    server = spawn_bridge_server(tiny_model_dir, "none", log_path, env=env, forked=forked)
    try:
        deadline = time.monotonic() + LIMIT_S
        core = None
        while core is None:
            assert server.proc.alive(), log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "the engine core did not stop at its fork"
            core = _stopped_core(server.proc.pid, log_path)
            time.sleep(0.1)
        rc = server.proc.stop(timeout=STOP_WAIT_S)
        log = log_path.read_text()
        assert rc == -signal.SIGTERM, log[-3000:]
        # the server's stop SIGKILLs its group after the leader exits; a killed process
        # takes a moment to go (a clean clone's run checked at once and saw it running)
        end = time.monotonic() + STOP_WAIT_S
        while not _ended(core):
            assert time.monotonic() < end, f"the engine core outlived the server: {core}"
            time.sleep(0.05)
        assert "Application startup complete" not in log  # it was stopped while starting
    finally:
        server.stop()
