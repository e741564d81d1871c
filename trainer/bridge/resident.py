"""The trainer's parameters living in the weight-transfer buffers (docs/BRIDGE.md,
"Resident weights")."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from vllm_patching.transport import Packer

log = logging.getLogger(__name__)


class ResidentWeights:
    """The trainer's parameters, moved into the data plane's buckets: zero-copy syncs.

    A sync packs the same parameters into the same slots every step, so instead the
    parameters are made to live there: ``param.data`` becomes the slot's typed view (the
    values are copied once, here). The optimizer then updates the shared bytes in place and
    a sync has nothing left to copy: with ``--single-copy`` (and the broadcast's same-host
    fast path) vLLM's workers read the trainer's own parameters. This is safe because a
    sync is synchronous -- the trainer does not step while the workers read -- and because
    ``release`` moves the values back into private memory before the buckets go away.

    Parameters that cannot live in their slot (another device or dtype than the serving
    one, non-contiguous) are left alone and copied by every sync as before.
    """

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.params = params

    @classmethod
    @torch.no_grad()
    def adopt(cls, packer: Packer, params: Sequence[torch.nn.Parameter]) -> ResidentWeights:
        moved = []
        for p, view in zip(params, packer.slot_views(), strict=True):
            if p.device != view.device or p.dtype != view.dtype or p.shape != view.shape:
                continue
            if not p.is_contiguous() or not isinstance(p, torch.nn.Parameter):
                continue  # (a LoRA-merged weight is a new tensor each sync: copied)
            view.copy_(p.data)
            p.data = view
            moved.append(p)
        log.info(
            "%d of %d parameters now live in the weight-transfer buffers (zero-copy syncs)",
            len(moved),
            len(params),
        )
        return cls(moved)

    @torch.no_grad()
    def release(self) -> None:
        """Give every adopted parameter private memory again (same values)."""
        for p in self.params:
            p.data = p.data.clone()
        self.params = []
