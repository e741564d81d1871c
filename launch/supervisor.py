"""The processes ``launch/run_all.sh`` supervises: the services it keeps running (``Stack``,
stopped in reverse start order, their PIDs in ``pids.json``) and the preparation and
evaluation commands it runs in the foreground (``run_step``, or ``start_step`` then
``finish_step`` when one overlaps other work). Each is a ``ManagedProcess``
(launch/procs.py): own process group, own log under the run directory. Their memory is
sampled while they run, so that a death says whether the kernel's OOM killer did it, with the
figures (launch/exits.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from launch import progress
from launch.exits import MemoryWatch, explain
from launch.follow import LogSource, Source
from launch.procs import ManagedProcess, tail

PY = sys.executable
"""The interpreter every service and step runs under."""


class ServiceFailed(RuntimeError):
    """A service did not come up or died; the message names the log to read."""


class Stack:
    """The processes this launcher started, in start order; stopped in reverse order."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.procs: list[ManagedProcess] = []
        self.watches: dict[int, MemoryWatch] = {}

    def add(self, proc: ManagedProcess) -> ManagedProcess:
        self.procs.append(proc)
        self.watches[proc.pid] = MemoryWatch(proc.pid)
        self.write_pids()
        return proc

    def sample(self) -> None:
        """Note the memory of every running service (call it about once a second)."""
        for p in self.procs:
            if p.alive():
                self.watches[p.pid].sample()

    def died(self, p: ManagedProcess) -> str:
        """What to tell the user about the service ``p`` that ended: its exit status, its
        log, its last lines, and why (an OOM kill, a failed checkpoint write)."""
        rc = p.popen.returncode if p.popen else None
        why = explain(p.name, rc, p.log_path, self.watches.get(p.pid))
        return f"{p.name} exited with {rc}; read {p.log_path}:\n{tail(p.log_path, 20)}" + (
            f"\n{why}" if why else ""
        )

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None):
        return self.add(ManagedProcess(name, argv, self.run_dir / f"{name}.log", env=env).start())

    def check_alive(self, *names: str) -> None:
        self.sample()
        for p in self.procs:
            if p.name in names and not p.alive():
                raise ServiceFailed(self.died(p))

    def stop(self, name: str) -> None:
        for p in self.procs:
            if p.name == name:
                p.stop()
        self.write_pids()

    def stop_all(self) -> None:
        for p in reversed(self.procs):
            p.stop()
        self.write_pids()

    def write_pids(self) -> None:
        pids = {
            p.name: {"pid": p.pid, "alive": p.alive(), "log": str(p.log_path)} for p in self.procs
        }
        tmp = self.run_dir / "pids.json.tmp"  # atomic: a reader never sees half a file
        tmp.write_text(json.dumps(pids, indent=2) + "\n")
        os.replace(tmp, self.run_dir / "pids.json")


def run_step(
    name: str,
    argv: list[str],
    log: Path,
    env: dict[str, str] | None = None,
    title: str | None = None,
    source: Source | None = None,
) -> None:
    """A preparation command in the foreground (stopped by PID if we are interrupted), shown
    on the console as phase ``title`` (launch/progress.py; ``source``: its latest log line)."""
    finish_step(start_step(name, argv, log, env), title, source)


def start_step(
    name: str, argv: list[str], log: Path, env: dict[str, str] | None = None
) -> ManagedProcess:
    """Start a step that :func:`finish_step` waits for later (work that overlaps another's)."""
    print(f"[run_all] {name}: {' '.join(argv[1:])}  (log: {log})", flush=True)
    return ManagedProcess(name, argv, log, env=env).start()


def finish_step(
    proc: ManagedProcess, title: str | None = None, source: Source | None = None
) -> None:
    """Wait for a started step as phase ``title``; its failure is a ``ServiceFailed``."""
    watch = MemoryWatch(proc.pid)
    try:
        with progress.phase(title or proc.name, source=source or LogSource(proc.log_path)):
            while proc.popen.poll() is None:
                watch.sample()
                try:
                    proc.popen.wait(timeout=1.0)
                except subprocess.TimeoutExpired:
                    pass
            rc = proc.popen.returncode
    finally:
        proc.stop()
    if rc != 0:
        why = explain(proc.name, rc, proc.log_path, watch)
        why = f"\n{why}" if why else ""
        raise ServiceFailed(
            f"{proc.name} failed (exit {rc}); read {proc.log_path}:\n{tail(proc.log_path, 20)}{why}"
        )


def wait_http(
    proc: ManagedProcess, url: str, timeout: float, headers: Mapping[str, str] | None = None
) -> None:
    """Wait for ``proc`` to answer ``url`` (``headers`` with every try); a death or a timeout
    is a ``ServiceFailed``."""
    try:
        proc.wait_http(url, timeout=timeout, headers=headers)
    except (RuntimeError, TimeoutError) as e:
        raise ServiceFailed(str(e)) from e
