"""``ApiClient``: the synchronous httpx client of the batching API (envs and the trainer).

Every call has an explicit timeout. Transient failures are retried under the project's one
retry policy (``api.retry``; docs/FAULT_TOLERANCE.md, "Retry policy"): a refused connection
and 429/502/503/504/507 always (the request was not processed), and read timeouts, dropped
connections or a 500 only for calls that are safe to repeat. A full disk at the API is a
507 (or 503 for an I/O error) that names its cause: nothing was stored, so it is retried like
a 503, each retry logged with the server's reason (docs/FAULT_TOLERANCE.md, "A full disk"). All calls but ``lease`` are
idempotent on the server (``group_id`` dedup, ack of an acked batch is a no-op,
registering/setting a version twice is the same as once); a replayed ``lease`` could lease a
second batch while the first reply was lost, which loses nothing (the first lease expires and
its groups go back) but delays them, so it is retried only when it surely never arrived, and
otherwise raises ``ApiError`` ("not replayed") for the trainer's lease loop to wait out.
A 4xx is the caller's bug and raises ``ApiError`` at once with the server's message.
``give_up_s`` > 0 keeps retrying for that long (each retry is logged), so a service rides out
an API restart (kill -9, upgrade) instead of crashing; otherwise ``retries`` extra tries.
"""

from __future__ import annotations

import gzip
import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import httpx

from api.protocol import (
    AckResponse,
    Backpressure,
    Lease,
    PolicyVersionResponse,
    PushGroupsResponse,
    RegisterEnvResponse,
    RejectResponse,
    ScoredGroup,
    SkipResponse,
    Status,
)
from api.retry import CAP_S, RetryPolicy, is_transient, retry_call

log = logging.getLogger(__name__)

TOKEN_HEADER = "Authorization"
GZIP_MIN_BYTES = 64 * 1024
"""Request bodies at least this large are sent gzip-compressed."""


def bearer(token: str | None) -> dict[str, str]:
    """The header that carries a bearer token (none without one): the API's, or an inference
    server's key. A header, never the URL, which error messages print."""
    return {TOKEN_HEADER: f"Bearer {token}"} if token else {}


