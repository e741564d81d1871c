"""Config of the environment service and its command line.

A YAML recipe (``--config``) overridden by flags; one ``--kebab-case`` flag per field, whose
help is the field's docstring. No torch here: ``--help`` and config errors are instant.
"""

from __future__ import annotations

import argparse
import os
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from env_server.reward import RewardConfig
from launch.paths import DATA_DIR


class EnvConfig(BaseModel):
    """The Shop-R1 environment service."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    api_url: str = "http://127.0.0.1:8000"
    """Batching API the scored groups go to."""
    api_token: str | None = Field(default_factory=lambda: os.environ.get("SHOP_R1_API_TOKEN"))
    """Shared token for the API's mutating routes (default: $SHOP_R1_API_TOKEN)."""
    inference_url: str = "http://127.0.0.1:8001"
    """OpenAI-compatible inference server (vLLM) the completions come from."""
    model: str | None = None
    """Served model name to request; default: ask the server (follows LoRA renames)."""
    tokenizer: str | None = None
    """Tokenizer path or hub id; default: the model path the server reports."""
    env_name: str = "shop_r1"
    """Name this environment registers under."""
    env_weight: float = 1.0
    """Share of the trainer's batches this environment asks for (relative to other envs)."""
    data_dir: Path = DATA_DIR
    """Dataset folder (train/validation/test JSONL); simulated and saved there if missing."""
    num_sessions: int = Field(3000, ge=10)
    """Sessions to simulate when the dataset is missing."""
    seed: int = 0
    """Seed of the simulated dataset and of the order prompts are drawn in."""
    group_size: int = Field(8, ge=2)
    """Completions sampled per prompt (a GRPO group)."""
    max_prompt_tokens: int = Field(1536, ge=64)
    """Prompt budget in tokens: the oldest pages are dropped first to fit (the prompt says so)."""
    max_tokens: int = Field(160, ge=8)
    """Completion budget in tokens (a target is ~45-75 tokens with the Shop-R1 tokenizer)."""
    temperature: float = Field(1.0, ge=0.0)
    """Sampling temperature for rollouts."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling for rollouts."""
    latest_only: bool = False
    """Show only the current page (paper Table 5 ablation) instead of the whole session."""
    reward_variant: Literal["full", "binary", "no_dars", "no_format"] = "full"
    """Reward preset: the paper's reward or one of its ablations."""
    reward: RewardConfig | None = None
    """Every reward constant (YAML only); overrides ``reward_variant`` when given."""
    concurrency: int = Field(4, ge=1)
    """Prompts in flight at once (each asks for ``group_size`` completions)."""
    drop_constant_groups: bool = True
    """Drop groups whose completions all score the same (no GRPO signal)."""
    poll_interval_s: float = Field(1.0, gt=0.0)
    """Wait between backpressure checks while the API wants nothing."""
    request_timeout_s: float = Field(300.0, gt=0.0)
    """Timeout of one completions request (CPU generation is slow)."""
    max_groups: int | None = None
    """Stop after pushing this many groups (default: run until stopped)."""
    max_consecutive_failures: int = Field(50, ge=1)
    """Give up after this many rollouts in a row fail with a non-transient error."""
    eval_every_groups: int = Field(0, ge=0)
    """Evaluate greedily on the validation split every N pushed groups (0: never)."""
    eval_samples: int = Field(64, ge=1)
    """Validation steps per periodic evaluation."""
    metrics_path: Path | None = None
    """JSONL file for group statistics and evaluation results (default: log only)."""
    log_every_s: float = Field(30.0, gt=0.0)
    """Seconds between progress lines in the log."""

    def reward_config(self) -> RewardConfig:
        return self.reward or RewardConfig.variant(self.reward_variant)


def _flag_kind(annotation: Any) -> str:
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        annotation = next(a for a in args if a is not type(None))
    return "bool" if annotation is bool else "value"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m env_server", description=EnvConfig.__doc__)
    ap.add_argument("--config", type=Path, help="YAML recipe; flags override its values.")
    for name, field in EnvConfig.model_fields.items():
        if name == "reward":
            continue
        flag = "--" + name.replace("_", "-")
        help_text = (field.description or "").replace("%", "%%")
        if _flag_kind(field.annotation) == "bool":
            ap.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction,
                            default=argparse.SUPPRESS, help=help_text)  # fmt: skip
        else:
            ap.add_argument(flag, dest=name, default=argparse.SUPPRESS, help=help_text)
    return ap


def parse_config(argv: list[str] | None = None) -> EnvConfig:
    """YAML recipe + flags -> validated config (a bad value exits with a clear message)."""
    ns = build_parser().parse_args(argv)
    values: dict[str, Any] = {}
    if ns.config is not None:
        loaded = yaml.safe_load(Path(ns.config).read_text()) or {}
        if not isinstance(loaded, dict):
            raise SystemExit(f"error: {ns.config} must hold a mapping of option: value")
        values.update({k.replace("-", "_"): v for k, v in loaded.items()})
    for name in EnvConfig.model_fields:
        if name in ns:
            value = getattr(ns, name)
            values[name] = None if isinstance(value, str) and value.lower() == "none" else value
    try:
        return EnvConfig.model_validate(values)
    except ValidationError as e:
        raise SystemExit(f"error: invalid EnvConfig:\n{e}") from None
