"""GRPO: lease a batch -> step -> checkpoint -> sync weights -> report version -> ack -> log.

A batch whose gradient is not finite is not trained: no step, no new version, no sync; the API
marks it ``skipped`` (not acked) and ``skipped_updates`` counts it (see ``_skipped``).

A batch is acked only once a checkpoint holds its update, and the checkpoint records the
batch and group ids it trained on: a crash before the ack makes the API lease the batch
again, and the resumed trainer recognises it and acks it without training it twice (and a
resumed trainer acks its checkpoint's batches at once, so they do not wait for the lease).

Restarts of the other services (docs/FAULT_TOLERANCE.md): API calls retry for
``reconnect_timeout`` seconds; a weight sync that fails because an inference server is down
or restarted is retried until it is back (both under the one retry policy, ``api.retry``);
and while waiting for data the trainer watches the servers' ``run_id``: a restarted server
serves the start weights (labelled with its initial version, so its rollouts are dropped as
stale), so it is re-synced at once -- otherwise the trainer could wait forever for fresh
rollouts that only a sync would bring.
"""

from __future__ import annotations

import logging
import math
import os
import time
from pathlib import Path
from typing import Any

import torch

from api.protocol import ScoredGroup
from trainer.atropos_fields import refuse
from trainer.batch import flatten_groups
from trainer.checkpoint import CheckpointWriteError
from trainer.config import GrpoConfig
from trainer.dist_weights import SyncReplica, make_replica
from trainer.distributed import Dist, Work, launched_by_torchrun
from trainer.gail import build_gail_reward
from trainer.grpo_step import StepContext, grpo_step
from trainer.model import LoadedModel, Reference
from trainer.rollout_log import RolloutLog, batch_format_rate
from trainer.run import Run, release_freed_memory, start_run

log = logging.getLogger(__name__)
RECENT_BATCHES = 64  # more than could ever be leased-but-unacked at once


