"""``shared_vllm --single-copy`` on CPU: ``SharedMemoryBridge`` (engine ``shm``), the trainer
packs straight into one POSIX shared-memory segment that every worker maps; only metadata goes
over HTTP. The staged flow it shares: ``trainer/bridge/staged.py``; docs/BRIDGE.md.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from trainer.bridge.deadline import SyncDeadlines
from trainer.bridge.staged import StagedBridge, sweep_segments
from vllm_patching.shm_segment import ShmSegment, new_segment_name
from vllm_patching.transport import PackPlan


class SharedMemoryBridge(StagedBridge):
    """CPU single copy: the trainer writes into /dev/shm, workers read it in place."""

    backend = "shm"

    def __init__(
        self,
        server_urls: Sequence[str],
        token: str | None = None,
        timeout: float = 600.0,
        deadlines: SyncDeadlines | None = None,
    ):
        super().__init__(server_urls, token=token, timeout=timeout, deadlines=deadlines)
        self.segment: ShmSegment | None = None

    def _open(self, plan: PackPlan) -> None:
        sweep_segments()
        name = new_segment_name()
        self.segment = ShmSegment(name, max(plan.total_bytes, 1), create=True)
        info = {"segment": name, "size": self.segment.size}
        self.each(
            lambda s: s.post("/init_weight_transfer_engine", json={"init_info": info}), "connect"
        )

    def _buckets(self) -> list[torch.Tensor]:
        assert self.segment is not None and self.plan is not None
        return [self.segment.buffer[: self.plan.total_bytes]]

    def _send(self) -> None:
        """Nothing to send: the bytes are already where the workers read them."""

    def _close_data_plane(self) -> None:
        if self.segment is not None:
            try:
                self.each(lambda s: s.post("/shutdown_weight_transfer_engine"), "close")
            except Exception:  # noqa: BLE001 - the server may be gone; still unlink
                pass
            self.segment.close()
            self.segment = None
