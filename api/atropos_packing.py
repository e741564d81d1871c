"""Atropos's batch packing, ported from ``atroposlib.api.utils`` (atroposlib 0.4.0).

The functions take group sizes (and env ids) instead of the groups themselves and return
indices, so the store can run them on its queue without loading payloads; otherwise they
follow atroposlib's code step by step (same passes, same tie-breaks, same failure cases).
``tests/integration/api/test_atropos_compat.py`` runs atroposlib's own functions on random
queues and checks that these pick the same groups.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class QueueItem:
    size: int
    """Sequences in the group (Atropos: ``len(group["tokens"])``)."""
    env_id: int | None
    """The ``env_id`` the group was posted with."""


@dataclass(frozen=True)
class EnvAllocation:
    registered_id: int
    connected: bool
    min_batch_allocation: float | None


def find_groups_summing_to_target(sizes: Sequence[int], target: int) -> list[int]:
    """Indices (FIFO order) of buffered groups whose sizes sum exactly to ``target``."""
    if not sizes:
        return []
    current, indices = 0, []
    for i, size in enumerate(sizes):  # first: plain FIFO
        if current + size <= target:
            indices.append(i)
            current += size
            if current == target:
                return indices
    if target < 0:
        return []
    n = len(sizes)  # then: subset-sum DP, backtracked preferring earlier indices
    dp = [[False] * (target + 1) for _ in range(n + 1)]
    dp[0][0] = True
    for i in range(1, n + 1):
        for j in range(target + 1):
            dp[i][j] = dp[i - 1][j] or (j >= sizes[i - 1] and dp[i - 1][j - sizes[i - 1]])
    if not dp[n][target]:
        return []
    indices, j = [], target
    for i in range(n, 0, -1):
        if j >= sizes[i - 1] and dp[i - 1][j - sizes[i - 1]]:
            indices.append(i - 1)
            j -= sizes[i - 1]
    return sorted(indices)


def grab_exact(sizes: Sequence[int], batch_size: int) -> list[int] | None:
    """``grab_exact_from_heterogeneous_queue``: indices of exactly ``batch_size`` sequences,
    made of "packs" (groups of one size adding up to the largest group size), or ``None``."""
    if not sizes or sum(sizes) < batch_size:
        return None
    max_size = max(sizes)
    storage: dict[int, list[int]] = {s: [] for s in set(sizes)}
    potential: list[int] = []
    for i, size in enumerate(sizes):
        storage[size].append(i)
        if len(storage[size]) * size == max_size:
            potential.extend(storage[size])
            storage[size].clear()
    if sum(sizes[i] for i in potential) < batch_size:
        return None
    chosen, running = [], 0
    for idx in potential:
        chosen.append(idx)
        running += sizes[idx]
        if running == batch_size:
            break
        if running > batch_size:
            return None
    return chosen if running == batch_size else None


def grab_with_min_allocations(
    queue: Sequence[QueueItem], batch_size: int, envs: Sequence[EnvAllocation]
) -> list[int] | None:
    """``grab_batch_with_minimum_allocations``: like :func:`grab_exact`, but first takes
    each connected env's ``min_batch_allocation`` share of the batch."""
    if not queue:
        return None
    mins = {
        e.registered_id: e.min_batch_allocation
        for e in envs
        if e.connected and e.min_batch_allocation is not None
    }
    if not mins:
        return grab_exact([q.size for q in queue], batch_size)
    max_size = max(q.size for q in queue)
    by_env: dict[int, dict[int, list[tuple[int, int]]]] = {}
    packable: dict[int, list[tuple[int, int]]] = {}
    for i, q in enumerate(queue):
        if q.env_id is None:
            continue
        sizes = by_env.setdefault(q.env_id, {})
        packable.setdefault(q.env_id, [])
        same = sizes.setdefault(q.size, [])
        same.append((i, q.size))
        if len(same) * q.size == max_size:
            packable[q.env_id].extend(same)
            sizes[q.size] = []
    min_seqs: dict[int, int] = {}
    total_min = 0
    for env_id, share in mins.items():
        need = int(batch_size * share)
        if need > 0:
            if env_id not in by_env or not packable.get(env_id):
                return None
            min_seqs[env_id] = need
            total_min += need
    if total_min > batch_size:
        scale = batch_size / total_min
        for env_id in min_seqs:
            if packable.get(env_id):
                smallest = min(size for _, size in packable[env_id])
                min_seqs[env_id] = max(smallest, int(min_seqs[env_id] * scale))
    chosen: list[int] = []
    taken = {env_id: 0 for env_id in packable}
    total = 0
    for env_id, need in min_seqs.items():
        for idx, size in packable.get(env_id, []):
            if taken[env_id] >= need:
                break
            if total + size <= batch_size:
                chosen.append(idx)
                taken[env_id] += size
                total += size
    if total < batch_size:
        packable_idx = {idx for items in packable.values() for idx, _ in items}
        for i, q in enumerate(queue):
            if i in chosen or i not in packable_idx:
                continue
            if total + q.size <= batch_size:
                chosen.append(i)
                total += q.size
            if total == batch_size:
                break
    return chosen if total == batch_size else None


def form_batches(
    queue: Sequence[QueueItem], batch_size: int, envs: Sequence[EnvAllocation]
) -> list[list[int]]:
    """What one Atropos ``GET /batch`` with an empty backlog forms: every batch the queue
    allows, in order (indices into ``queue``). Atropos uses the min-allocation packer as
    soon as any registered env, connected or not, has a ``min_batch_allocation``."""
    with_mins = any(e.min_batch_allocation is not None for e in envs)
    remaining = list(range(len(queue)))
    batches: list[list[int]] = []
    while True:
        items = [queue[i] for i in remaining]
        if with_mins:
            picked = grab_with_min_allocations(items, batch_size, envs)
        else:
            picked = grab_exact([q.size for q in items], batch_size)
        if picked is None:
            return batches
        batches.append([remaining[i] for i in picked])
        gone = set(picked)
        remaining = [r for k, r in enumerate(remaining) if k not in gone]
