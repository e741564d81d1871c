"""Config of the environment service and its command line (``settings.cli``).

A run file (``--config``, alias ``--recipe``: its shortcuts and ``env:`` section;
docs/RECIPES.md), environment variables, then flags; one ``--kebab-case`` flag per field, whose
help is the field's docstring. No torch here: ``--help`` and config errors are instant.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, model_validator

from env_server.reward import RewardConfig, RewardSpec
from settings import cli
from settings.layers import Negated, env_default
from settings.paths import DATA_DIR
from settings.ports import API_URL, VLLM_URL

TOKEN_ENV = "SHOP_R1_API_TOKEN"
DEFAULT_MAX_PROMPT_TOKENS = 928
"""Default prompt budget of rollouts and evaluation, fitted to the embedded tiny model: its SFT
trains on sequences of 1024 tokens (``SftConfig.max_seq_len``), so a 928-token prompt and a
96-token completion stay inside the positions it has learned. A prompt longer than the SFT's
sequences puts the model on positions it never saw (measured on the 450-step tiny SFT model,
512 test rows: valid format 85.5% and mean reward 6.5 at a 1536-token budget vs 98.0% and
45.7 at 928). Hub models with a long trained context get more (the GPU recipes use 3072)."""


class EnvConfig(BaseModel):
    """The Shop-R1 environment service."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    shortcuts: ClassVar[dict[str, str | Negated]] = {
        "model": "tokenizer",
        "seed": "seed",
        "num_sessions": "num_sessions",
        "episode": "episode",
        "keep_constant_groups": Negated("drop_constant_groups"),
    }
    """A run's top-level keys that fill these fields (``settings.layers.Rules``)."""
    one_of: ClassVar[tuple[frozenset[str], ...]] = (
        frozenset({"rewards", "reward", "reward_variant"}),
    )
    """The three ways to give the reward: a layer that uses one of them drops what a lower
    layer gave through another."""
    whole: ClassVar[frozenset[str]] = frozenset({"rewards"})
    """A layer's ``rewards:`` replaces a lower layer's whole (entries are not merged)."""

    api_url: str = API_URL
    """Batching API the scored groups go to."""
    api_token: str | None = Field(default_factory=env_default(TOKEN_ENV))
    """Shared token for the API's mutating routes (default: $SHOP_R1_API_TOKEN)."""
    inference_url: str = VLLM_URL
    """OpenAI-compatible inference server (vLLM) the completions come from; several servers:
    comma-separated URLs, ``--inference-url A,B`` (each rollout goes to the least-loaded one)."""
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
    num_sessions: int | None = Field(None, ge=10)
    """Sessions of the simulated dataset: built with this many when ``data_dir`` has none
    (unset: settings.paths.NUM_SESSIONS, 3000); set, a dataset of another size there is an
    error naming both (env_server/data/dataset.py)."""
    seed: int = 0
    """Seed of the order prompts are drawn in (not of the dataset, built with
    ``settings.paths.DATA_SEED``: another seed trains on the same rows and is evaluated on the
    same held-out ones; ``python -m env_server.data build --seed`` builds another dataset)."""
    group_size: int = Field(8, ge=2)
    """Completions sampled per prompt (a GRPO group)."""
    max_prompt_tokens: int = Field(DEFAULT_MAX_PROMPT_TOKENS, ge=64)
    """Prompt budget in tokens: the oldest pages are dropped first to fit (the prompt says so).
    Keep prompt + completion within the context the model was trained on (the SFT's
    ``max_seq_len``); the default suits the embedded tiny model."""
    max_tokens: int = Field(160, ge=8)
    """Completion budget in tokens (a target is ~45-75 tokens with the Shop-R1 tokenizer)."""
    temperature: float = Field(1.0, ge=0.0)
    """Sampling temperature for rollouts."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling for rollouts."""
    latest_only: bool = False
    """Show only the current page (paper Table 5 ablation) instead of the whole session."""
    episode: Literal["step", "session"] = "step"
    """``step``: each step its own prompt holding the session so far; ``session``: the session
    as one conversation (each page a user turn, each rationale + action an assistant turn),
    its steps drawn one after another so they share their history (env_server/sessions.py).
    The model must have been trained (SFT) in the same form."""

    row_mix: Literal["natural", "balanced"] = "natural"
    """Which train rows GRPO samples: ``natural``, the split's rows in a seeded order (its mix
    of gold action types); ``balanced``, each gold action type equally often (the rarer
    types' rows come back sooner). Steps only (docs/results/grpo_row_mix.md)."""

    @model_validator(mode="after")
    def _one_page_or_session(self) -> EnvConfig:
        if self.latest_only and self.episode == "session":
            raise ValueError("latest_only shows one page; it does not apply to episode: session")
        if self.row_mix != "natural" and self.episode == "session":
            raise ValueError(
                "row_mix: balanced deals steps; a session holds steps of every type, so it "
                "does not apply to episode: session"
            )
        return self

    reward_variant: Literal["full", "binary", "no_dars", "no_format"] = "full"
    """Reward preset: the paper's reward or one of its ablations (the same ablations ship as
    recipes; a recipe's ``rewards:`` section is the general form)."""
    reward: RewardConfig | None = None
    """Flat form of every Table-1 constant (recipe/config only); overrides ``reward_variant``."""
    rewards: RewardSpec | None = None
    """The reward as registry entries with weights (a recipe's ``rewards:`` section;
    env_server/reward/registry.py lists the entries). Excludes ``reward`` and ``reward_variant``."""
    concurrency: int = Field(4, ge=1)
    """Prompts in flight at once (each asks for ``group_size`` completions)."""
    drop_constant_groups: bool = True
    """Drop groups whose completions all score the same (no GRPO signal)."""
    score_ramp: float = Field(0.0, ge=0.0)
    """Testing only: add ``i x score_ramp`` to the score of each group's i-th completion
    (recorded as its ``score_ramp`` reward term), so no group's scores are all equal whatever
    the model samples: a GRPO signal by construction, for tests whose weights must move on a
    model whose rollouts all score 0 (tests/integration/launch/test_launch_fsdp.py). 0: the reward."""
    lockstep_groups: int | None = Field(None, ge=1)
    """Reproducible sampling (``launch/run_all.sh --reproducible`` sets it to the trainer's
    batch in groups): push exactly this many groups per policy version, sampled only once that
    version is live (again after a batch the trainer skipped), in the order drawn. With every
    rollout's own seed (``seed`` and its draw number), one seed then trains on the same groups
    (env_server/lockstep.py). Unset: sample ahead as the API's backpressure allows."""
    poll_interval_s: float = Field(1.0, gt=0.0)
    """Wait between backpressure checks while the API wants nothing."""
    request_timeout_s: float = Field(300.0, gt=0.0)
    """Timeout of one completions request (CPU generation is slow)."""
    reconnect_timeout_s: float = Field(600.0, gt=0.0)
    """Keep retrying the API or the inference server this long while it cannot be reached (a
    restart), logging every retry, before the call fails."""
    max_groups: int | None = None
    """Stop after pushing this many groups (default: run until stopped)."""
    max_consecutive_failures: int = Field(50, ge=1)
    """Give up after this many rollouts in a row fail with a non-transient error."""
    eval_every_groups: int = Field(0, ge=0)
    """Evaluate greedily on the validation split every N pushed groups (0: never)."""
    eval_samples: int = Field(
        64, ge=1, validation_alias=AliasChoices("eval_samples", "max_eval_samples")
    )
    """Validation steps per periodic evaluation (also ``--max-eval-samples``)."""
    metrics_path: Path | None = None
    """JSONL file for group statistics and evaluation results (default: log only)."""
    log_every_s: float = Field(30.0, gt=0.0)
    """Seconds between progress lines in the log."""

    @model_validator(mode="after")
    def _one_reward(self) -> EnvConfig:
        if self.rewards is not None and (self.reward is not None or self.reward_variant != "full"):
            raise ValueError(
                "give the reward once: 'rewards' (registry entries) or 'reward'/'reward_variant'"
            )
        return self

    def reward_config(self) -> RewardConfig | RewardSpec:
        """What ``env_server.reward.score`` gets: ``rewards``, else ``reward``, else the preset."""
        return self.rewards or self.reward or RewardConfig.variant(self.reward_variant)

    def inference_urls(self) -> list[str]:
        """The inference servers of ``inference_url`` (comma-separated)."""
        return [u.strip() for u in self.inference_url.split(",") if u.strip()]


def build_parser() -> argparse.ArgumentParser:
    """``--recipe``/``--config``/``--print-config`` and one flag per :class:`EnvConfig` field."""
    ap = argparse.ArgumentParser(prog="python -m env_server", description=EnvConfig.__doc__)
    cli.add_config_flags(ap, EnvConfig)
    return ap


def parse_config(argv: list[str] | None = None) -> EnvConfig:
    """File (``--config``) < env vars < flags, validated (a bad value exits with a clear
    message; ``--print-config`` prints the result and exits)."""
    return cli.parse(EnvConfig, argv, prog="python -m env_server", section="env")
