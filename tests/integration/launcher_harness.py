"""``launch/run_all.sh`` as a test subject: started in a session of its own, waited on by
its progress (output and run-directory files growing) rather than by one wall-clock budget,
and cleaned up however the test ends (the launcher by its PID, then every process group it
recorded in ``pids.json``; if the test process itself is killed, by its lifeline reaper),
with the log tails in the failure message."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from launch.lifeline import group_members, is_running, lifeline, signal_group
from launch.procs import REPO_ROOT, tail

RUN_ALL = str(REPO_ROOT / "launch" / "run_all.sh")
STALL_S = 900.0
"""A launcher whose output and run directory stay unchanged this long is stuck (vLLM's
start-up, the slowest silent phase, takes 35 s to 3 min on a busy 2-core box)."""
BACKSTOP_S = 3600.0
"""A run that keeps logging without ending (a retry loop) fails after this long anyway."""


class LauncherRun:
    """One ``run_all.sh`` process; its output goes to ``<run_dir>.out``."""

    def __init__(self, run_dir: Path, env: dict[str, str], args: list[str]) -> None:
        self.run_dir = run_dir
        self.out_path = run_dir.with_name(run_dir.name + ".out")
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        with self.out_path.open("wb") as out:
            self.proc = subprocess.Popen(
                [RUN_ALL, "--run-dir", str(run_dir), *args],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a test may signal the launcher's whole group
            )
        # In a session of its own the launcher would outlive a test process that is killed
        # (a timeout, CI cancelling the job): this process's reaper stops its group then, and
        # the launcher's own reaper what the launcher started (launch/lifeline.py).
        lifeline().register(self.proc.pid, "run_all", self.out_path)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def output(self) -> str:
        return self.out_path.read_text(errors="replace")

    def pids(self) -> dict[str, dict]:
        """``pids.json`` ({} until the launcher writes it)."""
        try:
            return json.loads((self.run_dir / "pids.json").read_text())
        except (OSError, ValueError):  # not written yet (it is replaced atomically)
            return {}

    def _progress(self) -> tuple:
        """Every file's size and mtime. ``os.walk`` skips a directory that vanishes while it
        walks (``Path.rglob`` raises: a checkpoint's ``.tmp-*`` directory is renamed away)."""
        files: list[tuple[str, int, int]] = []
        found = [Path(d) / n for d, dirs, names in os.walk(self.run_dir) for n in dirs + names]
        for path in [self.out_path, *found]:
            try:
                st = path.stat()
            except OSError:
                continue
            files.append((str(path), st.st_size, st.st_mtime_ns))
        return tuple(sorted(files))

    def wait_until(self, cond: Callable[[], bool], what: str, stall: float = STALL_S) -> None:
        """Until ``cond()``; fails (with the log tails) if the launcher exits first, stops
        making progress for ``stall`` seconds, or runs past ``BACKSTOP_S``."""
        start = last_change = time.monotonic()
        seen = self._progress()
        while not cond():
            if self.proc.poll() is not None and not cond():
                self.fail(f"the launcher exited ({self.proc.returncode}) before {what}")
            now = time.monotonic()
            if (current := self._progress()) != seen:
                seen, last_change = current, now
            if now - last_change > stall:
                self.fail(f"no progress for {stall:.0f} s while waiting for {what}")
            if now - start > BACKSTOP_S:
                self.fail(f"still waiting for {what} after {BACKSTOP_S:.0f} s")
            time.sleep(0.5)

    def wait(self, stall: float = STALL_S) -> int:
        """Until the launcher exits (see ``wait_until``); its exit code."""
        self.wait_until(lambda: self.proc.poll() is not None, "the launcher to exit", stall)
        return int(self.proc.returncode)

    def tails(self, n: int = 15) -> str:
        parts = [f"--- launcher output ({self.out_path}):\n{tail(self.out_path, 40)}"]
        for log in sorted(self.run_dir.glob("*.log")):
            parts.append(f"--- {log.name}:\n{tail(log, n)}")
        return "\n".join(parts)

    def fail(self, why: str) -> None:
        tails = self.tails()
        self.cleanup()
        pytest.fail(f"{why}\n{tails}", pytrace=False)

    def cleanup(self) -> None:
        """SIGKILL the launcher (its reaper then stops what it started) and, in case that
        failed, every process group it recorded; wait (bounded) until they are gone."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        groups = [int(p["pid"]) for p in self.pids().values()]
        for g in groups:
            signal_group(g, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while any(group_members(g) for g in groups) and time.monotonic() < deadline:
            time.sleep(0.2)
        lifeline().unregister(self.proc.pid)


def gone(pid: int) -> bool:
    """No running process has ``pid`` (a zombie waiting for its reaper counts as gone)."""
    return not is_running(pid)


def start_launcher(run_dir: Path, env: dict[str, str], *args: str) -> LauncherRun:
    """``run_all.sh --run-dir RUN_DIR ARGS...`` (stop it with ``cleanup``)."""
    return LauncherRun(run_dir, env, list(args))
