"""The check a service makes of the URLs it was given before it starts working: does each
answer as the service it was given for (the batching API, an OpenAI-compatible inference
server)? ``python -m env_server`` and ``python -m trainer grpo`` run it at start-up."""

from __future__ import annotations

from api.protocol import Health
from settings.ports import API_PORT, VLLM_PORT

API_SERVICE = Health.model_fields["service"].default
"""What the batching API's ``/health`` says it is."""


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

    from api.client import bearer

    path = "/health" if kind == "api" else "/v1/models"
    try:
        r = httpx.get(url.rstrip("/") + path, headers=bearer(token), timeout=timeout)
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
