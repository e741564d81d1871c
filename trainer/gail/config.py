"""The GAIL options (``GailConfig``: recipe ``trainer.grpo.gail:``, ``GAIL_*`` environment
variables, ``--gail.*`` flags; docs/GAIL.md). Imports no torch: ``trainer.config`` imports it.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from settings.flags import env_values, from_env

TINY = "tiny"
STATE_NAME = "gail"
"""The discriminator's file in a checkpoint: ``checkpoints/step_N/gail.pt``."""


class GailConfig(BaseModel):
    """The discriminator reward (GRAIL). Fields marked (GAIL_X) read that environment variable
    (``settings.cli`` precedence: defaults < file (``trainer.grpo.gail:`` of a run file) <
    environment < flags ``--gail.use``, ``--gail.weight 0.5``, ...)."""

    model_config = ConfigDict(extra="forbid")

    use: bool = Field(
        False,
        description="Add the discriminator reward (GAIL_USE=1).",
        json_schema_extra=from_env("GAIL_USE"),
    )
    weight: float = Field(
        0.5,
        ge=0,
        description="Scale of the bonus, which lies in [0, weight] (GAIL_WEIGHT).",
        json_schema_extra=from_env("GAIL_WEIGHT"),
    )
    alpha: float = Field(
        1.0,
        ge=0,
        description="Temperature on the discriminator logit in the bonus "
        "weight * sigmoid(alpha * logit): <1 smooths, >1 sharpens (GAIL_ALPHA).",
        json_schema_extra=from_env("GAIL_ALPHA"),
    )
    lr: float | None = Field(
        None,
        gt=0,
        description="Discriminator AdamW learning rate (GAIL_LR); default 1e-3 for `tiny`, "
        "2e-5 for a pretrained encoder.",
        json_schema_extra=from_env("GAIL_LR"),
    )
    disc_model: str = Field(
        TINY,
        description="`tiny` (built from the policy's tokenizer, CPU-friendly) or a Hugging Face "
        "encoder id/folder (GAIL_DISC_MODEL).",
        json_schema_extra=from_env("GAIL_DISC_MODEL"),
    )
    device: str = Field(
        "auto",
        description="`auto` (the trainer's device), `cpu`, `cuda[:N]` (GAIL_DEVICE).",
        json_schema_extra=from_env("GAIL_DEVICE"),
    )
    eval_mode: bool = Field(
        False,
        description="Keep the discriminator frozen: rewards, no updates (GAIL_EVAL_MODE=1).",
        json_schema_extra=from_env("GAIL_EVAL_MODE"),
    )
    updates: int = Field(
        1,
        ge=1,
        description="Gradient steps per GRPO step (GAIL_UPDATES).",
        json_schema_extra=from_env("GAIL_UPDATES"),
    )
    max_length: int = Field(128, ge=8, description="Tokens of each text the discriminator reads.")
    hidden_size: int = Field(128, ge=16, description="`tiny`: width (a multiple of 4 heads).")
    num_layers: int = Field(2, ge=1, description="`tiny`: Transformer encoder layers.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient norm clip of an update.")
    seed: int = Field(0, description="Seed of the discriminator's initial weights.")

    @classmethod
    def from_env(cls) -> GailConfig:
        """Defaults overridden by the ``GAIL_*`` environment variables (the default of
        ``GrpoConfig.gail``, so a config built in code reads them too)."""
        try:
            return cls.model_validate(env_values(cls))
        except ValidationError as e:
            raise ValueError(f"invalid GAIL_* environment variable:\n{e}") from None

    def learning_rate(self) -> float:
        if self.lr is not None:
            return self.lr
        return 1e-3 if self.disc_model == TINY else 2e-5

    @model_validator(mode="after")
    def _check(self) -> GailConfig:
        if self.disc_model == TINY and self.hidden_size % 4:
            raise ValueError("gail.hidden_size must be a multiple of 4 (4 attention heads)")
        return self
