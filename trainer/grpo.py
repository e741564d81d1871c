"""GRPO: lease a batch -> step -> checkpoint -> sync weights -> report version -> ack -> log.

A batch is acked only once a checkpoint holds its update, and the checkpoint records the
batch and group ids it trained on: a crash before the ack makes the API lease the batch
again, and the resumed trainer recognises it and acks it without training it twice.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from trainer.batch import _field, flatten_groups
from trainer.config import GrpoConfig
from trainer.grpo_step import StepContext, grpo_step
from trainer.model import Reference
from trainer.run import Run, start_run

log = logging.getLogger(__name__)
RECENT_BATCHES = 64  # more than could ever be leased-but-unacked at once


def train(cfg: GrpoConfig) -> Run:
    from api.client import ApiClient  # after config parsing: keeps --help fast
    from trainer.bridge import make_bridge

    reference: list[Reference] = []  # of the start model: built before a resume loads weights
    build_ref = (lambda lm: reference.append(Reference(lm))) if cfg.kl_beta > 0 else None
    run = start_run(cfg, before_resume=build_ref)
    ctx = StepContext(run.loaded, reference[0] if reference else None, run.optimizer,
                      run.scheduler, cfg)  # fmt: skip
    api = ApiClient(cfg.api_url, token=cfg.api_token)
    bridge = make_bridge(cfg.weight_bridge_mode, cfg.inference_urls(),
                         **_bridge_kwargs(cfg, run.loaded.device.type))  # fmt: skip
    state, pending_acks = run.state, []
    try:
        if run.resumed_from is not None:  # inference may hold weights of a lost lineage
            bridge.sync(run.loaded.model, state.policy_version)
            api.set_policy_version(state.policy_version)
        while state.step < cfg.training_steps:
            t0 = time.monotonic()
            batch_id, leased = _lease(api, cfg)
            groups = _untrained(leased, state.recent_batches)
            if not groups:  # trained and checkpointed before a crash; only the ack was lost
                log.info("batch %s was already trained in this lineage; acking it", batch_id)
                api.ack(batch_id)
                continue
            t1 = time.monotonic()
            items, dropped = flatten_groups(groups, cfg.max_seq_len)
            if not any(i.trainable for i in items):  # retrying could never succeed
                log.warning("batch %s has no sequence within max_seq_len; acked untrained",
                            batch_id)  # fmt: skip
                api.ack(batch_id)
                continue
            stats = grpo_step(ctx, items)
            staleness = _staleness(state.policy_version, items)
            state.step += 1
            state.policy_version = state.step  # one optimizer step = one policy version
            _remember(state, batch_id, groups)
            pending_acks.append(batch_id)
            t2 = time.monotonic()
            if state.step % cfg.save_every == 0 or state.step == cfg.training_steps:
                run.checkpoint()
                for done in pending_acks:  # durable now: safe to let the API forget them
                    api.ack(done)
                pending_acks.clear()
            t3 = time.monotonic()
            bridge.sync(run.loaded.model, state.policy_version)
            api.set_policy_version(state.policy_version)
            t4 = time.monotonic()
            run.metrics.log(state.step, {
                **stats, **staleness, "policy_version": state.policy_version,
                "batch_id": batch_id, "dropped_sequences": dropped, "wait_s": t1 - t0,
                "step_s": t2 - t1, "checkpoint_s": t3 - t2, "sync_s": t4 - t3,
            })  # fmt: skip
            log.info("step %d loss %.4f score %.3f kl %.2e clip %.3f wait %.1fs sync %.1fs",
                     state.step, stats["loss"], stats["score_mean"], stats["kl"],
                     stats["clip_fraction"], t1 - t0, t4 - t3)  # fmt: skip
    finally:
        bridge.close()
        api.close()
        run.metrics.close()
    return run


def _lease(api: Any, cfg: GrpoConfig) -> tuple[str, list[Any]]:
    """Poll the API until it leases a batch; give up after ``wait_timeout`` seconds."""
    deadline = time.monotonic() + cfg.wait_timeout
    while True:
        lease = api.lease(max_tokens=cfg.max_batch_tokens, max_sequences=cfg.batch_size,
                          lease_seconds=cfg.lease_seconds)  # fmt: skip
        if lease is not None:
            return str(_field(lease, "batch_id")), list(_field(lease, "groups"))
        if time.monotonic() > deadline:
            raise TimeoutError(f"no batch from {cfg.api_url} for {cfg.wait_timeout:.0f}s")
        time.sleep(cfg.poll_interval)


def _untrained(groups: list[Any], recent: list[dict[str, Any]]) -> list[Any]:
    """The groups this lineage has not trained on (by group id, the idempotency key)."""
    seen = {gid for b in recent for gid in b["group_ids"]}
    return [g for g in groups if _field(g, "group_id") not in seen]


def _remember(state: Any, batch_id: str, groups: list[Any]) -> None:
    state.recent_batches.append(
        {"batch_id": batch_id, "group_ids": [str(_field(g, "group_id")) for g in groups]}
    )
    del state.recent_batches[:-RECENT_BATCHES]


def _staleness(current_version: int, items: list[Any]) -> dict[str, float]:
    """How many versions behind the trained weights the completions were sampled."""
    lags = [current_version - i.policy_version for i in items]
    return {"staleness_mean": sum(lags) / len(lags), "staleness_max": float(max(lags))}


def _bridge_kwargs(cfg: GrpoConfig, trainer_device: str) -> dict[str, Any]:
    device = trainer_device if cfg.inference_device == "auto" else cfg.inference_device
    return {
        "device": device,
        "single_copy": cfg.single_copy,
        "token": cfg.bridge_token,
        "restart_interval": cfg.vllm_restart_interval,
        "save_dir": f"{cfg.save_path}/bridge",
    }