def train(cfg: GrpoConfig) -> Run:
    from api.client import ApiClient  # after config parsing: keeps --help fast
    from trainer.bridge import bridge_for

    if cfg.gail.use and launched_by_torchrun():
        raise SystemExit(
            "error: GAIL (--gail.use) runs in a single trainer process only; "
            "launch without torchrun"
        )
    reference: list[Reference] = []  # of the start model: built before a resume loads weights
    replica: list[torch.nn.Module | None] = []  # rank 0's unsharded copy (trainer/dist_weights)

    def prepare(lm: LoadedModel, d: Dist | None) -> None:
        if cfg.kl_beta > 0 and cfg.kl_reference == "model":
            reference.append(Reference(lm))
        replica.append(make_replica(lm.model, d))

    run = start_run(cfg, before_resume=prepare)
    d, main = run.dist, run.is_main
    ref = reference[0] if reference else None
    if d is not None and ref is not None:
        ref.shard(d)
    ctx = StepContext(run.loaded, ref, run.optimizer, run.scheduler, cfg, Work.of(d))
    gail = build_gail_reward(cfg.gail, run)  # None unless GAIL is on (docs/GAIL.md)
    gathered = (
        None if d is None else SyncReplica(run.loaded.model, replica[0], d, run.loaded.is_lora)
    )
    api = bridge = weights = None
    if main:  # only rank 0 talks to the API and the inference servers
        api = ApiClient(cfg.api_url, token=cfg.api_token, give_up_s=cfg.reconnect_timeout)
        bridge = _retrying(
            cfg,
            "connect to the inference servers",
            lambda: bridge_for(
                cfg.weights,
                cfg.inference_urls(),
                **_bridge_kwargs(cfg, str(run.loaded.device), sharded=d is not None),
            ),
        )
        weights = WeightSync(bridge, replica[0] or run.loaded.model, cfg)
    rollouts = None
    if main:
        rollouts = RolloutLog(
            Path(cfg.save_path) / "rollouts.jsonl",
            cfg.rollout_samples,
            run.loaded.tokenizer,
            run.metrics,
            cfg.seed,
        )
    state, pending_acks = run.state, []
    try:
        if run.resumed_from is not None:  # inference may hold weights of a lost lineage
            if gathered is not None:
                gathered.gather()
            if main:
                _ack_checkpointed(api, state.recent_batches)
                weights.sync(state.policy_version)
                api.set_policy_version(state.policy_version)
        while state.step < cfg.training_steps:
            t0 = time.monotonic()
            batch_id, groups = _next_batch(run, api, weights)
            t1 = time.monotonic()
            items, dropped = flatten_groups(groups, cfg.max_seq_len)
            bonus, gail_stats = gail(groups, items) if gail is not None else (None, {})
            stats = {**grpo_step(ctx, items, extra_reward=bonus), **gail_stats}
            release_freed_memory()
            staleness = _staleness(state.policy_version, items)
            if not math.isfinite(stats["grad_norm"]):  # the update was skipped: say so
                _skipped(api, run, batch_id, groups, {**stats, **staleness})
                continue
            state.step += 1
            state.policy_version = state.step  # one optimizer step = one policy version
            _remember(state, batch_id, groups)
            pending_acks.append(batch_id)
            t2 = time.monotonic()
            if state.step % cfg.save_every == 0 or state.step == cfg.training_steps:
                try:
                    run.checkpoint()  # every rank: its shards (trainer/dist_checkpoint.py)
                except CheckpointWriteError as e:  # a full disk: exit loudly, ack nothing
                    raise CheckpointWriteError(
                        f"{e} None of the {len(pending_acks)} batch(es) trained since the last "
                        f"checkpoint was acked ({', '.join(pending_acks)}): each is leased "
                        f"again once its lease expires (--lease-seconds {cfg.lease_seconds:g})."
                    ) from e
                for done in pending_acks if main else []:  # durable now: the API may forget
                    api.ack(done)
                pending_acks.clear()
            t3 = time.monotonic()
            gather_s = gathered.gather() if gathered is not None else 0.0
            if not main:
                continue
            weights.sync(state.policy_version)
            api.set_policy_version(state.policy_version)
            t4 = time.monotonic()
            run.metrics.log(
                state.step,
                {
                    **stats,
                    **staleness,
                    **batch_format_rate(groups),
                    "policy_version": state.policy_version,
                    "batch_id": batch_id,
                    "dropped_sequences": dropped,
                    "wait_s": t1 - t0,
                    "step_s": t2 - t1,
                    "checkpoint_s": t3 - t2,
                    "sync_s": t4 - t3,
                    "skipped_updates": state.skipped_updates,
                    **({"gather_s": gather_s} if d is not None else {}),
                },
            )
            rollouts.record(state.step, groups)
            log.info(
                "step %d loss %.4f score %.3f kl %.2e clip %.3f wait %.1fs sync %.1fs",
                state.step,
                stats["loss"],
                stats["score_mean"],
                stats["kl"],
                stats["clip_fraction"],
                t1 - t0,
                t4 - t3,
            )
    finally:
        if bridge is not None:
            bridge.close()
        if api is not None:
            api.close()
        run.metrics.close()
    return run


def _next_batch(run: Run, api: Any, weights: WeightSync | None) -> tuple[str, list[ScoredGroup]]:
    """The next batch to train, on every rank: rank 0 (or the only process) leases until a
    batch holds something to train, then hands it to the other ranks, which wait for it."""
    d = run.dist
    if not run.is_main:
        got = d.broadcast()
        if got is None:
            raise SystemExit("error: rank 0 stopped (its log, trainer.log, says why)")
        return got
    try:
        got = _lease_trainable(api, run.cfg, weights, run.state)
    except BaseException:
        if d is not None:  # the other ranks must not wait for a batch that never comes
            d.broadcast(None)
        raise
    if d is not None:
        d.broadcast(got)
    return got


