"""A SIGTERM while the server starts ends it (vllm_patching/startup_signals.py).

vLLM 0.32's own handler for that window raises ``KeyboardInterrupt``, which under uvloop
left the API server waiting for its engine core for good once the engine core was starting
(no exit 25 s after the signal; a launcher's stop waited its 20 s and SIGKILLed it). The
window is made certain, not timed: as soon as the engine core exists (by its process title;
other children, such as multiprocessing's resource tracker, can come first and do not hold
the start) it is frozen (SIGSTOP), so the server cannot finish starting; then the server is
stopped as the launcher stops it (SIGTERM to its group, then SIGCONT, SIGKILL only after the
wait). It must exit by the SIGTERM (-15), and its engine core go too (waited for: a
SIGKILLed process takes a moment to end); a SIGKILL (-9) would mean the SIGTERM was not
enough. Plain and forked starts.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import psutil
import pytest

from launch.vllm_server import spawn_bridge_server

pytestmark = pytest.mark.integration
LIMIT_S = 300.0
"""How long the engine core may take to appear (a start on a busy box)."""
STOP_WAIT_S = 60.0
"""The stop's wait between SIGTERM and SIGKILL: the handler needs at most its children's
grace (5 s) and an exit; without it the server never exits on the SIGTERM."""


def _is_core(proc: psutil.Process) -> bool:
    """vLLM's engine core: it names itself (``VLLM::EngineCore``) as it starts, before its
    handshake with the API server; other children (e.g. multiprocessing's resource tracker)
    do not hold the server's start."""
    try:
        return "EngineCore" in " ".join(proc.cmdline()) or "EngineCore" in proc.name()
    except psutil.Error:
        return False


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
    server = spawn_bridge_server(tiny_model_dir, "none", tmp_path / "vllm.log", forked=forked)
    try:
        deadline = time.monotonic() + LIMIT_S
        cores: list[psutil.Process] = []
        while not cores:
            assert server.proc.alive(), (tmp_path / "vllm.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no engine core appeared"
            cores = [p for p in psutil.Process(server.proc.pid).children() if _is_core(p)]
            time.sleep(0.02)
        core = cores[0]
        os.kill(core.pid, signal.SIGSTOP)  # the server cannot finish starting now
        rc = server.proc.stop(timeout=STOP_WAIT_S)
        log = (tmp_path / "vllm.log").read_text()
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