class ApiError(RuntimeError):
    """The API answered with an error that retrying will not fix (or retries ran out)."""

    def __init__(self, message: str, status_code: int | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code

    @property
    def transient(self) -> bool:
        """Worth waiting out by a caller that may repeat the call: the failure that caused it
        is transient under the one rule (``api.retry.is_transient``, idempotent)."""
        return self.__cause__ is not None and is_transient(self.__cause__)


class ApiClient:
    """Client of the batching API. Thread-safe (one pooled ``httpx.Client``)."""

    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        timeout: float = 30.0,
        connect_timeout: float = 5.0,
        retries: int = 5,
        backoff: float = 0.5,
        give_up_s: float = 0.0,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        # Transient failures are retried until ``give_up_s`` seconds have passed since the
        # first one (long enough to ride out an API restart) or, without it, ``retries`` times.
        self.policy = RetryPolicy(
            attempts=None if give_up_s > 0 else retries + 1,
            deadline_s=give_up_s if give_up_s > 0 else None,
            base_s=backoff,
            cap_s=max(backoff, CAP_S),
        )
        self._http = httpx.Client(
            base_url=self.base_url,
            headers=bearer(token),
            timeout=httpx.Timeout(timeout, connect=connect_timeout),
        )

    # -- plumbing ------------------------------------------------------------------------

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> ApiClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        params: Mapping[str, Any] | None = None,
        idempotent: bool = True,
    ) -> httpx.Response:
        content, headers = _encode(body)
        what = f"API {method} {path}"
        tries = 0

        def once() -> httpx.Response:
            nonlocal tries
            tries += 1
            r = self._http.request(method, path, content=content, headers=headers, params=params)
            if r.status_code >= 400:  # the server's reason goes into the retry log line
                message = f"HTTP {r.status_code}: {_detail(r)}"
                raise httpx.HTTPStatusError(message, request=r.request, response=r)
            return r

        def retryable(e: BaseException) -> bool:
            return is_transient(e, idempotent)

        try:
            return retry_call(once, what, retryable, self.policy, logger=log)
        except httpx.HTTPStatusError as e:
            r = e.response
            message = f"{method} {path}: HTTP {r.status_code}: {r.text[:2000]}"
            raise ApiError(message, r.status_code) from e
        except httpx.TransportError as e:
            if retryable(e):
                raise ApiError(f"{method} {path}: {e!r} after {tries} tries") from e
            if not idempotent:
                why = "not replayed: the request may have reached the server"
                raise ApiError(f"{method} {path}: {e!r} ({why})") from e
            raise ApiError(f"{method} {path}: {e!r}") from e

    # -- API -----------------------------------------------------------------------------

    def push_groups(self, groups: Sequence[ScoredGroup | Mapping[str, Any]]) -> PushGroupsResponse:
        """Store scored groups (all or none); a repeated ``group_id`` counts as duplicate."""
        body = {"groups": [g.model_dump() if isinstance(g, ScoredGroup) else g for g in groups]}
        return PushGroupsResponse.model_validate_json(
            self._request("POST", "/groups", body=body).content
        )

    def register_env(
        self, name: str, weight: float = 1.0, group_size: int = 1
    ) -> RegisterEnvResponse:
        """Register (or update) an environment's fair-share weight and group size."""
        body = {"name": name, "weight": weight, "group_size": group_size}
        r = self._request("POST", "/envs/register", body=body)
        return RegisterEnvResponse.model_validate_json(r.content)

    def wanted(self, env: str) -> Backpressure:
        """How many groups ``env`` may push now, and the live policy version."""
        r = self._request("GET", "/backpressure", params={"env": env})
        return Backpressure.model_validate_json(r.content)

    def lease(
        self,
        max_tokens: int | None = None,
        max_sequences: int | None = None,
        lease_seconds: float = 300.0,
        allow_partial: bool = False,
    ) -> Lease | None:
        """Lease the next batch, or ``None`` when not enough data is queued yet."""
        body = {
            "max_tokens": max_tokens,
            "max_sequences": max_sequences,
            "lease_seconds": lease_seconds,
            "allow_partial": allow_partial,
        }
        r = self._request("POST", "/batches/lease", body=body, idempotent=False)
        if r.status_code == 204:
            return None
        return Lease.model_validate_json(r.content)

    def ack(self, batch_id: str) -> AckResponse:
        """Mark a leased batch consumed (idempotent)."""
        r = self._request("POST", f"/batches/{batch_id}/ack")
        return AckResponse.model_validate_json(r.content)

    def skip(self, batch_id: str) -> SkipResponse:
        """Mark a leased batch consumed but not trained (idempotent; see ``Store.skip``)."""
        r = self._request("POST", f"/batches/{batch_id}/skip")
        return SkipResponse.model_validate_json(r.content)

    def reject(self, batch_id: str, reasons: dict[str, str]) -> RejectResponse:
        """Refuse some groups of a leased batch (``{group_id: reason}``); idempotent."""
        body = {"groups": [{"group_id": g, "reason": r} for g, r in reasons.items()]}
        r = self._request("POST", f"/batches/{batch_id}/reject", body=body)
        return RejectResponse.model_validate_json(r.content)

    def set_policy_version(self, version: int) -> PolicyVersionResponse:
        """Report the weight version now live; too-stale queued groups are dropped."""
        r = self._request("POST", "/policy_version", body={"version": version})
        return PolicyVersionResponse.model_validate_json(r.content)

    def status(self) -> Status:
        return Status.model_validate_json(self._request("GET", "/status").content)

    def health(self) -> bool:
        """True when the API answers ``/health``; raises ``ApiError`` when it cannot be reached."""
        return self._request("GET", "/health").status_code == 200


def _detail(r: httpx.Response) -> str:
    """The ``detail`` of an error reply (FastAPI's), else its first 300 characters."""
    try:
        detail = r.json().get("detail")
    except (ValueError, AttributeError):
        detail = None
    return str(detail if isinstance(detail, str) else r.text[:300])


def _encode(body: Any) -> tuple[bytes | None, dict[str, str]]:
    if body is None:
        return None, {}
    raw = json.dumps(body, separators=(",", ":"), allow_nan=False).encode()
    headers = {"Content-Type": "application/json"}
    if len(raw) >= GZIP_MIN_BYTES:
        raw = gzip.compress(raw, compresslevel=1)  # level 1: most of the win, little CPU
        headers["Content-Encoding"] = "gzip"
    return raw, headers