def _lease_trainable(
    api: Any, cfg: GrpoConfig, weights: Any, state: Any
) -> tuple[str, list[ScoredGroup]]:
    """Lease until a batch has a sequence to train; ack the ones that have none. Groups the
    trainer cannot train as sent (trainer/atropos_fields.py) are refused at the API with
    their reason and left out; the rest of the batch trains."""
    while True:
        batch_id, leased = _lease(api, cfg, weights, state.policy_version)
        groups = _untrained(leased, state.recent_batches)
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


class WeightSync:
    """``bridge.sync`` that survives inference-server restarts (see the module docstring).

    Which run of each server holds our weights is the bridge's record (``bridge.runs``,
    trainer/bridge/runs.py): every bridge keeps it current as it syncs; this class only asks
    it."""

    def __init__(self, bridge: Any, model: Any, cfg: GrpoConfig) -> None:
        self.bridge, self.model, self.cfg = bridge, model, cfg
        self.runs = bridge.runs
        if self.runs.ids is None:  # the servers that hold our weights (now: the start weights)
            try:
                self.runs.record(self.runs.current())
            except Exception:  # noqa: BLE001 - down already: re-synced once back
                pass

    def sync(self, version: int) -> Any:
        """Sync ``version``; a failure while a server is down or restarted is retried (with
        backoff, each retry logged) until it is back, for at most ``reconnect_timeout``."""
        from api.retry import RetryPolicy, retry_call

        before = self.runs.ids

        def attempt() -> Any:
            nonlocal before
            before = self.runs.ids
            return self.bridge.sync(self.model, version)

        policy = RetryPolicy(deadline_s=self.cfg.reconnect_timeout)
        what = f"weight sync of version {version} (is the inference server down or restarted?)"
        return retry_call(attempt, what, lambda e: self._restarted(before, e), policy, logger=log)

    def _restarted(self, before: list[str] | None, error: BaseException) -> bool:
        """Is ``error`` explained by a server being unreachable or restarted since ``before``?
        (Anything else -- a wrong token, a shape mismatch, a server's 500 -- is raised at
        once.) Unreachable: a transport failure that the one transient rule accepts
        (``api.retry.is_transient``; a whole sync is safe to repeat). A phase that missed its
        deadline (``SyncTimeout``: a server that hangs, not one that is down) is never
        retried: the trainer stops and says which phase of which server."""
        import httpx

        from api.retry import is_transient
        from trainer.bridge.deadline import SyncTimeout

        if isinstance(error, SyncTimeout):
            return False
        if isinstance(error, httpx.TransportError) and is_transient(error):
            return True
        try:
            return self.runs.current() != before
        except Exception:  # noqa: BLE001 - unreachable now: down
            return True

    def resync_if_restarted(self, version: int) -> None:
        """A server restarted since our last sync serves the start weights: sync it now."""
        try:
            restarted = self.runs.restarted()
        except Exception as e:  # noqa: BLE001 - down: the next poll or sync sees it come back
            log.warning(
                "inference server unreachable (%s); will re-sync when it is back", type(e).__name__
            )
            return
        if restarted:
            log.warning("inference server restarted (new run_id): re-syncing version %d", version)
            self.sync(version)


def _retrying(cfg: GrpoConfig, what: str, fn: Any) -> Any:
    """``fn()`` (idempotent) retried on transient failures (``api.retry.is_transient``) for
    up to ``reconnect_timeout`` seconds."""
    from api.retry import RetryPolicy, is_transient, retry_call

    return retry_call(
        fn, what, is_transient, RetryPolicy(deadline_s=cfg.reconnect_timeout), logger=log
    )


def _ack_checkpointed(api: Any, recent: list[dict[str, Any]]) -> None:
    """Ack the batches the checkpoint trained (idempotent): one whose ack the crash lost
    would otherwise sit leased until its lease expires, and might go stale meanwhile."""
    from api.client import ApiError

    for b in recent:
        try:
            api.ack(b["batch_id"])
        except ApiError as e:
            if e.status_code != 404:  # 404: the API no longer knows it (a reset database)
                raise


