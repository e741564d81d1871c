"""GRPO: lease a batch -> step -> checkpoint -> ack -> sync weights -> report version -> log.

:func:`train` is that loop, one named phase per line: where batches come from is
trainer/leasing.py, the weight sync that survives server restarts trainer/weight_sync.py,
one optimizer step trainer/grpo_step.py.

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
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from api.protocol import ScoredGroup
from procutil.faults import fault_point
from trainer.batch import flatten_groups
from trainer.checkpoint import CheckpointWriteError
from trainer.config import GrpoConfig
from trainer.dist_weights import SyncReplica, make_replica
from trainer.distributed import Dist, Work, launched_by_torchrun
from trainer.gail import build_gail_reward
from trainer.grpo_step import StepContext, grpo_step
from trainer.leasing import ack_checkpointed, next_batch, remember
from trainer.model import LoadedModel, Reference
from trainer.rollout_log import RolloutLog, batch_format_rate
from trainer.run import Run, release_freed_memory, start_run
from trainer.weight_sync import WeightSync, connect_bridge

log = logging.getLogger(__name__)


def train(cfg: GrpoConfig) -> Run:
    """Train ``cfg.training_steps`` GRPO steps on leased batches (the module docstring)."""
    if cfg.gail.use and launched_by_torchrun():
        raise SystemExit(
            "error: GAIL (--gail.use) runs in a single trainer process only; "
            "launch without torchrun"
        )
    loop = Loop.start(cfg)
    run, state = loop.run, loop.run.state
    try:
        if run.resumed_from is not None:  # inference may hold weights of a lost lineage
            loop.publish(acks=state.recent_batches)
        while state.step < cfg.training_steps:
            times: dict[str, float] = {}
            with timed(times, "wait_s"):
                batch_id, groups = next_batch(run, loop.api, loop.weights)
            with timed(times, "step_s"):
                stats = loop.step(groups)
            if not math.isfinite(stats["grad_norm"]):  # the update was skipped: say so
                _skipped(loop.api, run, batch_id, groups, stats)
                continue
            with timed(times, "checkpoint_s"):
                loop.commit(batch_id, groups)
            with timed(times, "sync_s"):
                loop.publish()
            if run.is_main:
                loop.report(batch_id, groups, {**stats, **times})
    finally:
        loop.close()
    return run


@contextmanager
def timed(times: dict[str, float], name: str) -> Iterator[None]:
    """``times[name]``: the wall seconds the ``with`` block took."""
    t0 = time.monotonic()
    try:
        yield
    finally:
        times[name] = time.monotonic() - t0


@dataclass
class Loop:
    """One GRPO run's parts: the model, optimizer and state (``run``), one step's inputs
    (``ctx``) and, on rank 0 only, the API, the inference servers' bridge and the rollout
    log (None on the other ranks)."""

    run: Run
    ctx: StepContext
    gail: Any = None
    gathered: SyncReplica | None = None
    api: Any = None
    bridge: Any = None
    weights: WeightSync | None = None
    rollouts: RolloutLog | None = None
    pending_acks: list[str] = field(default_factory=list)
    gather_s: float = 0.0

    @classmethod
    def start(cls, cfg: GrpoConfig) -> Loop:
        """Load (or resume) the model, then connect rank 0 to the API and the servers."""
        from api.client import ApiClient  # after config parsing: keeps --help fast

        reference: list[Reference] = []  # of the start model: built before a resume loads
        replica: list[torch.nn.Module | None] = []  # rank 0's unsharded copy (dist_weights)

        def prepare(lm: LoadedModel, d: Dist | None) -> None:
            if cfg.kl_beta > 0 and cfg.kl_reference == "model":
                reference.append(Reference(lm))
            replica.append(make_replica(lm.model, d))

        run = start_run(cfg, before_resume=prepare)
        d, lm = run.dist, run.loaded
        ref = reference[0] if reference else None
        if d is not None and ref is not None:
            ref.shard(d)
        loop = cls(run, StepContext(lm, ref, run.optimizer, run.scheduler, cfg, Work.of(d)))
        loop.gail = build_gail_reward(cfg.gail, run)  # None unless GAIL is on (docs/GAIL.md)
        if d is not None:
            loop.gathered = SyncReplica(lm.model, replica[0], d, lm.is_lora)
        if run.is_main:  # only rank 0 talks to the API and the inference servers
            loop.api = ApiClient(cfg.api_url, token=cfg.api_token, give_up_s=cfg.reconnect_timeout)
            loop.bridge = connect_bridge(cfg, str(lm.device), sharded=d is not None)
            loop.weights = WeightSync(loop.bridge, replica[0] or lm.model, cfg)
            log_path = Path(cfg.save_path) / "rollouts.jsonl"
            loop.rollouts = RolloutLog(
                log_path, cfg.rollout_samples, lm.tokenizer, run.metrics, cfg.seed
            )
        return loop

    def step(self, groups: list[ScoredGroup]) -> dict[str, Any]:
        """One optimizer step on ``groups`` (every rank); its statistics."""
        cfg, state = self.ctx.cfg, self.run.state
        items, dropped = flatten_groups(groups, cfg.max_seq_len)
        bonus, gail_stats = self.gail(groups, items) if self.gail is not None else (None, {})
        stats = {**grpo_step(self.ctx, items, extra_reward=bonus), **gail_stats}
        release_freed_memory()
        return {**stats, **_staleness(state.policy_version, items), "dropped_sequences": dropped}

    def commit(self, batch_id: str, groups: list[ScoredGroup]) -> None:
        """Count the step (one optimizer step = one policy version), remember what it
        trained, and checkpoint when due; then ack every batch the checkpoint holds."""
        run, cfg, state = self.run, self.ctx.cfg, self.run.state
        state.step += 1
        state.policy_version = state.step
        remember(state, batch_id, groups)
        self.pending_acks.append(batch_id)
        if state.step % cfg.save_every and state.step != cfg.training_steps:
            return
        try:
            run.checkpoint()  # every rank: its shards (trainer/dist_checkpoint.py)
        except CheckpointWriteError as e:  # a full disk: exit loudly, ack nothing
            raise CheckpointWriteError(
                f"{e} None of the {len(self.pending_acks)} batch(es) trained since the last "
                f"checkpoint was acked ({', '.join(self.pending_acks)}): each is leased "
                f"again once its lease expires (--lease-seconds {cfg.lease_seconds:g})."
            ) from e
        for done in self.pending_acks if run.is_main else []:  # durable: the API may forget
            self.api.ack(done)
        self.pending_acks.clear()
        fault_point("checkpointed")  # test-only (procutil/faults.py): unset, nothing

    def publish(self, acks: list[dict[str, Any]] | None = None) -> None:
        """Serve the current weights: gather the shards (every rank), then rank 0 syncs the
        inference servers and tells the API the new policy version. After a resume, ``acks``
        are the checkpoint's batches, acked first (idempotent: a crash may have lost them)."""
        state = self.run.state
        if self.gathered is not None:
            self.gather_s = self.gathered.gather()
        if not self.run.is_main:
            return
        if acks is not None:
            ack_checkpointed(self.api, acks)
        self.weights.sync(state.policy_version)
        self.api.set_policy_version(state.policy_version)

    def report(self, batch_id: str, groups: list[ScoredGroup], stats: dict[str, Any]) -> None:
        """The step's metrics line, its sampled rollouts and its log line (rank 0)."""
        state = self.run.state
        gathered = {} if self.gathered is None else {"gather_s": self.gather_s}
        self.run.metrics.log(
            state.step,
            {
                **stats,
                **batch_format_rate(groups),
                **gathered,
                "policy_version": state.policy_version,
                "batch_id": batch_id,
                "skipped_updates": state.skipped_updates,
            },
        )
        self.rollouts.record(state.step, groups)
        log.info(
            "step %d loss %.4f score %.3f kl %.2e clip %.3f wait %.1fs sync %.1fs",
            state.step,
            stats["loss"],
            stats["score_mean"],
            stats["kl"],
            stats["clip_fraction"],
            stats["wait_s"],
            stats["sync_s"],
        )

    def close(self) -> None:
        if self.bridge is not None:
            self.bridge.close()
        if self.api is not None:
            self.api.close()
        self.run.metrics.close()


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
