"""The GRPO policy losses as choices: one function per ``--policy-loss`` behind a registry.

A loss is ``fn(inp: LossInput, s: LossSettings) -> LossOutput``, registered under its
name (``trainer.grpo.loss.type``) with :func:`register`; :func:`compute_loss` runs the one
that ``s`` names. The parts every loss shares are functions here, not copies:
:func:`importance` (the ratio and the truncated / masked importance weights), :func:`finish`
(the KL term, the aggregation and the token statistics) and :func:`clipped_surrogate` (PPO's
min, which GSPO reuses). To add a loss: write its function, ``@register("name")`` it, add its
member to ``PolicyLoss`` (trainer/loss_config.py) and pin its values in a test
(docs/TRAINER.md, "The maths").

Importance ratios, with ``pi_old`` the trainer's own (detached) logprobs:

- ``tis_cap is None``: r = pi / pi_inference, w = 1 (the clip is taken against the logprobs
  the inference server reported).
- ``tis_cap = C``: decoupled: r = pi / pi_old, and w truncates the trainer/inference weight
  pi_old / pi_inference at C: per token (``tis_level="token"``) or one weight per sequence,
  the product of its tokens' weights (``"sequence"``, TRL's ``sequence_truncate``).
- ``mask_low``/``mask_high`` (ICEPOP / MIS): a token whose trainer/inference ratio
  pi_old / pi_inference lies outside [mask_low, mask_high] contributes no policy term (its KL
  term stays); it still counts in the normaliser, as IcePop's objective does. With
  ``mask_level="sequence"`` the bounds compare the sequence's ratio (the product of its
  tokens'), and a sequence outside them loses every token's policy term: with ``tis_cap`` =
  ``mask_high`` and ``tis_level="sequence"``, TRL's ``sequence_mask`` (its vLLM default).

KL: ``kl_beta * kl_estimate(pi, ref, kl_estimator)`` per token (k1, k2 or k3). Every log ratio
is clamped to +-``LOG_RATIO_BOUND`` before ``exp`` (trainer/loss.py), so a token the inference
server gave a logprob of -1e4 (its stand-in for -inf) yields a finite loss and no gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, get_args

import torch

from trainer.loss import KlEstimator, kl_estimate, safe_exp

if TYPE_CHECKING:
    from trainer.config import GrpoConfig

Aggregation = Literal["token", "sequence", "constant"]
IsLevel = Literal["token", "sequence"]


@dataclass(frozen=True, eq=False)
class LossInput:
    """One micro-batch's per-prediction tensors (``[B, T]``; see trainer/loss.py's alignment).

    ``advantages`` is per sequence (``[B]``) or per token (``[B, T]``, e.g. an environment's
    own token-level advantages). ``normaliser`` makes gradient accumulation exact: the total
    number of masked tokens in the whole optimizer step (``aggregation="token"``), the number
    of sequences in it (``"sequence"``: each sequence's tokens are averaged first, then
    sequences are averaged), or its sequences x a constant length (``"constant"``: the
    tokens' sum over that; :meth:`LossSettings.step_normaliser`)."""

    logprobs: torch.Tensor
    inference_logprobs: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    normaliser: float
    ref_logprobs: torch.Tensor | None = None
    """The KL's reference logprobs; None: no KL term."""

    def __post_init__(self) -> None:
        if self.normaliser <= 0:
            raise ValueError("normaliser must be > 0 (an optimizer step with no trainable tokens)")


@dataclass(frozen=True)
class LossSettings:
    """Which loss and its knobs: built once per run with :meth:`from_config`."""

    loss_type: str = "ppo"
    """A registered loss (:data:`LOSSES`): ``ppo``, ``gspo`` or ``cispo``."""
    clip_low: float = 0.2
    clip_high: float = 0.2
    tis_cap: float | None = None
    tis_level: IsLevel = "token"
    mask_low: float | None = None
    mask_high: float | None = None
    mask_level: IsLevel = "token"
    """What ``mask_low``/``mask_high`` compare: each token's ratio or its sequence's."""
    kl_beta: float = 0.0
    kl_estimator: KlEstimator = "k3"
    aggregation: Aggregation = "token"
    constant_length: int | None = None
    """``aggregation="constant"``: tokens per sequence of the normaliser."""

    def __post_init__(self) -> None:
        get_loss(self.loss_type)  # refuses an unknown name, listing the registered ones
        if (self.aggregation == "constant") != (self.constant_length is not None):
            raise ValueError("constant_length goes with aggregation constant, and only there")
        for name, value, allowed in (
            ("aggregation", self.aggregation, Aggregation),
            ("tis_level", self.tis_level, IsLevel),
            ("mask_level", self.mask_level, IsLevel),
            ("KL estimator", self.kl_estimator, KlEstimator),
        ):
            if value not in get_args(allowed):
                raise ValueError(f"unknown {name} {value!r} ({', '.join(get_args(allowed))})")

    @classmethod
    def from_config(cls, cfg: GrpoConfig) -> LossSettings:
        """The settings of a GRPO run's config."""
        loss = cfg.loss
        return cls(
            loss_type=loss.type,
            clip_low=loss.clip_low,
            clip_high=loss.clip_high,
            tis_cap=loss.tis_cap,
            tis_level=loss.tis_level,
            mask_low=loss.mismatch_mask_low,
            mask_high=loss.mismatch_mask_high,
            mask_level=loss.mismatch_mask_level,
            kl_beta=cfg.kl_beta,
            kl_estimator=cfg.kl_estimator,
            aggregation=loss.loss_aggregation,
            constant_length=loss.constant_length,
        )

    def step_normaliser(self, tokens: float, sequences: int) -> float:
        """A whole optimizer step's normaliser (``LossInput.normaliser``) from its trained
        tokens and sequences: the tokens (``token``), the sequences (``sequence``) or the
        sequences x ``constant_length`` (``constant``)."""
        if self.aggregation == "token":
            return float(tokens)
        if self.aggregation == "sequence":
            return float(sequences)
        return float(sequences * self.constant_length)

    @property
    def clip_range(self) -> tuple[float, float]:
        """The ratio's clip range ``(1 - clip_low, 1 + clip_high)``."""
        return 1.0 - self.clip_low, 1.0 + self.clip_high


@dataclass
class LossOutput:
    """The (already normalised) loss to backpropagate and its detached per-batch sums."""

    loss: torch.Tensor
    """Scalar to call ``backward()`` on; divided by the step's normaliser (see LossInput)."""
    sums: dict[str, float]
    """Unnormalised sums over masked tokens: ``tokens``, ``clipped``, ``kl``, ``ratio``,
    ``iw``, ``iw_truncated``, ``mismatch_masked``; the caller divides by the step's token
    count."""


LossFn = Callable[[LossInput, LossSettings], LossOutput]
LOSSES: dict[str, LossFn] = {}
"""The registered losses by ``policy_loss`` name."""


def register(name: str) -> Callable[[LossFn], LossFn]:
    """Decorator: register a loss function under ``name`` (once)."""

    def add(fn: LossFn) -> LossFn:
        if name in LOSSES:
            raise ValueError(f"loss_type {name!r} is already registered ({LOSSES[name]})")
        LOSSES[name] = fn
        return fn

    return add


def get_loss(name: str) -> LossFn:
    """The loss registered as ``name``; an unknown name is refused, listing the known ones."""
    if name not in LOSSES:
        raise ValueError(f"unknown loss_type {name!r} (registered: {', '.join(sorted(LOSSES))})")
    return LOSSES[name]


def compute_loss(inp: LossInput, s: LossSettings) -> LossOutput:
    """The policy loss of one micro-batch under the loss ``s.loss_type`` names."""
    return get_loss(s.loss_type)(inp, s)


@dataclass(frozen=True, eq=False)
class Importance:
    """The shared per-token quantities every loss starts from (all ``[B, T]`` fp32)."""

    m: torch.Tensor
    """The mask as bool."""
    mf: torch.Tensor
    """The mask as float."""
    lp: torch.Tensor
    """The trainer's logprobs (fp32, with their gradient)."""
    zeros: torch.Tensor
    adv: torch.Tensor
    """The advantages, broadcast per token."""
    log_ratio: torch.Tensor
    """log(pi / pi_inference), or log(pi / pi_old) when decoupled (``tis_cap``); 0 unmasked."""
    raw_iw: torch.Tensor
    """The trainer/inference importance weight before truncation (1 unless decoupled)."""
    iw: torch.Tensor
    """The weight ``w`` the policy term is multiplied by (truncated at ``tis_cap``)."""
    keep: torch.Tensor
    """Masked tokens that keep their policy term (not masked out by ICEPOP / MIS)."""


def importance(inp: LossInput, s: LossSettings) -> Importance:
    """The importance ratio, the truncated weight and the ICEPOP / MIS mask (module doc)."""
    m = inp.mask.to(torch.bool)
    mf = m.float()
    lp = inp.logprobs.float()
    zeros = torch.zeros_like(lp)
    inf_lp = torch.where(m, inp.inference_logprobs.float(), lp.detach())  # masked: ratio 1
    behaviour = torch.where(m, lp.detach() - inf_lp, zeros)  # log(pi_old / pi_inference)

    def weight(level: IsLevel) -> torch.Tensor:
        """pi_old / pi_inference per token, or per sequence (its tokens' product) on each."""
        if level == "sequence":
            return safe_exp(behaviour.sum(-1, keepdim=True)).expand_as(lp)
        return safe_exp(behaviour)

    if s.tis_cap is None:
        old, raw_iw = inf_lp, torch.ones_like(lp)
        iw = raw_iw
    else:
        old = lp.detach()
        raw_iw = weight(s.tis_level)
        iw = raw_iw.clamp(max=s.tis_cap)
    keep = m
    if s.mask_low is not None or s.mask_high is not None:
        w = weight(s.mask_level)
        outside = (w < s.mask_low) if s.mask_low is not None else torch.zeros_like(m)
        if s.mask_high is not None:
            outside = outside | (w > s.mask_high)
        keep = m & ~outside
    adv = inp.advantages.float()
    adv = (adv.unsqueeze(-1) if adv.dim() == 1 else adv).expand_as(lp)
    log_ratio = torch.where(m, lp - old, zeros)
    return Importance(m, mf, lp, zeros, adv, log_ratio, raw_iw, iw, keep)


def clipped_surrogate(
    imp: Importance, ratio: torch.Tensor, s: LossSettings
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's per-token ``-w * min(r A, clip(r) A)`` and where the clipped branch was chosen."""
    lo, hi = s.clip_range
    adv = imp.adv
    policy = -imp.iw * torch.minimum(ratio * adv, ratio.clamp(lo, hi) * adv)
    # "clipped": the clipped branch is the one the min chose, and it is flat.
    is_clipped = ((adv > 0) & (ratio > hi)) | ((adv < 0) & (ratio < lo))
    return policy, is_clipped


def finish(
    inp: LossInput,
    s: LossSettings,
    imp: Importance,
    policy: torch.Tensor,
    ratio: torch.Tensor,
    is_clipped: torch.Tensor,
) -> LossOutput:
    """A loss's per-token policy term -> the KL term, the aggregation and the sums."""
    m, mf, zeros = imp.m, imp.mf, imp.zeros
    per_token = torch.where(imp.keep, policy, zeros)
    kl = zeros
    if inp.ref_logprobs is not None:
        kl = torch.where(m, kl_estimate(imp.lp, inp.ref_logprobs.float(), s.kl_estimator), zeros)
        per_token = per_token + s.kl_beta * kl
    per_token = per_token * mf
    if s.aggregation in ("token", "constant"):  # the normalisers differ (step_normaliser)
        loss = per_token.sum() / inp.normaliser
    else:
        per_seq = per_token.sum(-1) / mf.sum(-1).clamp_min(1.0)
        loss = per_seq.sum() / inp.normaliser
    with torch.no_grad():
        cap, raw_iw = s.tis_cap, imp.raw_iw
        sums = {
            "tokens": float(mf.sum()),
            "clipped": float((is_clipped & m).float().sum()),
            "kl": float((kl * mf).sum()),
            "ratio": float((ratio * mf).sum()),
            "iw": float((raw_iw * mf).sum()),
            "iw_truncated": float(((raw_iw > cap) & m).float().sum()) if cap else 0.0,
            "mismatch_masked": float((m & ~imp.keep).float().sum()),
        }
    return LossOutput(loss=loss, sums=sums)


@register("ppo")
def ppo(inp: LossInput, s: LossSettings) -> LossOutput:
    """PPO clip (GRPO / DAPO / Dr. GRPO): per token ``-w * min(r A, clip(r, 1 - clip_low,
    1 + clip_high) A)``, correct for both signs of A: with A > 0 the objective stops growing
    once r > 1 + clip_high, with A < 0 once r < 1 - clip_low (the ``min`` picks the
    pessimistic term; Atropos's example trainer clamps before multiplying, which clips
    negative advantages on the wrong side)."""
    imp = importance(inp, s)
    ratio = safe_exp(imp.log_ratio)  # clamped in log space: see LOG_RATIO_BOUND
    policy, is_clipped = clipped_surrogate(imp, ratio, s)
    return finish(inp, s, imp, policy, ratio, is_clipped)


@register("gspo")
def gspo(inp: LossInput, s: LossSettings) -> LossOutput:
    """Qwen's GSPO ("GSPO-token" form): r is the sequence's ratio, the geometric mean
    ``exp(mean_t log r_t)`` over its masked tokens, the same for each of its tokens, clipped as
    in :func:`ppo`; its gradient flows through every token's own logprob. The paper averages
    per sequence (``aggregation="sequence"``) with clip ranges of ~3e-4 / 4e-4."""
    imp = importance(inp, s)
    m, mf, lp = imp.m, imp.mf, imp.lp
    seq = (imp.log_ratio * mf).sum(-1, keepdim=True) / mf.sum(-1, keepdim=True).clamp_min(1.0)
    ratio = safe_exp(torch.where(m, seq.detach() + lp - lp.detach(), imp.zeros))
    policy, is_clipped = clipped_surrogate(imp, ratio, s)
    return finish(inp, s, imp, policy, ratio, is_clipped)


@register("cispo")
def cispo(inp: LossInput, s: LossSettings) -> LossOutput:
    """MiniMax-M1's CISPO: per token ``-w * sg(clip(r, 1 - clip_low, 1 + clip_high)) * A *
    log pi``: the IS weight is clipped and detached, so no token's gradient is dropped (PPO's is
    zero once clipped). Its loss value includes ``log pi`` and is not comparable with
    :func:`ppo`'s; its gradient equals PPO's wherever r is inside the clip range."""
    imp = importance(inp, s)
    lo, hi = s.clip_range
    ratio = safe_exp(imp.log_ratio)
    policy = -imp.iw * ratio.detach().clamp(lo, hi) * imp.adv * imp.lp
    is_clipped = (ratio < lo) | (ratio > hi)
    return finish(inp, s, imp, policy, ratio, is_clipped)


def policy_loss(
    logprobs: torch.Tensor,
    inference_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    normaliser: float,
    ref_logprobs: torch.Tensor | None = None,
    **settings: object,
) -> LossOutput:
    """:func:`compute_loss` with the tensors as arguments and ``settings`` the fields of
    :class:`LossSettings` as keywords (``loss_type="gspo", tis_cap=2.0``): for tests."""
    inp = LossInput(logprobs, inference_logprobs, advantages, mask, normaliser, ref_logprobs)
    return compute_loss(inp, LossSettings(**settings))  # type: ignore[arg-type]
