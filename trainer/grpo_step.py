"""One GRPO optimizer step on a leased batch: self-certainty -> advantages -> clipped loss.

The advantages need the self-certainty bonus (from full-vocabulary logits) of every sequence
of the step before any loss can be formed. When a rank runs one micro-batch (the whole step
fits ``micro_batch_tokens``), one forward with gradients gives both: its logits are scored
first (detached), then the loss is formed from them and backpropagated. With more micro-batches
a no-grad scoring pass over all of them comes first and the loss pass computes each again,
since holding every micro-batch's graph until the advantages are known would multiply the
activation memory. Either way the reference logprobs for the KL are computed while scoring.
The two orders give the same loss and gradients (tests/unit/trainer/test_fused_step.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from trainer.batch import EnvRows, SeqItem, micro_batches, tree_micro_batches, turns
from trainer.config import GrpoConfig
from trainer.distributed import Work
from trainer.forward import MicroBatch, prepare, stats_of
from trainer.loss import (
    TokenStats,
    group_advantages,
    mismatch_kl,
    self_certainty,
    shift_aligned,
)
from trainer.model import LoadedModel, Reference, autocast, vocab_size
from trainer.optim import clip_and_step
from trainer.policy_losses import LossInput, LossSettings, compute_loss


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


def fused(ctx: StepContext, mine: list[tuple[MicroBatch, bool]]) -> bool:
    """Whether the step scores the loss pass's own forward (one micro-batch on this rank, the
    same count on every rank) instead of a separate no-grad pass. Not with active dropout:
    the scoring pass measures without it (``model.eval()``), the loss pass trains with it."""
    return len(mine) == 1 and not has_dropout(ctx.loaded.model)


def has_dropout(model: torch.nn.Module) -> bool:
    """Any dropout that ``model.train()`` turns on: a dropout module or attention dropout."""
    if any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules()):
        return True
    return float(getattr(getattr(model, "config", None), "attention_dropout", 0.0) or 0.0) > 0


@torch.no_grad()
def _scoring_pass(
    ctx: StepContext,
    mine: list[tuple[MicroBatch, bool]],
    n_items: int,
    policy: TokenStats | None = None,
):
    """Per-item self-certainty, reference logprobs per micro-batch this rank trains, and
    batch statistics (summed over ranks). ``policy``: the stats of the one micro-batch from
    the loss pass's forward (a fused step), else each micro-batch's policy forward runs here.
    Sequences whose environment sent no inference logprobs get the trainer's own logprobs in
    their place here, before any update (on-policy: trainer/atropos_fields.py); they are left
    out of the mismatch statistics."""
    lm, cfg = ctx.loaded, ctx.cfg
    certainty = torch.zeros(n_items)
    ref_lps: list[torch.Tensor | None] = []
    sums = dict.fromkeys(("ent", "tok", "mismatch", "k1", "k3", "mis_tok", "recomputed"), 0.0)
    # The reference model runs unless every sequence of the step brought its own reference
    # logprobs (decided for the whole step: under FSDP every rank must run the same passes).
    model_ref = ctx.reference is not None and cfg.kl_beta > 0
    model_ref = model_ref and not all(
        i.ref_logprobs is not None for mb, _ in mine for i in mb.items
    )
    lm.model.eval()  # no dropout while measuring
    for mb, real in mine:
        batch = mb.batch
        if policy is not None:
            stats = TokenStats(policy.logprobs.detach(), policy.entropy.detach())
        else:
            with autocast(lm.device, lm.compute_dtype):
                stats = stats_of(lm.model, mb, cfg.temperature)
        ref_lp = None
        if model_ref:
            with ctx.reference.model() as ref, autocast(lm.device, lm.compute_dtype):
                ref_lp = stats_of(ref, mb, cfg.temperature, with_entropy=False).logprobs
        if not real:  # a padding pass (other ranks have one more micro-batch)
            continue
        if cfg.kl_beta > 0:
            ref_lp = _with_env_ref(ref_lp, mb.env)
        ref_lps.append(ref_lp)
        missing = mb.env.logprobs_missing
        if bool(missing.any()):  # never trained on placeholder zeros
            batch["logprobs"][missing, 1:] = stats.logprobs[missing].to(batch["logprobs"].dtype)
            sums["recomputed"] += float(missing.sum())
        mask = shift_aligned(batch["mask"]).float()
        span = shift_aligned(batch["rationale"])
        sc = self_certainty(stats.entropy, span, vocab_size(lm.model))
        certainty[[i.index for i in mb.items]] = sc.cpu()
        sums["ent"] += float((stats.entropy * mask).sum())
        sums["tok"] += float(mask.sum())
        inf_lp = shift_aligned(batch["logprobs"])
        measured = mask * (~missing).float().unsqueeze(-1)
        sums["mismatch"] += float(((stats.logprobs - inf_lp).abs() * measured).sum())
        mis = mismatch_kl(stats.logprobs, inf_lp, measured)
        sums["k1"] += mis["mismatch_k1"]
        sums["k3"] += mis["mismatch_k3"]
        sums["mis_tok"] += mis["mismatch_tokens"]
    lm.model.train()
    ctx.work.sum_tensor(certainty)  # each item is scored on exactly one rank
    sums = ctx.work.sum(sums)
    tok, mis_tok = max(sums["tok"], 1.0), max(sums["mis_tok"], 1.0)
    stats = {
        "entropy": sums["ent"] / tok,
        "logprob_mismatch": sums["mismatch"] / mis_tok,
        "mismatch_kl": sums["k3"] / mis_tok,
        "mismatch_kl_k1": sums["k1"] / mis_tok,
        "recomputed_logprob_sequences": int(sums["recomputed"]),
    }
    return certainty, ref_lps, stats


def _with_env_ref(ref_lp: torch.Tensor | None, rows: EnvRows) -> torch.Tensor:
    """The KL's reference per prediction: an environment's ``ref_logprobs`` where it sent
    them, the reference model's elsewhere (``kl_reference: env`` refuses groups without)."""
    has = rows.has_ref
    env = shift_aligned(rows.ref_logprobs)
    if ref_lp is None:
        if not bool(has.all()):
            raise ValueError("a sequence has no reference logprobs and no reference model runs")
        return env
    return torch.where(has.unsqueeze(-1), env.to(ref_lp.dtype), ref_lp)


