"""``ServerRuns``: the one record of which run of each inference server the trainer's
weights are on (docs/FAULT_TOLERANCE.md, "vLLM restarts").

A patched vLLM server draws a random ``run_id`` when it starts (``/bridge/info``,
``/bridge/health``). A new one means the server restarted: it serves the start weights and
its transfer engine (gloo group, /dev/shm segment, NCCL communicator) is gone. Every bridge
owns one ``ServerRuns`` (``bridge.runs``); the bridges that keep a data plane set it when
they set that up and check it before a sync, and the trainer's ``WeightSync``
(trainer/grpo.py) asks it whether a server restarted while it waits for data.
"""

from __future__ import annotations

from collections.abc import Callable


class ServerRuns:
    """The run_id of every server (in the bridge's server order) as last set up or synced.

    ``ids`` is ``None`` until recorded; an unknown record counts as a restart (the trainer
    then syncs, which is always safe).
    """

    def __init__(self, read: Callable[[], list[str]]) -> None:
        self._read = read
        self.ids: list[str] | None = None

    def current(self) -> list[str]:
        """Every server's run_id now (one ``/bridge/health`` each); raises when one is
        unreachable."""
        return [str(i) for i in self._read()]

    def record(self, ids: list[str]) -> None:
        """The servers now run ``ids`` (set up, or synced, on those runs)."""
        self.ids = [str(i) for i in ids]

    def restarted(self, now: list[str] | None = None) -> bool:
        """Does some server run another run than the recorded one? ``now``: the ids just
        read (default: read them now, which raises when a server is unreachable)."""
        return (self.current() if now is None else now) != self.ids
