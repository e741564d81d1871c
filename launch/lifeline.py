"""Every process we start dies with the process that started it, however that one dies
(SIGKILL included). ``launch.procs.ManagedProcess.start`` sets up two guards (Linux):

1. **Parent-death signal.** Between fork and exec the child asks the kernel
   (``prctl(PR_SET_PDEATHSIG, SIGKILL)``, ``procutil.parent_death``) to be killed when its
   parent dies. The kernel tracks the parent *thread*, so the signal is only asked for when
   the child is started from the main thread (a worker thread that ends would take the child
   with it). It reaches the direct child only, not the processes a service starts itself
   (vLLM's engine core and its worker, a multiprocessing resource tracker): vLLM 0.32's
   engine core does not watch its API server and keeps running when that one is SIGKILLed
   (with its worker and resource tracker: still there 30 s later, docs/TESTING.md).
2. **A reaper.** One small process per starting process (``python -m launch.lifeline``), in
   its own session (a signal to the starter's process group or terminal does not reach it),
   reads a pipe whose only write end the starter holds. Every service runs in its own
   process group, registered with the reaper when it starts and unregistered once stopped.
   When the write end closes -- the starter exited, whatever the way -- the reaper sends
   SIGTERM to every registered group that still has a live member, SIGKILL to what is left
   after ``--grace`` seconds, notes it in each service's log, and exits.

The helpers below read ``/proc`` (a zombie counts as gone: an orphan's zombie waits for
PID 1 to reap it, and some container init processes never do).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO, NamedTuple

from procutil import parent_death

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_GRACE_S = 5.0
"""Seconds between the reaper's SIGTERM and its SIGKILL (vLLM shuts its engine down on
SIGTERM in about a second)."""


class ProcInfo(NamedTuple):
    """One line of ``/proc/<pid>/stat``, the fields we use."""

    pid: int
    state: str
    ppid: int
    pgrp: int
    starttime: int
    """Clock ticks after boot: with ``pid``, names a process even after its PID is reused."""


def proc_info(pid: int) -> ProcInfo | None:
    """The process ``pid`` (None if there is none)."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (OSError, ValueError):
        return None
    rest = raw[raw.rindex(")") + 2 :].split()  # the name (field 2) may hold spaces and ')'
    return ProcInfo(pid, rest[0], int(rest[1]), int(rest[2]), int(rest[19]))


def processes() -> Iterator[ProcInfo]:
    """Every process on the machine (those that vanish while we read are skipped)."""
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and (info := proc_info(int(entry.name))) is not None:
            yield info


def is_running(pid: int, starttime: int | None = None) -> bool:
    """``pid`` runs (not a zombie) and, when given, is the process that started at
    ``starttime`` (not a later one that got the same PID)."""
    info = proc_info(pid)
    if info is None or info.state in ("Z", "X"):
        return False
    return starttime is None or info.starttime == starttime


def is_stopped(pid: int) -> bool:
    """``pid`` is stopped by a signal (SIGSTOP: state ``T``), e.g. at a test fault point."""
    info = proc_info(pid)
    return info is not None and info.state == "T"


def descendants(pid: int) -> list[ProcInfo]:
    """Every process below ``pid`` in the process tree (children, their children, ...)."""
    by_parent: dict[int, list[ProcInfo]] = {}
    for info in processes():
        by_parent.setdefault(info.ppid, []).append(info)
    out, todo = [], [pid]
    while todo:
        for child in by_parent.get(todo.pop(), []):
            out.append(child)
            todo.append(child.pid)
    return out


def group_members(pgid: int) -> list[ProcInfo]:
    """The running (non-zombie) processes of process group ``pgid``."""
    if not os.path.isdir("/proc"):  # not Linux: signal 0 says whether the group exists
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return []
        return [ProcInfo(pgid, "?", 0, pgid, 0)]
    return [p for p in processes() if p.pgrp == pgid and p.state not in ("Z", "X")]


def signal_group(pgid: int, sig: int) -> None:
    """``killpg`` that ignores a group that is already gone (and signals only the leader
    when another user's process joined the group)."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass
    except PermissionError:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pgid, sig)


def stop_groups(pgids: Iterable[int], grace: float = DEFAULT_GRACE_S) -> list[int]:
    """SIGTERM each group that has a live member, SIGKILL those still alive after
    ``grace`` seconds. Returns the groups that had to be SIGKILLed."""
    live = [g for g in pgids if group_members(g)]
    for g in live:
        signal_group(g, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while live and time.monotonic() < deadline:
        time.sleep(0.1)
        live = [g for g in live if group_members(g)]
    for g in live:
        signal_group(g, signal.SIGKILL)
    return live


# ---------------------------------------------------------------------------- the child side


def die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child get SIGKILL when this thread dies
    (``procutil.parent_death.die_with``); None where that cannot work (not Linux, or not the
    main thread: see the module docstring)."""
    if not parent_death.SUPPORTED or threading.current_thread() is not threading.main_thread():
        return None
    die_with, parent = parent_death.die_with, os.getpid()

    def preexec() -> None:
        die_with(parent)  # a failed request is not fatal: the reaper still stops the group

    return preexec


