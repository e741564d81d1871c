"""The test-only fault points (procutil/faults.py): unset they do nothing; set, they
SIGSTOP the named processes (``self``: the process that reaches the point) once, at the named
point only."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from launch.lifeline import is_stopped, proc_info
from procutil.faults import FAULT_ENV, fault_point, reset_faults

pytestmark = pytest.mark.unit


def _state(pid: int) -> str:
    info = proc_info(pid)
    return "gone" if info is None else info.state


def _until_stopped(pid: int) -> None:
    """Until ``pid`` is stopped; bounded, for a broken fault point to fail rather than hang."""
    deadline = time.monotonic() + 120
    while not is_stopped(pid):
        assert time.monotonic() < deadline, f"pid {pid} not stopped: state {_state(pid)}"
        time.sleep(0.05)


@pytest.fixture()
def sleeper():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    yield proc
    proc.kill()
    proc.wait()


def _kills(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """The signals the fault points send from now on, recorded instead of sent."""
    sent: list[tuple[int, int]] = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: sent.append((pid, sig)))
    return sent


def test_unset_or_another_point_sends_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    sent = _kills(monkeypatch)
    monkeypatch.delenv(FAULT_ENV, raising=False)
    reset_faults()
    fault_point("checkpointed")
    monkeypatch.setenv(FAULT_ENV, "apply:101,102")
    fault_point("checkpointed")
    fault_point("connect")
    assert sent == []


def test_a_setting_fires_once_until_reset(monkeypatch: pytest.MonkeyPatch) -> None:
    sent = _kills(monkeypatch)
    monkeypatch.setenv(FAULT_ENV, "apply:101, 102")
    reset_faults()
    fault_point("apply")
    fault_point("apply")  # fired already: passed without a stop
    assert sent == [(101, signal.SIGSTOP), (102, signal.SIGSTOP)]
    monkeypatch.setenv(FAULT_ENV, "checkpointed:self")  # another setting fires on its own
    fault_point("checkpointed")
    assert sent[2:] == [(os.getpid(), signal.SIGSTOP)]
    reset_faults()  # a test that sets it again
    fault_point("checkpointed")
    assert len(sent) == 4


def test_the_named_process_is_stopped(sleeper, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAULT_ENV, f"apply:{sleeper.pid}")
    reset_faults()
    fault_point("apply")
    _until_stopped(sleeper.pid)
    os.kill(sleeper.pid, signal.SIGCONT)


def test_self_stops_the_process_that_reaches_the_point() -> None:
    code = "from procutil.faults import fault_point; fault_point('checkpointed'); print('went on')"
    env = {**os.environ, FAULT_ENV: "checkpointed:self"}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE)
    try:
        _until_stopped(proc.pid)
        os.kill(proc.pid, signal.SIGCONT)
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 0 and out.decode().strip() == "went on"