def _lease(
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

    def lease() -> Any:
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
        got = retry_call(lease, "lease", waitable, policy, logger=log)
        if got is not None:
            return got.batch_id, list(got.groups)
        weights.resync_if_restarted(version)
        if time.monotonic() > deadline:
            raise TimeoutError(f"no batch from {cfg.api_url} for {cfg.wait_timeout:.0f}s")
        time.sleep(cfg.poll_interval)


def _untrained(groups: list[ScoredGroup], recent: list[dict[str, Any]]) -> list[ScoredGroup]:
    """The groups this lineage has not trained on (by group id, the idempotency key)."""
    seen = {gid for b in recent for gid in b["group_ids"]}
    return [g for g in groups if g.group_id not in seen]


def _remember(state: Any, batch_id: str, groups: list[ScoredGroup]) -> None:
    state.recent_batches.append({"batch_id": batch_id, "group_ids": [g.group_id for g in groups]})
    del state.recent_batches[:-RECENT_BATCHES]


def _skipped(
    api: Any, run: Run, batch_id: str, groups: list[ScoredGroup], stats: dict[str, Any]
) -> None:
    """A batch whose gradient was not finite: the optimizer did not step (trainer/optim.py),
    so nothing is counted as trained. The step counter, the policy version, the checkpoint
    lineage and the inference weights stay as they are (no sync for nothing), the API marks
    the batch ``skipped`` (never acked as trained, never served again: the same weights would
    skip it again), and the skip is counted in ``skipped_updates`` and logged with its ids."""
    state = run.state
    state.skipped_updates += 1
    if not run.is_main:  # every rank saw the same reduced norm; rank 0 tells the API
        return
    api.skip(batch_id)
    group_ids = [g.group_id for g in groups]
    run.metrics.log(
        state.step,
        {
            **stats,
            "skipped_update": True,
            "batch_id": batch_id,
            "group_ids": group_ids,
            "policy_version": state.policy_version,
            "skipped_updates": state.skipped_updates,
        },
    )
    log.warning(
        "batch %s: non-finite gradient (norm %s, loss %s); update skipped, batch marked "
        "skipped at the API, version stays %d (%d skipped so far)",
        batch_id,
        stats["grad_norm"],
        stats["loss"],
        state.policy_version,
        state.skipped_updates,
    )


def _staleness(current_version: int, items: list[Any]) -> dict[str, float]:
    """How many versions behind the trained weights the completions were sampled."""
    lags = [current_version - i.policy_version for i in items]
    return {"staleness_mean": sum(lags) / len(lags), "staleness_max": float(max(lags))}


def _bridge_kwargs(cfg: GrpoConfig, trainer_device: str, sharded: bool = False) -> dict[str, Any]:
    """``trainer_device``: the trainer's torch device (``cpu``, ``cuda:N``)."""
    own = trainer_device.split(":")[0]
    device = own if cfg.inference_device == "auto" else cfg.inference_device
    extra = {"trainer_device": trainer_device} if device == "cuda" else {}
    kwargs: dict[str, Any] = {
        **extra,
        "device": device,
        "token": cfg.bridge_token,
        "save_dir": f"{cfg.save_path}/bridge",
        "deadlines": cfg.sync_deadline,
    }
    if sharded and cfg.weights.type == "broadcast":
        # Under torchrun MASTER_ADDR/MASTER_PORT are the trainer's own rendezvous: the
        # broadcast group takes a free port on rank 0's host, reached at MASTER_ADDR when the
        # trainer spans nodes (rank 0 runs on node 0, the rendezvous host).
        one_node = os.environ.get("WORLD_SIZE") == os.environ.get("LOCAL_WORLD_SIZE")
        kwargs["master_port"] = None
        kwargs["master_address"] = "127.0.0.1" if one_node else os.environ["MASTER_ADDR"]
    return kwargs
