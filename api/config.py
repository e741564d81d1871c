"""Configuration of the batching API (``python -m api --help`` lists every field as a flag)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from settings import cli
from settings.bind import check_bind
from settings.layers import env_default
from settings.paths import RUNS_DIR
from settings.ports import API_PORT

TOKEN_ENV = "SHOP_R1_API_TOKEN"


class ApiConfig(BaseModel):
    """The batching API: durable queue of scored groups, leased batches, policy versions."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    host: str = "127.0.0.1"
    """Interface to bind. Loopback by default; any other address needs a token (or
    `insecure_no_token`): the API refuses to start otherwise."""
    port: int = Field(API_PORT, ge=0, le=65535)
    """TCP port (settings/ports.py: the default every client expects)."""
    db_path: Path = RUNS_DIR / "api" / "api.sqlite"
    """SQLite database file (WAL mode); everything acknowledged to a client is in it."""
    synchronous: Literal["FULL", "NORMAL"] = "FULL"
    """SQLite `synchronous` pragma. FULL fsyncs the WAL on every commit, so an acknowledged
    group survives power loss too; NORMAL survives a process crash (`kill -9`) but may lose
    the last commits on an OS crash, in exchange for less fsync latency per request."""
    token: str | None = Field(default_factory=env_default(TOKEN_ENV))
    """Shared token required on every route when set: header `Authorization: Bearer <token>` or
    `X-API-Token`, or the capability URL `http://HOST:PORT/t/<token>/...` for clients that send
    no header (atroposlib: its `rollout_server_url`); default: $SHOP_R1_API_TOKEN. Use a
    URL-safe one: `python -c 'import secrets; print(secrets.token_urlsafe(32))'`."""
    insecure_no_token: bool = False
    """Serve on a non-loopback `host` without a token (a trusted private network only; logged
    as INSECURE at start). Without it such a bind refuses to start."""
    min_free_mb: float = Field(64.0, ge=0)
    """Free space (MB) to keep on the database's filesystem: below it pushes are refused with
    HTTP 507 (retryable, nothing stored) and /backpressure asks for 0 groups, while leases and
    acks go on; pushes are taken again once space is back. 0: no reserve (a full disk is
    still answered 507, by SQLite's own error)."""
    max_body_bytes: int = Field(64 * 1024 * 1024, ge=1024)
    """Largest accepted request body, after gzip decompression (larger: HTTP 413)."""
    max_staleness: int = Field(2, ge=0)
    """Groups sampled more than this many policy versions behind the live one are dropped
    (counted per env in /status) instead of being served."""
    default_batch_sequences: int = Field(64, ge=1)
    """Batch size (sequences) assumed by backpressure until the trainer's first lease."""
    env_timeout_s: float = Field(300.0, gt=0)
    """An env not heard from for this long (and with nothing queued) leaves the fair shares."""
    rate_window_s: float = Field(60.0, gt=0)
    """Window of the ingest/serve rates in /status."""
    atropos_lease_seconds: float = Field(600.0, gt=0)
    """A batch served by Atropos `GET /batch` is a lease: if it is not acked within this long
    (see `atropos_ack`), its groups go back to the queue and are served again."""
    atropos_ack: Literal["next_batch", "explicit"] = "next_batch"
    """How an Atropos `GET /batch` batch is acked: by the trainer's next `GET /batch` (what an
    unmodified Atropos trainer gets), or only by `POST /batches/{batch_id}/ack` (trainers
    that ack after training: at-least-once delivery across trainer crashes)."""
    atropos_missing_logprobs: Literal["reject", "zeros"] = "reject"
    """Atropos groups without `inference_logprobs`: reject each such group alone (its index
    and reason in the reply; the rest of the post is stored), or store it as posted (served
    on `GET /batch` with `inference_logprobs: null`, as Atropos does; a native lease gets 0.0
    logprobs and `atropos.inference_logprobs_missing`)."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """Log level of the service and of uvicorn."""


def check_exposure(cfg: ApiConfig) -> str | None:
    """Raises ``settings.bind.UnsafeBind`` (exit 1, the fix in the message) for a non-loopback
    ``host`` without a token or the opt-out; the INSECURE warning to log under the opt-out."""
    how = f"--token T or ${TOKEN_ENV}"
    return check_bind("the batching API", cfg.host, bool(cfg.token), cfg.insecure_no_token, how)


def build_parser() -> argparse.ArgumentParser:
    """``--config``/``--print-config`` and one flag per :class:`ApiConfig` field."""
    ap = argparse.ArgumentParser(prog="python -m api", description=ApiConfig.__doc__)
    cli.add_config_flags(ap, ApiConfig)
    return ap


def parse_config(argv: list[str] | None = None) -> ApiConfig:
    """File (``--config``) < env vars < flags, validated (a bad value exits with a clear
    message; ``--print-config`` prints the result and exits)."""
    return cli.parse(ApiConfig, argv, prog="python -m api", section="api")
