"""``gloo_bcast``: the CPU analogue of vLLM's ``nccl`` engine.

The trainer is rank 0 of a stand-alone gloo group; every vLLM worker of every server joins
it at ``rank_offset + worker rank``. Each sync the trainer broadcasts the packed buckets; the
worker's weight-updater thread receives them into its receive buffers (allocated once, kept
for the next syncs) while generation continues.

Same-host fast path (what NCCL's SHM transport does between ranks of one node): the trainer
packs into a POSIX shared-memory segment and names it in the init info with a random nonce
it wrote there. A worker that maps the segment and reads the same nonce is on this host and
in this IPC namespace; it reads the buckets in place from its mapping and takes no part in
the broadcast. The flags are all-gathered over the full group at init, and the ranks that
could not map the segment (other hosts) form a second gloo group with the trainer, which
broadcasts the same segment bytes to them. Every rank local: no broadcast at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.distributed.weight_transfer.base import WeightTransferInitInfo
from vllm.logger import init_logger

from vllm_patching.engines.staged import StagedUpdateInfo, StagedWeightTransferEngine
from vllm_patching.gloo_group import (
    allgather_flags,
    broadcast,
    gloo_group_on,
    gloo_store,
    remote_group,
)
from vllm_patching.shm_segment import ShmSegment, shm_handshake
from vllm_patching.transport import bucket_views, plan_buckets, unpack

logger = init_logger("vllm.shop_r1_bridge." + __name__.rsplit(".", 1)[-1])


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    """Rendezvous of the transfer group (rank 0 = trainer, hosting the TCP store), and the
    trainer's shared-memory segment for same-host ranks (optional)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    timeout_s: float = 300.0
    shm_segment: str | None = None
    shm_size: int = 0
    shm_nonce: str | None = None


class GlooBroadcastWeightTransferEngine(StagedWeightTransferEngine):
    init_info_cls = GlooInitInfo

    def __init__(self, config, vllm_config, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group = None
        self.segment: ShmSegment | None = None
        self._recv: list[torch.Tensor] = []

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        self.abandon()  # an update still receiving over the old group never completes
        self.shutdown()
        pc = self.parallel_config
        # Unique across data-parallel replicas, as in vLLM's NCCL engine.
        rank = init_info.rank_offset + pc.data_parallel_index * pc.world_size + pc.rank
        timeout = init_info.timeout_s
        store = gloo_store(
            init_info.master_address, init_info.master_port, rank, init_info.world_size, timeout
        )
        full = gloo_group_on(store, "shop_r1_bridge", rank, init_info.world_size, timeout)
        if init_info.shm_segment and init_info.shm_nonce:
            self.segment = shm_handshake(
                init_info.shm_segment, init_info.shm_size, init_info.shm_nonce
            )
        # Collective: every rank (the trainer too) learns who reads shared memory.
        local = allgather_flags(full, self.segment is not None)
        self.group = remote_group(store, rank, local, timeout)
        logger.info(
            "bridge gloo rank %d: %s (%d of %d receivers on shared memory)",
            rank,
            "shared memory" if self.segment is not None else "gloo broadcast",
            sum(local[1:]),
            len(local) - 1,
        )

    def stage(self, info: StagedUpdateInfo) -> list[tuple[str, torch.Tensor]]:
        plan = plan_buckets(info.metas(), info.bucket_bytes or (1 << 62))
        if self.segment is not None:
            self.last_path = "shm"
            return list(unpack(plan, bucket_views(self.segment.buffer, plan)))
        if self.group is None:
            raise RuntimeError("gloo transfer group not initialised: call init first")
        self.last_path = "gloo"
        if [b.numel() for b in self._recv] != list(plan.bucket_sizes):
            # Allocated once and reused: no per-sync allocation and page faults. The staged
            # views are dropped after each apply, before the next receive writes here.
            self._recv = [torch.empty(n, dtype=torch.uint8) for n in plan.bucket_sizes]
        # this update's group and buffers, whatever a new init puts on the engine meanwhile
        group, recv = self.group, self._recv
        for buf in recv:
            broadcast(group, buf, root=0)
        return list(unpack(plan, recv))

    def shutdown(self) -> None:
        self.group = None
        self._recv = []
        if self.segment is not None:
            self.segment.close()
            self.segment = None
