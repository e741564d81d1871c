"""Where the GRPO trainer's batches come from: leasing from the API, on every rank.

Rank 0 (or the only process) leases until a batch holds something to train and hands it to
the other ranks. A batch the checkpoint already trained (a crash lost its ack: the API leased
it again) is recognised by its group ids (:func:`untrained`, :func:`remember`) and acked
without training it twice; groups the trainer cannot train as sent are refused at the API
with their reason (trainer/atropos_fields.py). While it waits for data the trainer re-syncs
an inference server that restarted (trainer/weight_sync.py).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from api.protocol import ScoredGroup
from trainer.atropos_fields import refuse
from trainer.batch import flatten_groups
from trainer.config import GrpoConfig

if TYPE_CHECKING:
    from trainer.run import Run
    from trainer.weight_sync import WeightSync

log = logging.getLogger(__name__)
RECENT_BATCHES = 64  # more than could ever be leased-but-unacked at once


def next_batch(run: Run, api: Any, weights: WeightSync | None) -> tuple[str, list[ScoredGroup]]:
    """The next batch to train, on every rank: rank 0 (or the only process) leases until a
    batch holds something to train, then hands it to the other ranks, which wait for it."""
    d = run.dist
    if not run.is_main:
        got = d.broadcast()
        if got is None:
            raise SystemExit("error: rank 0 stopped (its log, trainer.log, says why)")
        return got
    try:
        got = lease_trainable(api, run.cfg, weights, run.state)
    except BaseException:
        if d is not None:  # the other ranks must not wait for a batch that never comes
            d.broadcast(None)
        raise
    if d is not None:
        d.broadcast(got)
    return got


def lease_trainable(
    api: Any, cfg: GrpoConfig, weights: Any, state: Any
) -> tuple[str, list[ScoredGroup]]:
    """Lease until a batch has a sequence to train; ack the ones that have none. Groups the
    trainer cannot train as sent (trainer/atropos_fields.py) are refused at the API with
    their reason and left out; the rest of the batch trains."""
    while True:
        batch_id, leased = lease(api, cfg, weights, state.policy_version)
        groups = untrained(leased, state.recent_batches)
        groups = refuse(api, cfg, batch_id, groups)
        if not groups:  # trained and checkpointed before a crash (or refused): nothing to do
            log.info("batch %s has nothing left to train; acking it", batch_id)
            api.ack(batch_id)
            continue
        items, _ = flatten_groups(groups, cfg.max_seq_len)
        if not any(i.trainable for i in items):  # retrying could never succeed
            log.warning("batch %s has no sequence within max_seq_len; acked untrained", batch_id)
            api.ack(batch_id)
            continue
        return batch_id, groups


def ack_checkpointed(api: Any, recent: list[dict[str, Any]]) -> None:
    """Ack the batches the checkpoint trained (idempotent): one whose ack the crash lost
    would otherwise sit leased until its lease expires, and might go stale meanwhile."""
    from api.client import ApiError

    for b in recent:
        try:
            api.ack(b["batch_id"])
        except ApiError as e:
            if e.status_code != 404:  # 404: the API no longer knows it (a reset database)
                raise


def lease(
    api: Any, cfg: GrpoConfig, weights: WeightSync, version: int
) -> tuple[str, list[ScoredGroup]]:
    """Poll the API until it leases a batch; give up after ``wait_timeout`` seconds.

    A lease that failed transiently (``ApiError.transient``: e.g. the API died mid-request,
    which the client does not replay) is retried under ``api.retry`` within the same
    ``wait_timeout``. While waiting, re-sync an inference server that restarted (its
    rollouts would be stale).
    """
    from api.client import ApiError
    from api.retry import RetryPolicy, retry_call

    def once() -> Any:
        return api.lease(
            max_tokens=cfg.max_batch_tokens,
            max_sequences=cfg.batch_size,
            lease_seconds=cfg.lease_seconds,
        )

    def waitable(e: BaseException) -> bool:
        return isinstance(e, ApiError) and e.transient

    deadline = time.monotonic() + cfg.wait_timeout
    while True:
        policy = RetryPolicy(deadline_s=max(0.0, deadline - time.monotonic()))
        got = retry_call(once, "lease", waitable, policy, logger=log)
        if got is not None:
            return got.batch_id, list(got.groups)
        weights.resync_if_restarted(version)
        if time.monotonic() > deadline:
            raise TimeoutError(f"no batch from {cfg.api_url} for {cfg.wait_timeout:.0f}s")
        time.sleep(cfg.poll_interval)


def untrained(groups: list[ScoredGroup], recent: list[dict[str, Any]]) -> list[ScoredGroup]:
    """The groups this lineage has not trained on (by group id, the idempotency key)."""
    seen = {gid for b in recent for gid in b["group_ids"]}
    return [g for g in groups if g.group_id not in seen]


def remember(state: Any, batch_id: str, groups: list[ScoredGroup]) -> None:
    """Record that this lineage trained ``groups`` (the checkpoint keeps the last few)."""
    state.recent_batches.append({"batch_id": batch_id, "group_ids": [g.group_id for g in groups]})
    del state.recent_batches[:-RECENT_BATCHES]
