"""launch/lifeline.py with real processes: a child started by a process that is then
SIGKILLed dies with it (parent-death signal), and so does the rest of the child's process
group (the reaper); what was stopped on purpose is forgotten; a killed reaper is replaced."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from launch.lifeline import (
    Lifeline,
    ProcInfo,
    descendants,
    die_with_parent,
    group_members,
    is_running,
    proc_info,
)
from launch.procs import REPO_ROOT, ManagedProcess

pytestmark = pytest.mark.unit
LIMIT_S = 120.0
"""How long a process may take to go (generous: the box may be busy)."""


def _wait_for(cond: Callable[[], bool], what: str, limit: float = LIMIT_S) -> None:
    deadline = time.monotonic() + limit
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} within {limit:.0f} s")
        time.sleep(0.05)


def _left(procs: list[ProcInfo]) -> list[int]:
    return [p.pid for p in procs if is_running(p.pid, p.starttime)]


def _start_parent(code: str, *args: str) -> tuple[subprocess.Popen[str], list[int]]:
    """A Python parent running ``code``; it prints the PIDs it started, one line."""
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    parent = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    line = parent.stdout.readline() if parent.stdout else ""
    assert line.strip(), f"the parent printed nothing (exit {parent.poll()})"
    return parent, [int(x) for x in line.split()]


def _kill(parent: subprocess.Popen[str]) -> None:
    parent.kill()
    parent.wait(timeout=60)


def test_prctl_child_dies_with_its_parent() -> None:
    """A plain Popen with ``die_with_parent()``: SIGKILL the parent, the child goes."""
    parent, (child,) = _start_parent("""
        import subprocess, time
        from launch.lifeline import die_with_parent
        p = subprocess.Popen(["sleep", "600"], preexec_fn=die_with_parent())
        print(p.pid, flush=True)
        time.sleep(600)
    """)
    info = proc_info(child)
    assert info is not None and info.ppid == parent.pid
    _kill(parent)
    _wait_for(lambda: not is_running(child, info.starttime), "the child did not die")


def test_managed_process_tree_dies_with_its_starter(tmp_path: Path) -> None:
    """A ManagedProcess whose own child (same process group, no parent-death signal: like
    vLLM's engine core) outlives the service: the reaper stops the whole group when the
    starter is SIGKILLed, notes it in the service's log, and exits."""
    log = tmp_path / "svc.log"
    parent, (service, grandchild) = _start_parent(
        """
        import sys, time
        from launch.procs import ManagedProcess
        code = ("import subprocess, sys, time; g = subprocess.Popen(['sleep', '600']); "
                "print(g.pid, flush=True); time.sleep(600)")
        p = ManagedProcess("svc", [sys.executable, "-u", "-c", code], sys.argv[1]).start()
        while "\\n" not in open(sys.argv[1]).read():
            time.sleep(0.05)
        print(p.pid, open(sys.argv[1]).read().split()[0], flush=True)
        time.sleep(600)
        """,
        str(log),
    )
    tree = descendants(parent.pid)
    pids = {p.pid for p in tree}
    assert {service, grandchild} <= pids
    assert proc_info(grandchild).pgrp == service  # the service's group: the reaper's target
    reaper = [p for p in tree if p.ppid == parent.pid and p.pid != service]
    assert len(reaper) == 1, tree  # one reaper per starter, in a session of its own
    _kill(parent)
    _wait_for(lambda: not _left(tree), f"{_left(tree)} outlived their starter")
    assert group_members(service) == []
    text = log.read_text()
    assert f"[lifeline] pid {parent.pid}, which started svc, is gone" in text


def test_reaper_sigkills_a_group_that_ignores_sigterm(tmp_path: Path) -> None:
    log = tmp_path / "stubborn.log"
    code = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "print('ready', flush=True); time.sleep(600)"
    )
    line = Lifeline(grace=0.5)
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        line.register(proc.pid, "stubborn", log)
        line.close()
        assert proc.wait(timeout=LIMIT_S) == -signal.SIGKILL
        assert line.reaper is not None and line.reaper.wait(timeout=LIMIT_S) == 0
        assert "outlived SIGTERM by 0.5 s: SIGKILLed" in log.read_text()
    finally:
        proc.kill()
        proc.wait()


def test_unregistered_group_survives_and_killed_reaper_is_replaced(tmp_path: Path) -> None:
    """What we stopped ourselves is forgotten (a reused PID is never hit); a reaper that
    someone killed is replaced and told about every group still registered."""
    line = Lifeline(grace=5.0)
    procs = [subprocess.Popen(["sleep", "600"], start_new_session=True) for _ in range(3)]
    try:
        line.register(procs[0].pid, "a")
        first = line.reaper
        assert first is not None
        first.kill()
        first.wait(timeout=LIMIT_S)
        line.register(procs[1].pid, "b")  # a new reaper, told about "a" and "b"
        line.register(procs[2].pid, "c")
        line.unregister(procs[2].pid)
        assert line.reaper is not first
        line.close()
        for p in procs[:2]:
            assert p.wait(timeout=LIMIT_S) == -signal.SIGTERM
        assert line.reaper.wait(timeout=LIMIT_S) == 0
        assert procs[2].poll() is None  # unregistered: left alone
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_stop_unregisters_and_no_pdeathsig_off_the_main_thread(tmp_path: Path) -> None:
    proc = ManagedProcess("sleeper", ["sleep", "600"], tmp_path / "s.log").start()
    from launch.lifeline import lifeline

    assert proc.pid in lifeline()._groups
    assert proc.stop() == -signal.SIGTERM
    assert proc.pid not in lifeline()._groups

    got: list[object] = []
    t = threading.Thread(target=lambda: got.append(die_with_parent()))
    t.start()
    t.join()
    assert got == [None]  # a thread that ends would take the child with it
    if sys.platform.startswith("linux"):
        assert callable(die_with_parent())


def test_a_forked_child_does_not_hold_the_lifeline_open() -> None:
    """A child forked without exec (multiprocessing's fork) closes its copy of our end:
    otherwise the reaper would wait for that child too."""
    from launch.lifeline import lifeline

    group = subprocess.Popen(["sleep", "600"], start_new_session=True)
    line = lifeline()
    line.register(group.pid, "sleeper")
    reaper = line.reaper
    holder = os.fork()
    if holder == 0:  # pragma: no cover - the forked child lives on with what it inherited
        time.sleep(600)
        os._exit(0)
    try:
        line.close()
        assert reaper is not None and reaper.wait(timeout=LIMIT_S) == 0
        assert group.wait(timeout=LIMIT_S) == -signal.SIGTERM
    finally:
        os.kill(holder, signal.SIGKILL)
        os.waitpid(holder, 0)
        group.kill()
        group.wait()
