"""``shm``: single-copy transfer on CPU through a POSIX shared-memory segment.

The trainer owns one segment sized for the whole model (named in the init info), writes the
packed tensors into it, and sends only metadata. The worker maps the segment once and its
weight-updater thread builds typed views on the mapping, so ``load_weights`` reads the
trainer's bytes in place -- the CPU analogue of CUDA IPC handles. The trainer must not write
the segment again before ``finish_weight_update`` returned (the trainer client guarantees it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.distributed.weight_transfer.base import WeightTransferInitInfo

from vllm_patching.engines.staged import StagedUpdateInfo, StagedWeightTransferEngine
from vllm_patching.shm_segment import ShmSegment
from vllm_patching.transport import plan_buckets, unpack


@dataclass
class ShmInitInfo(WeightTransferInitInfo):
    """The trainer's segment: name in /dev/shm (``shop_r1_bridge_*``) and size in bytes."""

    segment: str
    size: int


class SharedMemoryWeightTransferEngine(StagedWeightTransferEngine):
    init_info_cls = ShmInitInfo

    def __init__(self, config, vllm_config, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.segment: ShmSegment | None = None

    def init_transfer_engine(self, init_info: ShmInitInfo) -> None:
        self.abandon()  # an update staged from the old segment is never applied
        self.shutdown()
        self.segment = ShmSegment(init_info.segment, init_info.size, create=False)

    def stage(self, info: StagedUpdateInfo) -> list[tuple[str, torch.Tensor]]:
        if self.segment is None:
            raise RuntimeError("shared-memory segment not mapped: call init first")
        plan = plan_buckets(info.metas(), bucket_bytes=1 << 62)
        if plan.total_bytes > self.segment.size:
            raise ValueError(
                f"update needs {plan.total_bytes} bytes, segment has {self.segment.size}"
            )
        self.last_path = "shm"
        return list(unpack(plan, [self.segment.buffer]))

    def shutdown(self) -> None:
        if self.segment is not None:
            self.segment.close()
            self.segment = None
