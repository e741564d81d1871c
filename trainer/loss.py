"""GRPO maths: token statistics, advantages, self-certainty, k1/k2/k3 KL, the mismatch metric
and the SFT loss. The policy losses (PPO clip, GSPO, CISPO) are in trainer/policy_losses.py.

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

LOG_RATIO_BOUND = 20.0
"""Bound on every log importance ratio before ``exp`` (verl's bound, too): e^20 ~ 4.9e8 is far
outside any clip range, so an ordinary token never reaches it, and stays finite in fp32
(times an advantage of 1e3 and 1e6 tokens it is still ~1e-21 of fp32's maximum). A token
beyond it -- e.g. one whose inference logprob was the -1e4 that env_server/inference.py puts
for -inf -- gets a finite loss term and no gradient (``clamp`` passes none), instead of
exp overflowing to inf: an inf loss (A < 0) or a NaN gradient (A > 0, 0 * inf)."""


def safe_exp(log_ratio: torch.Tensor) -> torch.Tensor:
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
    logits: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = True,
    rows: torch.Tensor | None = None,
) -> TokenStats:
    """Logprobs of the realised next tokens (and entropies) from full-vocabulary logits.

    Padded rows (``rows`` None): ``logits`` is ``[B, L, V]``, ``tokens`` is ``[B, L]``, and the
    result ``[B, L-1]`` (position ``t`` predicts ``tokens[:, t + 1]``). A packed prefix tree
    (trainer/prefix_tree/targets.py): ``logits`` is ``[K, V]`` at ``K`` packed positions,
    ``tokens`` ``[M]`` the predicted tokens and ``rows`` ``[M]`` the row of ``logits`` each is
    predicted from (a shared prompt's last position predicts every completion's first token);
    the result is ``[M]``.

    ``logits`` may be any dtype; they are upcast to fp32 here so bf16 logits do not lose the
    small logprob differences the importance ratio depends on. The temperature divides the
    logits exactly as vLLM's sampler does, so the trainer's distribution is the one the
    completions were sampled from (see docs/TRAINER.md for the matching vLLM
    ``--logprobs-mode``).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 (got {temperature}); greedy has no logprobs")
    if rows is None:
        logits = logits[:, :-1, :]
    logp_all = F.log_softmax(logits.float() / temperature, dim=-1)
    if rows is None:
        logprobs = logp_all.gather(-1, tokens[:, 1:].long().unsqueeze(-1)).squeeze(-1)
    else:
        logprobs = logp_all[rows, tokens]
    if with_entropy:  # a statistic, never differentiated
        with torch.no_grad():
            entropy = -(logp_all.exp() * logp_all).sum(-1)
        if rows is not None:
            entropy = entropy[rows]
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
        return safe_exp(-d) + d - 1.0
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
    k3 = torch.where(m, safe_exp(log_r) - log_r - 1.0, 0.0)
    return {
        "mismatch_k1": float(-log_r.sum()),
        "mismatch_k3": float(k3.sum()),
        "mismatch_tokens": float(m.sum()),
    }


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
