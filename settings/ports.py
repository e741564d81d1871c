"""The one set of default ports every service and client agrees on, and ``free_port``.

``launch/run_all.sh`` picks free ports for its own run and hands every service the URLs of
the others (docs/RECIPES.md); these defaults are what a service started by hand listens on
and what its clients look for. The API's matches Atropos' ``run-api`` (8000), the inference
server's the Atropos example trainer's (9001), so an Atropos trainer or environment finds them.
"""

from __future__ import annotations

import socket

HOST = "127.0.0.1"
API_PORT = 8000
"""The batching API (``python -m api``); Atropos' ``run-api`` default."""
VLLM_PORT = 9001
"""The patched vLLM server (``python -m vllm_patching.serve``; vLLM's own default would be
8000, the API's: the wrapper passes ``--port 9001`` unless told otherwise)."""
API_URL = f"http://{HOST}:{API_PORT}"
VLLM_URL = f"http://{HOST}:{VLLM_PORT}"


def free_port(host: str = HOST) -> int:
    """Ask the kernel for a free TCP port on ``host``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


API_SERVICE = "shop-r1-api"
"""What the batching API's ``/health`` says it is (``api.protocol.Health.service``)."""


class WrongService(SystemExit):
    """A URL answers, but not as the service it was given for."""

    def __init__(self, message: str) -> None:
        super().__init__(f"error: {message}")


def check_service(url: str, kind: str, token: str | None = None, timeout: float = 5.0) -> None:
    """Raise :class:`WrongService` when ``url`` answers as something that is not a ``kind``
    service (``api``: our batching API; ``inference``: an OpenAI-compatible server).

    Only a positive answer counts: a URL that does not answer, asks for credentials (401/403)
    or fails (5xx) passes, and the caller's own calls and retries deal with it (a service that
    is still starting, a token the check does not know). ``token``: sent as a bearer token."""
    import httpx

    path = "/health" if kind == "api" else "/v1/models"
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        r = httpx.get(url.rstrip("/") + path, headers=headers, timeout=timeout)
    except httpx.HTTPError:
        return
    if r.status_code in (401, 403) or r.status_code >= 500:
        return
    body: object = None
    try:
        body = r.json()
    except ValueError:
        pass
    if kind == "api":
        if isinstance(body, dict) and body.get("service") == API_SERVICE:
            return
        raise WrongService(
            f"{url} answers, but it is not the batching API (its /health said "
            f"{r.status_code} {r.text[:80]!r}; the API says service={API_SERVICE!r}). Is it an "
            f"inference server? The API listens on port {API_PORT} by default, vLLM on "
            f"{VLLM_PORT} (settings/ports.py)."
        )
    if r.status_code == 200 and isinstance(body, dict) and "data" in body:
        return
    raise WrongService(
        f"{url} answers, but it is not an OpenAI-compatible inference server (GET /v1/models: "
        f"{r.status_code}). vLLM listens on port {VLLM_PORT} by default, the API on "
        f"{API_PORT} (settings/ports.py)."
    )


def check_services(api_url: str, inference_urls: list[str], token: str | None = None) -> None:
    """A service's start-up check of what it talks to: the API at ``api_url`` (sent
    ``token``) and every inference server (:func:`check_service` for each)."""
    check_service(api_url, "api", token)
    for url in inference_urls:
        check_service(url, "inference")
