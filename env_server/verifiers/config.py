"""Config of ``python -m env_server.verifiers`` (flags through ``settings.cli``, one per field;
environment variables ``SHOP_R1_VERIFIERS__<FIELD>``). No verifiers import here."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from settings import cli
from settings.layers import env_default
from settings.ports import API_URL, VLLM_URL

PROG = "python -m env_server.verifiers"


class VerifiersConfig(BaseModel):
    """A verifiers (v1) environment served to the batching API (docs/VERIFIERS.md)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    env_id: str
    """The environment's taskset id: an installed package (or one on PYTHONPATH) exporting
    a ``vf.Taskset`` subclass, and optionally its ``vf.Env``, via ``__all__`` (the first
    positional argument)."""
    env_args: str | None = None
    """JSON object of the taskset's config fields (its ``vf.TasksetConfig`` subclass)."""
    env_config: str | None = None
    """JSON object merged into the verifiers env config (roles, harness, runtime...)."""
    env_path: list[Path] = Field(default_factory=list)
    """Folders to import the environment from, before the installed packages (an env that is
    not pip-installed into the verifiers virtualenv, e.g. examples/verifiers_envs/NAME)."""
    runtime: str = "subprocess"
    """Runtime of every role whose runtime neither the env nor ``--env-config`` pins."""
    api_url: str = API_URL
    """Batching API the scored groups go to."""
    api_token: str | None = Field(default_factory=env_default("SHOP_R1_API_TOKEN"))
    """Shared token for the API (default: $SHOP_R1_API_TOKEN)."""
    inference_url: str = VLLM_URL
    """Our patched vLLM server, started with ``--enable-scale-out`` (verifiers' train client
    calls its ``/inference/v1/generate``)."""
    model: str | None = None
    """Served model name (default: the server's first model)."""
    tokenizer: str | None = None
    """Tokenizer path for verifiers' renderer (default: the model path the server reports)."""
    renderer: str | None = None
    """JSON ``renderers.RendererConfig`` (e.g. ``{"name": "default", "tool_parser":
    "qwen3"}`` for tool calls on a ChatML model); default: verifiers' choice by model."""
    env_name: str = "verifiers"
    """Name this environment registers under with the API."""
    env_weight: float = Field(1.0, gt=0)
    """Share of the trainer's batches this environment asks for."""
    group_size: int = Field(4, ge=2)
    """Episodes per task (one GRPO group)."""
    max_tokens: int = Field(64, ge=1)
    """Completion budget of each model turn."""
    temperature: float = Field(1.0, ge=0.0)
    """Sampling temperature."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling."""
    sampling: str | None = None
    """JSON object of more sampling parameters, passed to vLLM's generate route with the
    others (verifiers' ``SamplingConfig`` extras), e.g. ``{"stop": ["\\n"]}`` or
    ``{"allowed_token_ids": [...]}``."""
    seed: int = 0
    """Seed of the order tasks are drawn in."""
    concurrency: int = Field(2, ge=1)
    """Groups in flight at once."""
    drop_constant_groups: bool = False
    """Drop groups whose sequences all score the same (no GRPO signal)."""
    max_groups: int | None = Field(None, ge=1)
    """Stop after pushing this many groups (default: run until stopped)."""
    max_consecutive_failures: int = Field(20, ge=1)
    """Give up when this many groups failed and none was pushed."""
    poll_interval_s: float = Field(1.0, gt=0)
    """Wait between backpressure checks."""
    request_timeout_s: float = Field(600.0, gt=0)
    """Timeout of one generate request."""
    reconnect_timeout_s: float = Field(600.0, gt=0)
    """Keep retrying the API this long while it cannot be reached."""
    log_every_s: float = Field(30.0, gt=0)
    """Seconds between progress lines."""
    metrics_path: Path | None = None
    """JSONL file of group statistics and the final summary."""
    record_path: Path | None = None
    """JSONL file of every generate exchange the proxy saw (prompt ids, completion ids,
    logprobs, weight version): what the inference server returned, for audits and tests."""
    summary_path: Path | None = None
    """JSON file the final counters are written to (pushed, refused_<reason>, ...)."""


def parse_config(argv: list[str] | None = None) -> VerifiersConfig:
    """``ENV_ID`` (first positional) then flags; errors exit with a clear message."""
    import sys

    args = list(sys.argv[1:] if argv is None else argv)
    if args and not args[0].startswith("-"):
        args = ["--env-id", args[0], *args[1:]]
    return cli.parse(VerifiersConfig, args, prog=PROG, section="verifiers")
