"""HTTP client of one patched vLLM server (control plane of the bridge)."""

from __future__ import annotations

import time
from typing import Any

import httpx

from vllm_patching.protocol import TOKEN_HEADER


class BridgeHTTPError(RuntimeError):
    """A bridge/dev route answered with an error status (``status``: the HTTP code)."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


class ServerClient:
    """Calls one server's weight routes with the shared token.

    Retries only when the request provably did not reach the server (connect errors): the
    weight routes are not idempotent, so a timeout or a 5xx is raised, never replayed.
    """

    def __init__(
        self, base_url: str, token: str | None = None, timeout: float = 600.0, retries: int = 3
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.token, self.timeout = token, timeout
        headers = {TOKEN_HEADER: token} if token else {}
        self.http = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout)
        self.retries = retries

    def request(self, method: str, path: str, **kw: Any) -> httpx.Response:
        for attempt in range(self.retries + 1):
            try:
                r = self.http.request(method, path, **kw)
            except httpx.ConnectError:
                if attempt == self.retries:
                    raise
                time.sleep(0.5 * 2**attempt)
                continue
            if r.status_code >= 400:
                raise BridgeHTTPError(
                    f"{method} {self.base_url}{path} -> {r.status_code}: {r.text[:500]}",
                    r.status_code,
                )
            return r
        raise AssertionError("unreachable")

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
