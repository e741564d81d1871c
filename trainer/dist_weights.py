"""Weight sync from an FSDP2-sharded trainer: gather to rank 0, then the unchanged bridge.

The inference servers speak one protocol (trainer/bridge/, docs/BRIDGE.md) with one sender.
Rank 0 keeps an unsharded *replica* of the model (a copy made before sharding, on the
trainer's device; a peft model under LoRA). After every optimizer step all ranks run
``SyncReplica.gather``: one ``full_tensor()`` all-gather per parameter, in ``named_parameters``
order, each landing straight in the replica's parameter (on CPU in ``shared_vllm`` mode the
replica's parameters live in the bridge's shared-memory buckets, so the gather *is* the pack).
Rank 0 then syncs the replica with the same bridge, versions and protocol as one process, in
every mode. Under LoRA only the adapter is gathered: the base weights never change.

Cost: the replica is one more unsharded copy of the model on rank 0 (the other ranks hold
1/N); the all-gathers move (N-1)/N of the model to every rank (``all_gather`` is what FSDP's
collectives provide; a gather-to-one would move only rank 0's share but is not a DTensor
operation). ``gather_s`` is logged per step beside ``sync_s``.
"""

from __future__ import annotations

import copy
import time

import torch

from trainer.distributed import Dist, full_tensor


def make_replica(model: torch.nn.Module, d: Dist | None) -> torch.nn.Module | None:
    """Rank 0's unsharded copy (call before sharding); None on other ranks or one process."""
    if d is None or not d.is_main:
        return None
    replica = copy.deepcopy(model).eval()
    for p in replica.parameters():
        p.requires_grad_(False)
    return replica


class SyncReplica:
    """Keeps rank 0's replica equal to the sharded model (see the module docstring)."""

    def __init__(
        self, model: torch.nn.Module, replica: torch.nn.Module | None, d: Dist, lora: bool
    ) -> None:
        self.model, self.replica, self.dist = model, replica, d
        names = [n for n, p in model.named_parameters() if p.requires_grad or not lora]
        self.names = names
        """The parameters gathered each step (all of them, or the adapter's under LoRA)."""
        self._dst: dict[str, torch.nn.Parameter] = {}
        if replica is not None:
            own = dict(replica.named_parameters())
            missing = [n for n in names if n not in own]
            if missing:
                raise ValueError(f"replica lacks parameters {missing[:4]}")
            self._dst = {n: own[n] for n in names}

    @torch.no_grad()
    def gather(self) -> float:
        """All ranks: gather every synced parameter into rank 0's replica. Returns seconds."""
        t0 = time.perf_counter()
        params = dict(self.model.named_parameters())
        for name in self.names:
            full = full_tensor(params[name].detach())
            dst = self._dst.get(name)
            if dst is not None:
                dst.data.copy_(full)  # in place: the replica's storage may be a bridge bucket
        return time.perf_counter() - t0
