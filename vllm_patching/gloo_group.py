"""The gloo side of the bridge's data plane: stand-alone process groups between the trainer
(rank 0) and the vLLM workers, and the collectives the transfer uses (docs/BRIDGE.md).

Pure torch, no vLLM import: the trainer imports this module too.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence

import torch


def gloo_store(
    host: str, port: int, rank: int, world_size: int, timeout_s: float = 300.0
) -> torch.distributed.Store:
    """The TCP store of the transfer group (rank 0 hosts it)."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    return dist.TCPStore(
        host, port, world_size, is_master=(rank == 0), timeout=timeout, wait_for_workers=False
    )


def gloo_group_on(
    store: torch.distributed.Store,
    prefix: str,
    rank: int,
    world_size: int,
    timeout_s: float = 300.0,
) -> torch.distributed.ProcessGroup:
    """A stand-alone gloo group on ``store`` under ``prefix`` (several groups can share one
    store: the full group and the remote-only group of the shared-memory fast path)."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    return dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, world_size, timeout)


def gloo_group(
    host: str, port: int, rank: int, world_size: int, timeout_s: float = 300.0
) -> torch.distributed.ProcessGroup:
    """A stand-alone gloo group (no ``init_process_group``: the trainer's own default
    group, if any, and vLLM's groups stay untouched). Rank 0 hosts the TCP store.

    Blocks until all ``world_size`` ranks have joined.
    """
    store = gloo_store(host, port, rank, world_size, timeout_s)
    return gloo_group_on(store, "shop_r1_bridge", rank, world_size, timeout_s)


def allgather_flags(group: torch.distributed.ProcessGroup, flag: bool) -> list[bool]:
    """Every rank's ``flag``, in rank order (a collective: every rank must call it).

    An all-reduce of one-hot vectors (the gloo all-gather options type is not exported by
    every torch build; the all-reduce one is).
    """
    import torch.distributed as dist

    vec = torch.zeros(group.size(), dtype=torch.int32)
    vec[group.rank()] = int(flag)
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    group.allreduce([vec], opts).wait()
    return [bool(v) for v in vec.tolist()]


def remote_ranks(local: Sequence[bool]) -> list[int]:
    """Ranks (other than the sender, rank 0) that did not map the segment: they get gloo."""
    return [r for r in range(1, len(local)) if not local[r]]


REMOTE_GROUP_PREFIX = "shop_r1_bridge_remote"
"""Store prefix of the sub-group {trainer} + remote ranks (same store as the full group)."""


def remote_group(
    store: torch.distributed.Store,
    rank: int,
    local: Sequence[bool],
    timeout_s: float = 300.0,
) -> torch.distributed.ProcessGroup | None:
    """The gloo sub-group of rank 0 and the ranks without shared memory, or None when this
    rank is not in it (a local receiver) or nobody needs it (every receiver is local).

    Its ranks are renumbered in order: rank 0 stays 0, remote rank r becomes its index + 1.
    """
    remote = remote_ranks(local)
    if not remote or (rank != 0 and rank not in remote):
        return None
    sub_rank = 0 if rank == 0 else remote.index(rank) + 1
    return gloo_group_on(store, REMOTE_GROUP_PREFIX, sub_rank, len(remote) + 1, timeout_s)


def broadcast(group: torch.distributed.ProcessGroup, tensor: torch.Tensor, root: int = 0) -> None:
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = root
    group.broadcast([tensor], opts).wait()
