"""HTTP client of one patched vLLM server (control plane of the bridge)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import httpx

from api.retry import RetryPolicy, is_transient, retry_call
from trainer.bridge.deadline import current_deadline
from vllm_patching.protocol import TOKEN_HEADER

log = logging.getLogger(__name__)


class BridgeHTTPError(httpx.HTTPStatusError):
    """A bridge/dev route answered with an error status (``status``: the HTTP code).

    An ``httpx.HTTPStatusError``, so ``api.retry.is_transient`` judges it like any other
    answer (a 503 was not processed; a 500 may have been)."""

    @property
    def status(self) -> int:
        return self.response.status_code


def never_sent(exc: BaseException) -> bool:
    """The one transient rule for a request that is not safe to repeat: only a failure that
    proves the server did not process it (``api.retry.is_transient``, ``idempotent=False``)."""
    return is_transient(exc, idempotent=False)


class ServerClient:
    """Calls one server's weight routes with the shared token.

    Every request retries under the project's retry policy (``api.retry``), ``retries``
    extra tries at most. By default only what provably did not reach the server is retried
    (a refused connection, 429/502/503/504/507): the weight routes are not idempotent, so a
    timeout or a 500 is raised, never replayed. A caller whose request is safe to repeat
    passes its own ``retryable`` (``request(..., retryable=...)``).
    """

    def __init__(
        self, base_url: str, token: str | None = None, timeout: float = 600.0, retries: int = 3
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.token, self.timeout = token, timeout
        headers = {TOKEN_HEADER: token} if token else {}
        self.http = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout)
        self.policy = RetryPolicy(attempts=retries + 1)

    def request(
        self,
        method: str,
        path: str,
        retryable: Callable[[BaseException], bool] = never_sent,
        **kw: Any,
    ) -> httpx.Response:
        deadline = current_deadline()  # in a sync's phase: its deadline bounds the request
        if deadline is not None:
            kw.setdefault("timeout", deadline)

        def once() -> httpx.Response:
            r = self.http.request(method, path, **kw)
            if r.status_code >= 400:
                raise BridgeHTTPError(
                    f"{method} {self.base_url}{path} -> {r.status_code}: {r.text[:500]}",
                    request=r.request,
                    response=r,
                )
            return r

        what = f"{method} {self.base_url}{path}"
        return retry_call(once, what, retryable, self.policy, logger=log)

    def post(self, path: str, json: Any = None, **kw: Any) -> httpx.Response:
        return self.request("POST", path, json=json, **kw)

    def info(self) -> dict[str, Any]:
        return self.request("GET", "/bridge/info").json()

    def health(self) -> dict[str, Any]:
        """``{"status", "mode", "weight_version", "run_id"}``; a new run_id = a restart."""
        return self.request("GET", "/bridge/health").json()

    def start_weight_update(self) -> None:
        """Native ``/start_weight_update``, recovering a worker left "active" by a failed
        sync (finish with nothing staged is a no-op in our engines and clears the flag)."""
        try:
            self.post("/start_weight_update")
        except BridgeHTTPError as e:
            if "already active" not in str(e):
                raise
            self.post("/finish_weight_update")
            self.post("/start_weight_update")

    # -- the native RL weight protocol (VLLM_SERVER_DEV_MODE routes) -----------------------
    def pause(self) -> None:
        # keep: freeze in-flight requests (they finish after resume, recomputed on the new
        # weights because clear_cache drops their KV/prefix cache).
        self.post("/pause", params={"mode": "keep", "clear_cache": "true"})

    def close(self) -> None:
        self.http.close()