def token_advantages(seq_adv: torch.Tensor, rows: EnvRows) -> torch.Tensor:
    """Per-prediction advantages of a micro-batch's rows: the group advantage of each row,
    replaced by the environment's own per-token advantages where it sent them (Atropos
    ``advantages``), and 0 for rows with ``set_advantage_to_zero``. ``[B]`` when neither
    applies (the same values, broadcast by the loss)."""
    has, zero = rows.has_advantages, rows.zero_advantage
    if not bool(has.any() or zero.any()):
        return seq_adv
    env = shift_aligned(rows.advantages).to(seq_adv.device)
    adv = seq_adv.unsqueeze(-1).expand_as(env)
    adv = torch.where(has.unsqueeze(-1), env, adv)
    return torch.where(zero.unsqueeze(-1), torch.zeros_like(adv), adv)


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
    mine = ctx.work.split(mbs)
    first = None  # the one micro-batch's forward, with gradients, when the step is fused
    if fused(ctx, mine):
        with autocast(lm.device, lm.compute_dtype):
            first = stats_of(lm.model, mine[0][0], cfg.temperature)
    certainty, ref_lps, scoring = _scoring_pass(ctx, mine, len(items), first)
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
    settings = LossSettings.from_config(cfg)
    normaliser = settings.step_normaliser(n_tokens, len(trainable))
    keys = ("kl", "clipped", "ratio", "iw", "iw_truncated", "tokens", "mismatch_masked")
    sums = dict.fromkeys(keys, 0.0)
    loss_total = 0.0
    real_refs = iter(ref_lps)
    for mb, real in mine:
        ref_lp = next(real_refs) if real else None
        batch = mb.batch
        if first is not None:
            stats = first
        else:
            with autocast(lm.device, lm.compute_dtype):
                stats = stats_of(lm.model, mb, cfg.temperature, with_entropy=False)
        inp = LossInput(
            stats.logprobs,
            shift_aligned(batch["logprobs"]),
            token_advantages(adv[[i.index for i in mb.items]].to(lm.device), mb.env),
            shift_aligned(batch["mask"]),
            normaliser,
            ref_lp,
        )
        out = compute_loss(inp, settings)
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
        "mismatch_masked_fraction": sums["mismatch_masked"] / tok,
        "env_advantage_sequences": sum(i.advantages is not None for i in items),
        "env_ref_sequences": sum(i.ref_logprobs is not None for i in items),
        "tokens": int(sums["tokens"]),
        "sequences": len(items),
        "sequences_trained": len(trainable),
        "over_max_seq_len": sum(not i.trainable for i in items),
        "turns_mean": sum(turns(i.mask) for i in items) / len(items),
        "micro_batches": len(mbs),
        "forward_tokens": sum(mb.forward_tokens for mb in mbs),
        "sequence_tokens": sum(len(i.tokens) for i in trainable),
        **scoring,
        **extra,
    }