# --------------------------------------------------------------------------- the starter side


class Lifeline:
    """The starter's end: the write end of the reaper's pipe and the groups registered."""

    def __init__(self, grace: float = DEFAULT_GRACE_S) -> None:
        self.grace = grace
        self.reaper: subprocess.Popen[bytes] | None = None
        self._fd: int | None = None
        """Our end of the reaper's pipe (a bare fd: a forked child closes it lock-free)."""
        self._groups: dict[int, dict[str, object]] = {}
        self._lock = threading.Lock()

    def register(self, pgid: int, name: str, log: Path | str | None = None) -> None:
        """Stop process group ``pgid`` (service ``name``, noted in ``log``) if we die."""
        msg = {"op": "add", "pgid": pgid, "name": name, "log": str(log) if log else None}
        with self._lock:
            self._groups[pgid] = msg
            self._send(msg)

    def unregister(self, pgid: int) -> None:
        """``pgid`` was stopped by us: the reaper forgets it."""
        with self._lock:
            if self._groups.pop(pgid, None) is not None:
                self._send({"op": "del", "pgid": pgid})

    def close(self) -> None:
        """Close our end now (what our death does): the reaper stops what is registered,
        and we forget it (a later registration starts a new reaper)."""
        with self._lock:
            self._close_fd()
            self._groups.clear()

    def _close_fd(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
        self._fd = None

    def _send(self, msg: dict[str, object]) -> None:
        line = _encode(msg)
        for _ in range(2):  # a reaper that died (someone killed it) is replaced once
            if self._fd is None or self.reaper is None or self.reaper.poll() is not None:
                self._start_reaper()
                line = b"".join(_encode(m) for m in self._groups.values())  # all we hold
            try:
                assert self._fd is not None
                view = memoryview(line)
                while view:
                    view = view[os.write(self._fd, view) :]
                return
            except OSError:  # EPIPE: the reaper is gone
                self._close_fd()
        raise RuntimeError("the lifeline reaper (python -m launch.lifeline) keeps dying")

    def _start_reaper(self) -> None:
        self._close_fd()
        read, write = os.pipe()  # both non-inheritable: no other child holds the write end
        try:
            owner = ["--owner", str(os.getpid()), "--grace", str(self.grace)]
            self.reaper = subprocess.Popen(
                [sys.executable, "-m", "launch.lifeline", *owner],
                stdin=read,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                cwd=REPO_ROOT,
                start_new_session=True,  # a signal to our group or terminal does not reach it
            )
        except BaseException:
            os.close(write)
            raise
        finally:
            os.close(read)
        self._fd = write

    def _forget_in_fork(self) -> None:
        """A forked child must not hold our write end (it would keep the reaper waiting),
        nor think it started our services."""
        self._close_fd()
        self.reaper, self._groups = None, {}
        self._lock = threading.Lock()


def _encode(msg: dict[str, object]) -> bytes:
    return (json.dumps(msg) + "\n").encode()


_LIFELINE: Lifeline | None = None


def lifeline() -> Lifeline:
    """This process's lifeline (its reaper starts with the first registration)."""
    global _LIFELINE
    if _LIFELINE is None:
        _LIFELINE = Lifeline()
        os.register_at_fork(after_in_child=_LIFELINE._forget_in_fork)
    return _LIFELINE


# ---------------------------------------------------------------------------- the reaper side


def _note(msg: dict[str, object], text: str) -> None:
    if msg.get("log"):
        with contextlib.suppress(OSError), open(str(msg["log"]), "a") as f:
            f.write(f"[lifeline] {text}\n")


def reap(stream: IO[bytes], owner: int, grace: float = DEFAULT_GRACE_S) -> list[int]:
    """Read registrations from ``stream`` until EOF, then stop the groups still registered.
    Returns the groups it found alive."""
    groups: dict[int, dict[str, object]] = {}
    for raw in stream:
        try:
            msg = json.loads(raw)
            pgid = int(msg["pgid"])
        except (ValueError, KeyError, TypeError):
            continue
        if msg.get("op") == "add":
            groups[pgid] = msg
        else:
            groups.pop(pgid, None)
    live = [g for g in groups if group_members(g)]
    for g, msg in groups.items():
        what = f"process group {g} has ended already"
        if g in live:
            what = f"stopping process group {g} (SIGTERM, SIGKILL after {grace:g} s)"
        _note(msg, f"pid {owner}, which started {msg.get('name')}, is gone: {what}")
    killed = stop_groups(live, grace)
    for g in killed:
        _note(groups[g], f"process group {g} outlived SIGTERM by {grace:g} s: SIGKILLed")
    return live


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m launch.lifeline",
        description="Stop registered process groups when stdin closes.",
    )
    p.add_argument("--owner", type=int, required=True, help="PID of the starter (for the logs).")
    p.add_argument("--grace", type=float, default=DEFAULT_GRACE_S)
    args = p.parse_args(argv)
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_IGN)
    reap(sys.stdin.buffer, args.owner, args.grace)
    return 0


if __name__ == "__main__":
    sys.exit(main())
