"""launch/forked.py: ``python -m`` forked from the template that imported vLLM once (what the
test session's vLLM servers use) behaves as the plain start does: argv, environment, working
directory, log, own session, exit code; stopped by its PID with its group; and it dies with
the process that started it when that one is SIGKILLed (the template too), registered with
the reaper or not."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from launch.lifeline import is_running, proc_info
from launch.procs import REPO_ROOT, ManagedProcess

pytestmark = pytest.mark.integration
PROBE = "tests.integration.forked_probe"
LIMIT_S = 120.0


def _seen(log: Path) -> dict:
    deadline = time.monotonic() + LIMIT_S
    while not log.exists() or not log.read_text().strip():
        assert time.monotonic() < deadline, f"the probe wrote nothing to {log}"
        time.sleep(0.05)
    return json.loads(log.read_text().splitlines()[0])


def test_a_forked_module_sees_what_python_m_would(tmp_path: Path) -> None:
    log = tmp_path / "probe.log"
    env = dict(os.environ, PROBE="yes", OMP_NUM_THREADS="1")  # the template has its own
    argv = [sys.executable, "-m", PROBE, "0", "3"]
    proc = ManagedProcess("probe", argv, log, env=env, cwd=tmp_path, forked=True).start()
    assert proc.wait_exit(stall=LIMIT_S) == 3
    seen = _seen(log)
    assert seen["argv"][1:] == ["0", "3"] and seen["argv"][0].endswith("forked_probe.py")
    assert seen["cwd"] == str(tmp_path) and seen["probe"] == "yes"
    assert seen["own_session"] and seen["vllm_imported"]  # forked after the imports
    assert seen["torch_threads"] == 1  # OpenMP read the template's environment, not this one
    # what it inherited is out of the collector's way (vLLM's full collections skip it)
    assert seen["frozen_objects"] > 100_000
    assert proc.stop() == 3


def test_a_forked_process_leads_its_group_when_started_and_a_stop_at_once_is_a_sigterm(
    tmp_path: Path,
) -> None:
    """As a ``Popen`` with a new session, the child leads its own process group as soon as
    ``start()`` returns, so a stop right away reaches it with SIGTERM (before, the group did
    not exist yet, the SIGTERM was lost, and the stop SIGKILLed it after its 20 s wait)."""
    for i in range(3):
        argv = [sys.executable, "-m", PROBE, "600", "0"]
        proc = ManagedProcess("sleeper", argv, tmp_path / f"s{i}.log", forked=True).start()
        assert os.getpgid(proc.pid) == proc.pid
        assert proc.stop(timeout=LIMIT_S) == -signal.SIGTERM


def test_a_forked_process_is_stopped_by_its_pid(tmp_path: Path) -> None:
    proc = ManagedProcess(
        "sleeper", [sys.executable, "-m", PROBE, "600", "0"], tmp_path / "s.log", forked=True
    ).start()
    _seen(tmp_path / "s.log")
    assert proc.alive() and proc_info(proc.pid).pgrp == proc.pid
    cmdline = Path(f"/proc/{proc.pid}/cmdline").read_text()  # ps shows what it runs
    assert cmdline.startswith(f"{sys.executable} -m {PROBE} 600 0"), cmdline
    assert proc.stop() == -signal.SIGTERM
    assert not proc.alive() and proc_info(proc.pid) is None


STARTS = {
    "registered": 'ManagedProcess("child", argv, sys.argv[1], forked=True).start()',
    # a starter killed between forking a child and registering it with the reaper (a launcher
    # stopped while forking its API): only the template's own exit can take the child
    "unregistered": 'fork_module(argv, {}, ".", sys.argv[1])',
}


@pytest.mark.parametrize("start", sorted(STARTS))
def test_a_forked_process_and_the_template_die_with_their_starter(
    start: str, tmp_path: Path
) -> None:
    """SIGKILL to the starter: the template exits when its starter's pipe closes (no child of
    the template holds a copy of it any more), and the child with it, whether or not the
    starter had registered the child with the lifeline's reaper."""
    log = tmp_path / "child.log"
    code = f"""
        import sys, time
        from launch.forked import fork_module
        from launch.procs import ManagedProcess
        argv = [sys.executable, "-m", {PROBE!r}, "600", "0"]
        print({STARTS[start]}.pid, flush=True)
        time.sleep(600)
    """
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    starter = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), str(log)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=REPO_ROOT,
        start_new_session=True,
    )
    try:
        child = int(starter.stdout.readline())
        _seen(log)
        info = proc_info(child)
        assert info is not None and info.ppid != starter.pid  # the template's child, not ours
        template = proc_info(info.ppid)
        assert template is not None and template.ppid == starter.pid
    finally:
        starter.kill()
        starter.wait(timeout=60)
    deadline, left = time.monotonic() + LIMIT_S, ((child, info), (info.ppid, template))
    try:
        for pid, started in left:
            while is_running(pid, started.starttime):
                assert time.monotonic() < deadline, f"{pid} outlived its starter"
                time.sleep(0.05)
    finally:  # a failure leaves nothing behind (the template's resource tracker then ends)
        for pid, started in left:
            if is_running(pid, started.starttime):
                os.kill(pid, signal.SIGKILL)
