"""The GAIL options (``GailConfig``: recipe ``trainer.grpo.gail:``, ``--gail.*`` flags, the
defaults from ``GAIL_*`` environment variables; docs/GAIL.md). Imports no torch:
``trainer.config`` imports it.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from settings.layers import env_default

TINY = "tiny"
STATE_NAME = "gail"
"""The discriminator's file in a checkpoint: ``checkpoints/step_N/gail.pt``."""


class GailConfig(BaseModel):
    """The discriminator reward (GRAIL). A field marked (GAIL_X) takes its default from that
    environment variable; a file (``trainer.grpo.gail:``), ``SHOP_R1_TRAINER__GRPO__GAIL__X``
    and flags (``--gail.use``, ``--gail.weight 0.5``) override it, in that order."""

    model_config = ConfigDict(extra="forbid", validate_default=True)

    use: bool = Field(
        default_factory=env_default("GAIL_USE", False),
        description="Add the discriminator reward (GAIL_USE=1).",
    )
    weight: float = Field(
        default_factory=env_default("GAIL_WEIGHT", 0.5),
        ge=0,
        description="Scale of the bonus, which lies in [0, weight] (GAIL_WEIGHT).",
    )
    alpha: float = Field(
        default_factory=env_default("GAIL_ALPHA", 1.0),
        ge=0,
        description="Temperature on the discriminator logit in the bonus "
        "weight * sigmoid(alpha * logit): <1 smooths, >1 sharpens (GAIL_ALPHA).",
    )
    lr: float | None = Field(
        default_factory=env_default("GAIL_LR", None),
        gt=0,
        description="Discriminator AdamW learning rate (GAIL_LR); default 1e-3 for `tiny`, "
        "2e-5 for a pretrained encoder.",
    )
    disc_model: str = Field(
        default_factory=env_default("GAIL_DISC_MODEL", TINY),
        description="`tiny` (built from the policy's tokenizer, CPU-friendly) or a Hugging Face "
        "encoder id/folder (GAIL_DISC_MODEL).",
    )
    device: str = Field(
        default_factory=env_default("GAIL_DEVICE", "auto"),
        description="`auto` (the trainer's device), `cpu`, `cuda[:N]` (GAIL_DEVICE).",
    )
    eval_mode: bool = Field(
        default_factory=env_default("GAIL_EVAL_MODE", False),
        description="Keep the discriminator frozen: rewards, no updates (GAIL_EVAL_MODE=1).",
    )
    updates: int = Field(
        default_factory=env_default("GAIL_UPDATES", 1),
        ge=1,
        description="Gradient steps per GRPO step (GAIL_UPDATES).",
    )
    max_length: int = Field(128, ge=8, description="Tokens of each text the discriminator reads.")
    hidden_size: int = Field(128, ge=16, description="`tiny`: width (a multiple of 4 heads).")
    num_layers: int = Field(2, ge=1, description="`tiny`: Transformer encoder layers.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient norm clip of an update.")
    seed: int = Field(0, description="Seed of the discriminator's initial weights.")

    def learning_rate(self) -> float:
        if self.lr is not None:
            return self.lr
        return 1e-3 if self.disc_model == TINY else 2e-5

    @model_validator(mode="after")
    def _check(self) -> GailConfig:
        if self.disc_model == TINY and self.hidden_size % 4:
            raise ValueError("gail.hidden_size must be a multiple of 4 (4 attention heads)")
        return self
