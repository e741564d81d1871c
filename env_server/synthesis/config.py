"""Options of ``python -m env_server.synthesize`` (docs/SYNTHESIS.md)."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from settings.ports import VLLM_URL

DEFAULT_BASE_URL = f"{VLLM_URL}/v1"
"""The project's vLLM server (``python -m vllm_patching.serve ... --port 9001``)."""


class SynthConfig(BaseModel):
    """Options of ``python -m env_server.synthesize`` (one ``--kebab-case`` flag each)."""

    model_config = ConfigDict(extra="forbid")

    input: Path = Field(description="Rows file (.jsonl/.json/.csv/.parquet) or dataset folder.")
    output: Path = Field(description="Output folder: <split>.jsonl, cache, failures, summary.")
    format: str = Field("auto", description="Input format: auto, rows, shop_r1 or opera.")
    base_url: str = Field(DEFAULT_BASE_URL, description="OpenAI-compatible base URL (with /v1).")
    api_key: str | None = Field(
        None, description="Bearer key for the endpoint (default: $OPENAI_API_KEY, if set)."
    )
    model: str | None = Field(None, description="Model name; default: the first of /models.")
    concurrency: int = Field(4, ge=1, le=256, description="Requests in flight at once.")
    max_retries: int = Field(
        3, ge=0, description="Extra requests per row after a transient error or a bad answer."
    )
    temperature: float = Field(0.7, ge=0, description="Sampling temperature.")
    max_tokens: int = Field(64, ge=1, description="Token budget of one answer.")
    timeout_s: float = Field(120.0, gt=0, description="Timeout of one request (seconds).")
    max_context_chars: int = Field(
        6000, ge=200, description="Characters of the current page's HTML shown to the model."
    )
    max_words: int = Field(40, ge=3, description="Longest accepted rationale (words).")
    lenient: bool = Field(
        False,
        description="Accept any non-empty answer (cleaned, cut to 300 characters) instead of "
        "checking the one-first-person-sentence rule; for tiny test models.",
    )
    overwrite_existing: bool = Field(
        False, description="Also synthesize rows that already have a rationale."
    )
    seed: int = Field(0, description="Seed of the session split of a single input file.")
    val_fraction: float = Field(0.1, ge=0, lt=1, description="Validation share (single file).")
    test_fraction: float = Field(0.1, ge=0, lt=1, description="Test share (single file).")
