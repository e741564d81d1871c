"""``trainer.grpo.loss``: the GRPO policy loss of a run, one member per loss, chosen by its
``type`` (``ppo``, ``gspo``, ``cispo``; trainer/policy_losses.py holds their functions). The
old flat keys of ``trainer.grpo`` (``policy_loss``, ``clip_low``, ...) and their flags
(``--policy-loss``, ``--clip-low``, ...) still set it (:data:`OLD_KEYS`). Imports no torch."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator


class _Loss(BaseModel):
    """The knobs every policy loss has: its clip range, the trainer/inference importance
    weight (truncated, masked) and how the step's tokens are averaged."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    clip_low: float = Field(0.2, gt=0)
    """Ratio lower bound is 1 - clip_low (``cispo``: ``1`` = no lower bound)."""
    clip_high: float = Field(0.2, gt=0)
    """Ratio upper bound is 1 + clip_high (0.28 = DAPO's clip-higher; ``cispo``: up to 5)."""
    tis_cap: float | None = None
    """Truncated importance weight cap for the inference/trainer mismatch; None = ratio taken
    directly against the inference logprobs."""
    tis_level: Literal["token", "sequence"] = "token"
    """With ``tis_cap``: truncate each token's trainer/inference weight (``token``) or one
    weight per sequence, the product of its tokens' weights (``sequence``, TRL's
    ``sequence_truncate``)."""
    mismatch_mask_low: float | None = Field(None, gt=0, lt=1)
    """ICEPOP / MIS masking: a token whose trainer/inference probability ratio is below this
    (e.g. 0.5) gets no policy-gradient term (None: no lower bound)."""
    mismatch_mask_high: float | None = Field(None, gt=1)
    """ICEPOP / MIS masking: a token whose trainer/inference probability ratio is above this
    (e.g. 2 or 5) gets no policy-gradient term (None: no upper bound)."""
    mismatch_mask_level: Literal["token", "sequence"] = "token"
    """What the mask bounds compare: each token's trainer/inference ratio (``token``, ICEPOP)
    or its sequence's, the product of its tokens' ratios, so a sequence outside the bounds
    loses every token's policy term (``sequence``; with ``tis_cap`` at the upper bound and
    ``tis_level sequence`` it is TRL's default ``vllm_importance_sampling_mode``,
    ``sequence_mask``)."""
    loss_aggregation: Literal["token", "sequence", "constant"] = "token"
    """Average the loss over all tokens of the step (``token``), per sequence then over
    sequences (``sequence``), or sum it over the step's tokens and divide by a constant, its
    sequences x ``constant_length`` (``constant``: Dr. GRPO, TRL's ``dr_grpo``), so a token
    weighs the same whatever the length of its sequence or of the step."""
    constant_length: int | None = Field(None, gt=0)
    """With ``loss_aggregation constant``: the tokens per sequence of its normaliser (Dr. GRPO
    and TRL take the completion budget, the env's ``max_tokens``). Required there, refused
    with another aggregation."""

    @model_validator(mode="after")
    def _check_weights(self) -> _Loss:
        if self.tis_cap is not None and self.tis_cap < 1.0:
            raise ValueError("tis_cap must be >= 1 (a cap below 1 down-weights every token)")
        if self.tis_level == "sequence" and self.tis_cap is None:
            raise ValueError("tis_level sequence needs tis_cap (the truncation of its weight)")
        if self.mismatch_mask_level == "sequence" and (
            self.mismatch_mask_low is None and self.mismatch_mask_high is None
        ):
            raise ValueError(
                "mismatch_mask_level sequence needs mismatch_mask_low or mismatch_mask_high "
                "(the bounds a sequence's trainer/inference ratio is masked outside)"
            )
        if self.loss_aggregation == "constant" and self.constant_length is None:
            raise ValueError(
                "loss_aggregation constant needs constant_length (tokens per sequence of its "
                "normaliser; Dr. GRPO and TRL's dr_grpo use the completion budget, max_tokens)"
            )
        if self.loss_aggregation != "constant" and self.constant_length is not None:
            raise ValueError(
                f"constant_length is the normaliser of loss_aggregation constant; this loss "
                f"aggregates by {self.loss_aggregation}"
            )
        return self


class PpoLoss(_Loss):
    """The token-level clipped surrogate (GRPO, DAPO, Dr. GRPO)."""

    type: Literal["ppo"] = "ppo"
    """Which loss."""


class GspoLoss(_Loss):
    """One importance ratio per sequence (the geometric mean of its tokens' ratios), clipped
    (the paper: ``clip_low 3e-4``, ``clip_high 4e-4``, ``loss_aggregation sequence``)."""

    type: Literal["gspo"] = "gspo"
    """Which loss."""


class CispoLoss(_Loss):
    """The clipped, detached IS weight times A times log pi: no token's gradient is dropped
    (MiniMax-M1; ScaleRL: ``clip_high`` up to 5, ``clip_low 1`` = no lower bound)."""

    type: Literal["cispo"] = "cispo"
    """Which loss."""


def _tag(value: Any) -> str | None:
    """A loss's member: its ``type``, ``ppo`` when a layer gives knobs without one."""
    if isinstance(value, dict):
        return value.get("type", "ppo")
    return getattr(value, "type", None)


MEMBERS = (PpoLoss, GspoLoss, CispoLoss)
LOSS_TYPES = tuple(m.model_fields["type"].default for m in MEMBERS)
"""The losses a run may choose (each registered in trainer/policy_losses.py)."""
PolicyLoss = Annotated[
    Annotated[PpoLoss, Tag("ppo")]
    | Annotated[GspoLoss, Tag("gspo")]
    | Annotated[CispoLoss, Tag("cispo")],
    Discriminator(
        _tag,
        custom_error_type="loss_type",
        custom_error_message=f"loss.type (old key: policy_loss) is one of {', '.join(LOSS_TYPES)}",
    ),
]
"""``loss: {type: ppo|gspo|cispo, ...}``: a key the chosen loss lacks is refused, named."""

OLD_KEYS = {"policy_loss": "loss.type"}
OLD_KEYS |= {k: f"loss.{k}" for k in _Loss.model_fields}
"""``trainer.grpo``'s flat keys before the loss was a section -> where they live now."""


def with_old_keys(data: Any) -> Any:
    """``trainer.grpo``'s values with the old flat keys moved into ``loss`` (``GrpoConfig``
    built in Python: ``GrpoConfig(policy_loss="gspo")``); one setting given both ways is
    refused, naming both keys."""
    if not isinstance(data, dict) or not OLD_KEYS.keys() & data.keys():
        return data
    data, loss = dict(data), data.get("loss", {})
    if isinstance(loss, BaseModel):
        loss = {"type": getattr(loss, "type", None), **loss.model_dump(exclude_unset=True)}
    loss = dict(loss) if isinstance(loss, dict) else loss
    for old, new in OLD_KEYS.items():
        key = new.split(".", 1)[1]
        if old in data and isinstance(loss, dict):
            if key in loss:
                raise ValueError(f"{old} and {new} are one setting: give it once ({new})")
            loss[key] = data.pop(old)
    return {**data, "loss": loss}
