"""ManagedProcess.wait_exit (and run_to_exit, which also stops it): waits while the process makes progress (its log grows), gives
up with the log's tail when it does not, and returns the exit code otherwise."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from launch.procs import ManagedProcess

pytestmark = pytest.mark.unit


def _proc(tmp_path: Path, code: str) -> ManagedProcess:
    return ManagedProcess("p", [sys.executable, "-u", "-c", code], tmp_path / "p.log").start()


def test_exit_code_of_a_process_that_ends(tmp_path: Path) -> None:
    proc = _proc(tmp_path, "import sys; print('bye'); sys.exit(3)")
    try:
        assert proc.wait_exit(stall=120) == 3
    finally:
        proc.stop()


def test_a_silent_process_is_stuck_and_the_error_shows_its_log(tmp_path: Path) -> None:
    proc = _proc(tmp_path, "import time; print('started, now silent'); time.sleep(600)")
    try:
        # its line is in the log before the stall clock starts (a loaded box may take seconds
        # to start Python: the error would then show an empty log, by chance)
        deadline = time.monotonic() + 120
        while "started, now silent" not in proc.log_path.read_text():
            assert time.monotonic() < deadline, "the child never printed its line"
            time.sleep(0.05)
        with pytest.raises(TimeoutError, match="log did not grow for 1 s") as err:
            proc.wait_exit(stall=1.0)
        assert "started, now silent" in str(err.value) and str(proc.log_path) in str(err.value)
    finally:
        proc.stop()


def test_a_process_that_keeps_logging_hits_the_backstop(tmp_path: Path) -> None:
    code = "import time\nwhile True:\n    print('still here', flush=True)\n    time.sleep(0.1)"
    proc = _proc(tmp_path, code)
    try:
        with pytest.raises(TimeoutError, match="ran past 2 s"):
            proc.wait_exit(stall=60.0, limit=2.0)
    finally:
        proc.stop()


def test_run_to_exit_returns_the_code_and_stops_a_stuck_process(tmp_path: Path) -> None:
    done = ManagedProcess("ok", [sys.executable, "-c", "raise SystemExit(5)"], tmp_path / "a.log")
    assert done.run_to_exit(stall=120) == 5
    code = "import time; print('started', flush=True); time.sleep(600)"
    stuck = ManagedProcess("stuck", [sys.executable, "-u", "-c", code], tmp_path / "b.log")
    with pytest.raises(TimeoutError, match="log did not grow"):
        stuck.run_to_exit(stall=1.0)
    assert not stuck.alive()  # stopped by its PID on the way out, nothing left behind
