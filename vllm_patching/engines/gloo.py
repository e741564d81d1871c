"""``gloo_bcast``: the CPU analogue of vLLM's ``nccl`` engine.

The trainer is rank 0 of a stand-alone gloo group; every vLLM worker of every server joins
it at ``rank_offset + worker rank``. Each sync the trainer broadcasts the packed buckets; the
worker's weight-updater thread receives them into fresh buffers while generation continues.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.distributed.weight_transfer.base import WeightTransferInitInfo

from vllm_patching.engines.staged import StagedUpdateInfo, StagedWeightTransferEngine
from vllm_patching.transport import broadcast, gloo_group, plan_buckets, unpack


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    """Rendezvous of the transfer group (rank 0 = trainer, hosting the TCP store)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    timeout_s: float = 300.0


class GlooBroadcastWeightTransferEngine(StagedWeightTransferEngine):
    init_info_cls = GlooInitInfo

    def __init__(self, config, vllm_config, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group = None

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        if self.group is not None:
            self.shutdown()
        pc = self.parallel_config
        # Unique across data-parallel replicas, as in vLLM's NCCL engine.
        rank = init_info.rank_offset + pc.data_parallel_index * pc.world_size + pc.rank
        self.group = gloo_group(
            init_info.master_address,
            init_info.master_port,
            rank,
            init_info.world_size,
            init_info.timeout_s,
        )

    def stage(self, info: StagedUpdateInfo) -> list[tuple[str, torch.Tensor]]:
        if self.group is None:
            raise RuntimeError("gloo transfer group not initialised: call init first")
        plan = plan_buckets(info.metas(), info.bucket_bytes)
        buckets = []
        for size in plan.bucket_sizes:
            buf = torch.empty(size, dtype=torch.uint8)
            broadcast(self.group, buf, root=0)
            buckets.append(buf)
        return list(unpack(plan, buckets))

    def shutdown(self) -> None:
        self.group = None
