"""Deadlines of a weight sync's phases (docs/FAULT_TOLERANCE.md, "A weight sync that hangs").

Every step of a sync that waits on an inference server -- an HTTP call, the gloo
rendezvous, a gloo broadcast -- runs in a daemon thread of its own and is waited for at most
its phase's deadline (``SyncDeadlines``). A phase that misses it raises ``SyncTimeout``,
which names the phase, the server and the deadline; the blocked thread is abandoned (a
blocked socket read or gloo call cannot be interrupted; it ends with its own timeout, set
to the same deadline, and being a daemon it never holds the trainer's exit).

The phases (each transport uses the ones it has, docs/BRIDGE.md):

- ``check``: a server's ``/bridge/health`` or ``/bridge/info`` (run_id, version, set-up);
- ``connect``: the data plane's set-up: ``/init_weight_transfer_engine`` and, for the
  broadcast, the gloo rendezvous;
- ``stage``: ``/bridge/stage`` (the broadcast to a receiver on another host);
- ``transfer``: the gloo broadcast of the packed buckets;
- ``apply``: the call that pauses generation, loads the weights, sets the version and
  resumes: ``/bridge/apply``, ``/bridge/reload``, ``/bridge/lora/load``;
- ``close``: ``/shutdown_weight_transfer_engine`` when the trainer drops its data plane.

Packing and saving run in the trainer's own process on its own memory and disk, with no
server to wait for, and are not bounded here.

Tests stop a server at a chosen phase for certain, not by timing (procutil/faults.py).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, wait
from typing import TypeVar

from procutil.faults import fault_point
from trainer.weights_config import SyncDeadlines

T = TypeVar("T")

__all__ = ["SyncDeadlines", "SyncTimeout", "bounded", "spawn"]


class SyncTimeout(TimeoutError):
    """A weight sync's phase missed its deadline: ``phase``, ``server`` (its URL) and
    ``deadline_s`` say which. The sync is not retried: the trainer stops (exit 75)."""

    def __init__(self, phase: str, server: str, deadline_s: float) -> None:
        self.phase, self.server, self.deadline_s = phase, server, deadline_s
        super().__init__(
            f"weight sync to {server} timed out in phase {phase!r} after {deadline_s:g} s "
            f"(--sync-deadline.{phase}; is the server stopped or overloaded?)"
        )


_local = threading.local()


def current_deadline() -> float | None:
    """The deadline of the phase this thread runs a call of (``bounded``), else None: the
    HTTP client times its request out with it, so an abandoned call ends by itself."""
    return getattr(_local, "deadline_s", None)


def spawn(fn: Callable[[], T], name: str) -> Future[T]:
    """``fn()`` in a daemon thread of its own; its outcome in the returned future. (Not a
    pool: a call that hangs is abandoned and must neither take a worker from the next sync
    nor hold the trainer's exit.)"""
    out: Future[T] = Future()

    def run() -> None:
        try:
            out.set_result(fn())
        except BaseException as e:  # noqa: BLE001 - re-raised by whoever waits
            out.set_exception(e)

    threading.Thread(target=run, name=name, daemon=True).start()
    return out


def bounded(phase: str, calls: Sequence[tuple[str, Callable[[], T]]], deadline_s: float) -> list[T]:
    """Run every ``(server_url, fn)`` of ``calls`` at once, each in its own daemon thread,
    and wait at most ``deadline_s`` for all of them. The first call (in order) that failed
    raises its error; else one still running raises ``SyncTimeout`` naming its server."""
    import httpx

    fault_point(phase)

    def timed(fn: Callable[[], T]) -> Callable[[], T]:
        def run() -> T:
            _local.deadline_s = deadline_s
            return fn()

        return run

    futures = [spawn(timed(fn), f"bridge-{phase}") for _, fn in calls]
    wait(futures, timeout=deadline_s)
    for (url, _), f in zip(calls, futures, strict=True):
        if f.done() and (e := f.exception()) is not None:
            if isinstance(e, httpx.TimeoutException):  # its own timeout: the same deadline
                raise SyncTimeout(phase, url, deadline_s) from e
            raise e
    for (url, _), f in zip(calls, futures, strict=True):
        if not f.done():
            raise SyncTimeout(phase, url, deadline_s)
    return [f.result() for f in futures]
