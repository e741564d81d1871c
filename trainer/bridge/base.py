"""The bridge interface the trainer uses: ``sync(model, version)`` then ``close()``."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from trainer.bridge.deadline import SyncDeadlines, bounded
from trainer.bridge.http import ServerClient
from trainer.bridge.runs import ServerRuns

T = TypeVar("T")


@dataclass
class SyncStats:
    """Timings of one sync (seconds); ``stall_s`` is how long generation was paused."""

    version: int
    total_s: float = 0.0
    pack_s: float = 0.0
    transfer_s: float = 0.0
    stall_s: float = 0.0
    bytes: int = 0
    detail: dict[str, Any] = field(default_factory=dict)


class WeightBridge(ABC):
    """Pushes the trainer's weights into one or more running vLLM servers.

    ``sync`` returns when every server serves ``version`` (requests in flight during the
    sync finish on the new weights); it raises on any failure, leaving the servers on the
    previous weights or, for a partial failure, with generation resumed.

    Every wait on a server is bounded by its phase's deadline (``deadlines``,
    trainer/bridge/deadline.py): a phase that misses it raises ``SyncTimeout``.
    """

    def __init__(
        self,
        server_urls: Sequence[str],
        token: str | None = None,
        timeout: float = 600.0,
        deadlines: SyncDeadlines | None = None,
    ):
        if not server_urls:
            raise ValueError("at least one server url is needed")
        self.deadlines = deadlines or SyncDeadlines()
        self.servers = [ServerClient(u, token=token, timeout=timeout) for u in server_urls]
        self.last_stats: SyncStats | None = None
        self.runs = ServerRuns(lambda: [h["run_id"] for h in self.each(ServerClient.health)])
        """Which run of each server the weights are on (a new run_id = a restart)."""

    @abstractmethod
    def sync(self, model: torch.nn.Module, version: int) -> SyncStats:
        """Make every server serve ``model``'s current weights as ``version``."""

    def close(self) -> None:
        for s in self.servers:
            s.close()

    def __enter__(self) -> WeightBridge:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- helpers ---------------------------------------------------------------------------
    def each(self, fn: Callable[[ServerClient], T], phase: str = "check") -> list[T]:
        """Run ``fn`` on every server concurrently within ``phase``'s deadline; re-raise the
        first failure, or ``SyncTimeout`` naming a server that did not answer in time."""
        calls = [(s.base_url, lambda s=s: fn(s)) for s in self.servers]
        return bounded(phase, calls, self.deadlines.of(phase))
