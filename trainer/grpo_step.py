"""One GRPO optimizer step on a leased batch: self-certainty -> advantages -> clipped loss.

Two passes over the micro-batches: a no-grad pass computes what the advantages need before
any loss can be formed (the self-certainty bonus from full-vocabulary logits) plus the
reference logprobs for the KL; the second pass computes the loss and accumulates gradients.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from trainer.batch import SeqItem, micro_batches, tree_micro_batches
from trainer.config import GrpoConfig
from trainer.distributed import Work
from trainer.forward import MicroBatch, prepare, stats_of
from trainer.loss import group_advantages, policy_loss, self_certainty, shift_aligned
from trainer.model import LoadedModel, Reference, autocast, vocab_size
from trainer.optim import clip_and_step


@dataclass
class StepContext:
    loaded: LoadedModel
    reference: Reference | None
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    cfg: GrpoConfig
    work: Work = field(default_factory=Work)
    """Which micro-batches this rank runs (all of them on one process; trainer/distributed.py)."""


def plan(ctx: StepContext, items: list[SeqItem]) -> list[MicroBatch]:
    """The step's micro-batches, each collated (and packed as a prefix tree) once for both
    passes: packed by ``micro_batch_tokens`` of tree tokens when the model runs the tree
    path (``packing: prefix_tree``), else padded rows by rows x longest."""
    lm, cfg = ctx.loaded, ctx.cfg
    if lm.tree_attention:
        parts = ctx.work.world_size
        groups = tree_micro_batches(items, cfg.micro_batch_tokens, cfg.min_shared_prefix, parts)
    else:
        groups = micro_batches(items, cfg.micro_batch_tokens)
    pad = lm.tokenizer.pad_token_id
    return [prepare(g, pad, lm.device, lm.tree_attention, cfg.min_shared_prefix) for g in groups]


@torch.no_grad()
def _scoring_pass(ctx: StepContext, mbs: list[MicroBatch], n_items: int):
    """Per-item self-certainty, reference logprobs per micro-batch this rank trains, and
    batch statistics (summed over ranks)."""
    lm, cfg = ctx.loaded, ctx.cfg
    certainty = torch.zeros(n_items)
    ref_lps: list[torch.Tensor | None] = []
    ent_sum = tok_sum = mismatch_sum = 0.0
    lm.model.eval()  # no dropout while measuring
    for mb, real in ctx.work.split(mbs):
        batch = mb.batch
        with autocast(lm.device, lm.compute_dtype):
            stats = stats_of(lm.model, mb, cfg.temperature)
        ref_lp = None
        if ctx.reference is not None and cfg.kl_beta > 0:
            with ctx.reference.model() as ref, autocast(lm.device, lm.compute_dtype):
                ref_lp = stats_of(ref, mb, cfg.temperature, with_entropy=False).logprobs
        if not real:  # a padding pass (other ranks have one more micro-batch)
            continue
        ref_lps.append(ref_lp)
        mask = shift_aligned(batch["mask"]).float()
        span = shift_aligned(batch["rationale"])
        sc = self_certainty(stats.entropy, span, vocab_size(lm.model))
        certainty[[i.index for i in mb.items]] = sc.cpu()
        ent_sum += float((stats.entropy * mask).sum())
        tok_sum += float(mask.sum())
        inf_lp = shift_aligned(batch["logprobs"])
        mismatch_sum += float(((stats.logprobs - inf_lp).abs() * mask).sum())
    lm.model.train()
    ctx.work.sum_tensor(certainty)  # each item is scored on exactly one rank
    sums = ctx.work.sum({"ent": ent_sum, "tok": tok_sum, "mismatch": mismatch_sum})
    tok = max(sums["tok"], 1.0)
    stats = {"entropy": sums["ent"] / tok, "logprob_mismatch": sums["mismatch"] / tok}
    return certainty, ref_lps, stats


def grpo_step(
    ctx: StepContext, items: list[SeqItem], extra_reward: torch.Tensor | None = None
) -> dict[str, float]:
    """Advantages, loss, backward over micro-batches, clip, optimizer step. Returns metrics.

    ``extra_reward`` (``[len(items)]``, e.g. the GAIL bonus of trainer/gail/) is added to
    the scores before the group advantages; ``extra_adv_shift`` reports how much it moved them.
    """
    t0 = time.monotonic()
    stats = accumulate(ctx, items, extra_reward)
    grad_norm = clip_and_step(ctx.loaded.model, ctx.optimizer, ctx.scheduler, ctx.cfg.max_grad_norm)
    lr = ctx.scheduler.get_last_lr()[0]
    return {**stats, "grad_norm": grad_norm, "lr": lr, "compute_s": time.monotonic() - t0}


def accumulate(
    ctx: StepContext, items: list[SeqItem], extra_reward: torch.Tensor | None = None
) -> dict[str, float]:
    """Both passes of :func:`grpo_step`: the gradients of the step's loss accumulate in the
    parameters' ``.grad`` (nothing is stepped). Returns the step's metrics."""
    lm, cfg = ctx.loaded, ctx.cfg
    mbs = plan(ctx, items)
    if not mbs:
        raise ValueError("batch has no trainable sequence (all too long or malformed)")
    certainty, ref_lps, scoring = _scoring_pass(ctx, mbs, len(items))
    scores = torch.tensor([i.score for i in items], dtype=torch.float64)  # exact group stats
    total = scores + cfg.self_certainty_alpha * certainty
    group_ids = torch.tensor([i.group for i in items])
    extra: dict[str, float] = {}
    if extra_reward is not None:
        base_adv = group_advantages(total, group_ids, cfg.adv_eps, cfg.scale_advantages)
        total = total + extra_reward.to(total.dtype).cpu()
    adv = group_advantages(total, group_ids, cfg.adv_eps, cfg.scale_advantages)
    if extra_reward is not None:
        extra["extra_adv_shift"] = float((adv - base_adv).abs().mean())
    trainable = [i for mb in mbs for i in mb.items]
    n_tokens = sum(sum(i.mask[1:]) for i in trainable)
    normaliser = float(n_tokens if cfg.loss_aggregation == "token" else len(trainable))
    sums = dict.fromkeys(("kl", "clipped", "ratio", "iw", "iw_truncated", "tokens"), 0.0)
    loss_total = 0.0
    mine = ctx.work.split(mbs)
    real_refs = iter(ref_lps)
    for mb, real in mine:
        ref_lp = next(real_refs) if real else None
        batch = mb.batch
        with autocast(lm.device, lm.compute_dtype):
            stats = stats_of(lm.model, mb, cfg.temperature, with_entropy=False)
        out = policy_loss(
            stats.logprobs,
            shift_aligned(batch["logprobs"]),
            adv[[i.index for i in mb.items]].to(lm.device),
            shift_aligned(batch["mask"]),
            normaliser=normaliser,
            clip_low=cfg.clip_low,
            clip_high=cfg.clip_high,
            tis_cap=cfg.tis_cap,
            ref_logprobs=ref_lp,
            kl_beta=cfg.kl_beta,
            aggregation=cfg.loss_aggregation,
        )
        if not real:  # same collectives as the other ranks, no contribution
            (out.loss * 0.0).backward()
            continue
        out.loss.backward()
        loss_total += float(out.loss.detach())
        for k, v in out.sums.items():
            sums[k] += v
    sums = ctx.work.sum({**sums, "loss": loss_total})
    loss_total = sums["loss"]
    tok = max(sums["tokens"], 1.0)
    return {
        "loss": loss_total,
        "score_mean": float(scores.mean()),
        "score_std": float(scores.std(unbiased=False)),
        "self_certainty": float(certainty.mean()),
        "advantage_abs_mean": float(adv.abs().mean()),
        "kl": sums["kl"] / tok,
        "clip_fraction": sums["clipped"] / tok,
        "ratio_mean": sums["ratio"] / tok,
        "iw_mean": sums["iw"] / tok,
        "iw_truncated_fraction": sums["iw_truncated"] / tok,
        "tokens": int(sums["tokens"]),
        "sequences": len(items),
        "sequences_trained": len(trainable),
        "micro_batches": len(mbs),
        "forward_tokens": sum(mb.forward_tokens for mb in mbs),
        "sequence_tokens": sum(len(i.tokens) for i in trainable),
        **scoring,
        **extra,
    }
