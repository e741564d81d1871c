"""GRPO maths: token statistics, advantages, self-certainty, the policy losses (PPO clip,
GSPO, CISPO; truncated / masked importance weights), k1/k2/k3 KL and the mismatch metric.

Everything here is a pure function of tensors, runs on CPU (fp32) and CUDA (bf16 autocast
upstream; every reduction here is done in fp32), and has no knowledge of the data source.

Alignment convention: a sequence of ``L`` tokens gives ``L - 1`` predictions; position ``t``
of every per-token tensor below refers to the prediction of ``tokens[t + 1]`` from the logits
at ``t``. Callers shift masks/logprobs with :func:`shift_aligned`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

Aggregation = Literal["token", "sequence"]

LOG_RATIO_BOUND = 20.0
"""Bound on every log importance ratio before ``exp`` (verl's bound, too): e^20 ~ 4.9e8 is far
outside any clip range, so an ordinary token never reaches it, and stays finite in fp32
(times an advantage of 1e3 and 1e6 tokens it is still ~1e-21 of fp32's maximum). A token
beyond it -- e.g. one whose inference logprob was the -1e4 that env_server/inference.py puts
for -inf -- gets a finite loss term and no gradient (``clamp`` passes none), instead of
exp overflowing to inf: an inf loss (A < 0) or a NaN gradient (A > 0, 0 * inf)."""


def _safe_exp(log_ratio: torch.Tensor) -> torch.Tensor:
    """``exp`` of a log ratio clamped to +-LOG_RATIO_BOUND (finite value, finite gradient)."""
    return torch.exp(log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))


def shift_aligned(x: torch.Tensor) -> torch.Tensor:
    """Per-token data aligned to ``tokens`` (``[B, L]``) -> aligned to predictions (``[B, L-1]``)."""
    return x[:, 1:]


@dataclass
class TokenStats:
    """Per-prediction statistics of the temperature-scaled policy, all ``[B, L-1]`` fp32."""

    logprobs: torch.Tensor
    """log p(token_{t+1} | prefix) under softmax(logits / temperature)."""
    entropy: torch.Tensor
    """Entropy H(p_t) of the full-vocabulary distribution at position t (nats)."""


def token_stats(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0, with_entropy: bool = True
) -> TokenStats:
    """Logprobs of the realised next tokens (and entropies) from full-vocabulary logits.

    ``logits`` is ``[B, L, V]`` (any dtype; upcast to fp32 here so bf16 logits do not lose the
    small logprob differences the importance ratio depends on), ``tokens`` is ``[B, L]``.
    The temperature divides the logits exactly as vLLM's sampler does, so the trainer's
    distribution is the one the completions were sampled from (see docs/TRAINER.md for the
    matching vLLM ``--logprobs-mode``).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 (got {temperature}); greedy has no logprobs")
    scaled = logits[:, :-1, :].float() / temperature
    logp_all = F.log_softmax(scaled, dim=-1)
    targets = tokens[:, 1:].long().unsqueeze(-1)
    logprobs = logp_all.gather(-1, targets).squeeze(-1)
    if with_entropy:  # a statistic, never differentiated
        with torch.no_grad():
            entropy = -(logp_all.exp() * logp_all).sum(-1)
    else:
        entropy = torch.zeros_like(logprobs)
    return TokenStats(logprobs=logprobs, entropy=entropy)


def self_certainty(entropy: torch.Tensor, span_mask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Mean over the span's tokens of KL(p_t || Uniform(V)), per sequence (``[B]``).

    KL(p || U) = sum_v p_v log(p_v V) = log V - H(p), so it follows exactly from the entropy
    of the full-vocabulary distribution. Sequences with no span tokens get 0 (no bonus).
    """
    m = span_mask.float()
    per_token = (math.log(vocab_size) - entropy) * m
    count = m.sum(-1)
    return torch.where(count > 0, per_token.sum(-1) / count.clamp_min(1.0), torch.zeros_like(count))


def group_advantages(
    scores: torch.Tensor, group_index: torch.Tensor, eps: float = 1e-6, scale: bool = True
) -> torch.Tensor:
    """GRPO advantages: (score - group mean) / (group population std + eps), returned as fp32.

    ``scores`` is ``[N]``, ``group_index`` ``[N]`` int labels (any values). A group whose
    scores are all equal gets advantage exactly 0 for every member (no learning signal), never
    NaN and never the rounding residue of its mean blown up by the division: the statistics are
    computed in float64 (the mean of equal fp32 values is then exact), and a group whose
    minimum equals its maximum is set to 0 explicitly, whatever the dtype of ``scores``.
    ``scale=False`` leaves out the division (Dr. GRPO, Liu et al. 2025): each group then
    counts in proportion to how much its rewards differ, not equally.
    """
    if scores.shape != group_index.shape or scores.dim() != 1:
        raise ValueError(f"scores {tuple(scores.shape)} and group_index must both be [N]")
    x = scores.detach().to(torch.float64)
    _, inverse = torch.unique(group_index, return_inverse=True)
    n_groups = int(inverse.max().item()) + 1 if inverse.numel() else 0
    zeros = torch.zeros(n_groups, dtype=torch.float64)
    counts = zeros.index_add(0, inverse, torch.ones_like(x))
    mean = zeros.index_add(0, inverse, x) / counts
    hi = zeros.scatter_reduce(0, inverse, x, "amax", include_self=False)
    lo = zeros.scatter_reduce(0, inverse, x, "amin", include_self=False)
    constant = (hi == lo)[inverse]
    centred = torch.where(constant, torch.zeros_like(x), x - mean[inverse])
    if scale:
        var = zeros.index_add(0, inverse, centred**2) / counts
        centred = centred / (var.sqrt()[inverse] + eps)
    return centred.float()


KlEstimator = Literal["k1", "k2", "k3"]
PolicyLossType = Literal["ppo", "gspo", "cispo"]
IsLevel = Literal["token", "sequence"]


def kl_estimate(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: KlEstimator = "k3"
) -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from tokens sampled by pi (Schulman's k1/k2/k3), with
    d = log pi - log ref:

    - ``k1 = d``: unbiased, negative on about half the tokens; as a loss its gradient is the
      log-likelihood gradient scaled by 1 (it lowers the sampled tokens' probability).
    - ``k2 = d**2 / 2``: biased, >= 0, low variance; gradient ``d * grad log pi``.
    - ``k3 = exp(-d) + d - 1``: unbiased and >= 0 (verl's ``low_var_kl``); ``exp`` is taken of
      ``-d`` clamped to +-LOG_RATIO_BOUND, so it cannot overflow.
    """
    d = logprobs - ref_logprobs
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        return _safe_exp(-d) + d - 1.0
    raise ValueError(f"unknown KL estimator {estimator!r} (k1, k2 or k3)")


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi || ref) per token: exp(r) - r - 1 with r = ref - pi."""
    return kl_estimate(logprobs, ref_logprobs, "k3")


def mismatch_kl(
    trainer_logprobs: torch.Tensor, inference_logprobs: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """How far the trainer's distribution is from the one that sampled: sums over the masked
    tokens of two estimators of KL(pi_inference || pi_trainer) from the sampled tokens, with
    r = pi_trainer / pi_inference: ``k1 = -log r`` and ``k3 = r - log r - 1`` (>= 0; verl's
    ``rollout_corr/k3_kl``, prime-rl's ``mismatch_kl``), plus the token count. The caller
    divides by the step's tokens (summed over ranks)."""
    m = mask.to(torch.bool)
    log_r = torch.where(m, trainer_logprobs.float() - inference_logprobs.float(), 0.0)
    k3 = torch.where(m, _safe_exp(log_r) - log_r - 1.0, 0.0)
    return {
        "mismatch_k1": float(-log_r.sum()),
        "mismatch_k3": float(k3.sum()),
        "mismatch_tokens": float(m.sum()),
    }


@dataclass
class LossOutput:
    """The (already normalised) loss to backpropagate and its detached per-batch sums."""

    loss: torch.Tensor
    """Scalar to call ``backward()`` on; divided by the step's normaliser (see policy_loss)."""
    sums: dict[str, float]
    """Unnormalised sums over masked tokens: ``tokens``, ``clipped``, ``kl``, ``ratio``,
    ``iw``, ``iw_truncated``, ``mismatch_masked``; the caller divides by the step's token
    count."""


def policy_loss(
    logprobs: torch.Tensor,
    inference_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    normaliser: float,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    tis_cap: float | None = None,
    ref_logprobs: torch.Tensor | None = None,
    kl_beta: float = 0.0,
    aggregation: Aggregation = "token",
    loss_type: PolicyLossType = "ppo",
    tis_level: IsLevel = "token",
    mask_low: float | None = None,
    mask_high: float | None = None,
    kl_estimator: KlEstimator = "k3",
) -> LossOutput:
    """The policy loss of one micro-batch (docs/TRAINER.md, "The maths", has the table).

    ``loss_type``:
    - ``ppo`` (GRPO / DAPO / Dr. GRPO): per token ``-w * min(r A, clip(r, 1 - clip_low,
      1 + clip_high) A)``, correct for both signs of A: with A > 0 the objective stops growing
      once r > 1 + clip_high, with A < 0 once r < 1 - clip_low (the ``min`` picks the
      pessimistic term; Atropos's example trainer clamps before multiplying, which clips
      negative advantages on the wrong side).
    - ``gspo`` (Qwen's GSPO, "GSPO-token" form): r is the sequence's ratio, the geometric mean
      ``exp(mean_t log r_t)`` over its masked tokens, the same for each of its tokens, clipped
      as in ``ppo``; its gradient flows through every token's own logprob. The paper averages
      per sequence (``aggregation="sequence"``) with clip ranges of ~3e-4 / 4e-4.
    - ``cispo`` (MiniMax-M1's CISPO): per token ``-w * sg(clip(r, 1 - clip_low, 1 + clip_high))
      * A * log pi``: the IS weight is clipped and detached, so no token's gradient is dropped
      (PPO's is zero once clipped). Its loss value includes ``log pi`` and is not comparable
      with ``ppo``'s; its gradient equals ``ppo``'s wherever r is inside the clip range.

    Importance ratios, with ``pi_old`` the trainer's own (detached) logprobs:
    - ``tis_cap is None``: r = pi / pi_inference, w = 1 (the clip is taken against the
      logprobs the inference server reported).
    - ``tis_cap = C``: decoupled: r = pi / pi_old, and w truncates the trainer/inference
      weight pi_old / pi_inference at C: per token (``tis_level="token"``) or one weight per
      sequence, the product of its tokens' weights (``"sequence"``, TRL's
      ``sequence_truncate``).
    - ``mask_low``/``mask_high`` (ICEPOP / MIS): a token whose trainer/inference ratio
      pi_old / pi_inference lies outside [mask_low, mask_high] contributes no policy term
      (its KL term stays); it still counts in the normaliser, as IcePop's objective does.

    KL: ``kl_beta * kl_estimate(pi, ref, kl_estimator)`` per token (k1, k2 or k3).

    Every log ratio is clamped to +-``LOG_RATIO_BOUND`` before ``exp``, so a token the
    inference server gave a logprob of -1e4 (its stand-in for -inf) yields a finite loss and
    no gradient rather than an inf loss or a NaN gradient.

    ``advantages`` is per sequence (``[B]``) or per token (``[B, T]``, e.g. an environment's
    own token-level advantages); ``logprobs``/``inference_logprobs``/``mask``/
    ``ref_logprobs`` are per prediction (``[B, T]``). ``normaliser`` makes gradient
    accumulation exact: the total number of masked tokens in the whole optimizer step
    (``aggregation="token"``) or the number of sequences in it (``"sequence"``: each sequence's
    tokens are averaged first, then sequences are averaged).
    """
    if normaliser <= 0:
        raise ValueError("normaliser must be > 0 (an optimizer step with no trainable tokens)")
    if loss_type not in ("ppo", "gspo", "cispo"):
        raise ValueError(f"unknown loss_type {loss_type!r} (ppo, gspo or cispo)")
    m = mask.to(torch.bool)
    mf = m.float()
    lp = logprobs.float()
    zeros = torch.zeros_like(lp)
    inf_lp = torch.where(m, inference_logprobs.float(), lp.detach())  # masked: ratio exactly 1
    behaviour = torch.where(m, lp.detach() - inf_lp, zeros)  # log(pi_old / pi_inference)
    if tis_cap is None:
        old, raw_iw = inf_lp, torch.ones_like(lp)
        iw = raw_iw
    else:
        old = lp.detach()
        if tis_level == "sequence":
            raw_iw = _safe_exp(behaviour.sum(-1, keepdim=True)).expand_as(lp)
        else:
            raw_iw = _safe_exp(behaviour)
        iw = raw_iw.clamp(max=tis_cap)
    keep = m
    if mask_low is not None or mask_high is not None:
        w = _safe_exp(behaviour)
        outside = (w < mask_low) if mask_low is not None else torch.zeros_like(m)
        if mask_high is not None:
            outside = outside | (w > mask_high)
        keep = m & ~outside
    log_ratio = torch.where(m, lp - old, zeros)
    if loss_type == "gspo":
        seq = (log_ratio * mf).sum(-1, keepdim=True) / mf.sum(-1, keepdim=True).clamp_min(1.0)
        log_ratio = torch.where(m, seq.detach() + lp - lp.detach(), zeros)
    ratio = _safe_exp(log_ratio)  # clamped in log space: see LOG_RATIO_BOUND
    adv = advantages.float()
    adv = (adv.unsqueeze(-1) if adv.dim() == 1 else adv).expand_as(lp)
    lo, hi = 1.0 - clip_low, 1.0 + clip_high
    if loss_type == "cispo":
        policy = -iw * ratio.detach().clamp(lo, hi) * adv * lp
        is_clipped = (ratio < lo) | (ratio > hi)
    else:
        policy = -iw * torch.minimum(ratio * adv, ratio.clamp(lo, hi) * adv)
        # "clipped": the clipped branch is the one the min chose, and it is flat.
        is_clipped = ((adv > 0) & (ratio > hi)) | ((adv < 0) & (ratio < lo))
    per_token = torch.where(keep, policy, zeros)
    kl = zeros
    if ref_logprobs is not None:
        kl = torch.where(m, kl_estimate(lp, ref_logprobs.float(), kl_estimator), zeros)
        per_token = per_token + kl_beta * kl
    per_token = per_token * mf
    if aggregation == "token":
        loss = per_token.sum() / normaliser
    elif aggregation == "sequence":
        per_seq = per_token.sum(-1) / mf.sum(-1).clamp_min(1.0)
        loss = per_seq.sum() / normaliser
    else:
        raise ValueError(f"unknown aggregation {aggregation!r}")
    with torch.no_grad():
        sums = {
            "tokens": float(mf.sum()),
            "clipped": float((is_clipped & m).float().sum()),
            "kl": float((kl * mf).sum()),
            "ratio": float((ratio * mf).sum()),
            "iw": float((raw_iw * mf).sum()),
            "iw_truncated": float(((raw_iw > tis_cap) & m).float().sum()) if tis_cap else 0.0,
            "mismatch_masked": float((m & ~keep).float().sum()),
        }
    return LossOutput(loss=loss, sums=sums)


def sft_loss(
    logits: torch.Tensor, tokens: torch.Tensor, loss_mask: torch.Tensor, normaliser: float
) -> tuple[torch.Tensor, float]:
    """Next-token cross-entropy over the target tokens only (prompt tokens masked out).

    ``loss_mask`` is aligned to ``tokens`` (1 = a target token to predict). Returns the loss
    divided by ``normaliser`` (the number of target tokens in the whole optimizer step, so
    gradient accumulation is exact) and the unnormalised sum for logging.
    """
    stats = token_stats(logits, tokens, temperature=1.0, with_entropy=False)
    m = shift_aligned(loss_mask).float()
    nll_sum = -(stats.logprobs * m).sum()
    return nll_sum / normaliser, float(nll_sum.detach())
