"""Who may call what on the patched vLLM server, and the weight version on its replies:
``BridgeMiddleware`` (pure ASGI, streaming-safe) in front of every route, vLLM's and ours.

With a bridge token set, every route but ``OPEN_ROUTES`` needs it (default deny: a route a
future vLLM adds is closed); the versioned inference routes carry ``x-weight-version``; a
server without a weight-transfer engine answers vLLM's weight-transfer routes 400 naming its
mode. ``BridgeState`` is the per-app state the middleware and the /bridge/* routes
(vllm_patching/routes.py) share.
"""

from __future__ import annotations

import asyncio
import json
from argparse import Namespace
from http import HTTPStatus
from typing import Any
from urllib.parse import quote

from starlette.routing import compile_path

from settings.bind import same_secret
from vllm_patching.protocol import TOKEN_HEADER, VERSION_HEADER, BridgeSettings

OPEN_ROUTES: frozenset[tuple[str, str]] = frozenset(
    {
        # inference: vLLM's own --api-key guards them as vLLM does (its /v1, /v2, /inference
        # and /cohere paths), our /generate checks it itself; the bridge token does not
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/chat/completions/batch"),
        ("POST", "/v1/responses"),
        ("GET", "/v1/responses/{response_id}"),
        ("POST", "/v1/responses/{response_id}/cancel"),
        ("POST", "/v1/messages"),
        ("POST", "/v1/messages/count_tokens"),
        ("POST", "/v1/systemone"),
        ("POST", "/v1/chat/completions/render"),
        ("POST", "/v1/completions/render"),
        ("POST", "/v1/messages/render"),
        ("POST", "/v1/responses/render"),
        ("POST", "/v1/chat/completions/derender"),
        ("POST", "/v1/completions/derender"),
        ("GET", "/v1/models"),
        ("POST", "/tokenize"),
        ("POST", "/detokenize"),
        ("POST", "/inference/v1/generate"),
        ("POST", "/generate"),  # Atropos's route (vllm_patching/generate.py)
        # read-only: health, load, metrics, version, docs, the bridge's health and info (the
        # env asks /bridge/info which model name serves the current weights)
        ("GET", "/health"),
        ("GET", "/ping"),
        ("POST", "/ping"),
        ("GET", "/load"),
        ("GET", "/version"),
        ("GET", "/metrics"),
        ("GET", "/metrics/{path:path}"),
        ("GET", "/openapi.json"),
        ("GET", "/docs"),
        ("GET", "/docs/oauth2-redirect"),
        ("GET", "/redoc"),
        ("GET", "/bridge/health"),
        ("GET", "/bridge/info"),
    }
)
"""What answers without the bridge token when one is set: (method, path template). Default
deny: every other route -- vLLM's dev-mode routes (collective_rpc, pause/resume, sleep, the
weight-transfer routes, cache resets, server_info...), its LoRA loading, /bridge/stage, apply,
reload, lora/load, and any route a future vLLM adds, whatever its method, websockets
included -- needs the token. The table in docs/BRIDGE.md lists every route of a server;
tests/integration/vllm_patching/test_vllm_routes_auth.py checks it against this set and the app."""
VERSIONED_PATHS = frozenset(
    {"/v1/completions", "/v1/chat/completions", "/inference/v1/generate", "/generate"}
)
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
_HEADER_SAFE = "".join(chr(c) for c in range(0x20, 0x7F) if chr(c) != "%")
WEIGHT_TRANSFER_PATHS = frozenset(
    {
        "/init_weight_transfer_engine",
        "/start_weight_update",
        "/start_draft_weight_update",
        "/update_weights",
        "/finish_weight_update",
    }
)
"""vLLM's weight-transfer routes: a server without a weight-transfer backend (modes ``none``
and ``lora_only``) answers them 400 naming its mode, where vLLM's handlers fail with 500."""
_OPEN = [(m, compile_path(p)[0]) for m, p in sorted(OPEN_ROUTES)]


class BridgeState:
    """Per-app state of the bridge (on ``app.state.bridge``)."""

    def __init__(self, settings: BridgeSettings) -> None:
        self.settings = settings
        self.engine_client: Any = None
        self.args: Namespace | None = None
        self.version = str(settings.initial_version)
        self.served_model = settings.served_model_name
        self.loras: list[str] = []  # loaded adapter names, oldest first
        self.param_map: dict[str, Any] = {}
        self.tied_embeddings = False
        self.lock = asyncio.Lock()  # one server-orchestrated sync at a time
        self.api_keys: list[bytes] = []  # vLLM's --api-key, hashed (guards /generate)

    async def refresh_version(self) -> None:
        if self.engine_client is not None:
            self.version = str(await self.engine_client.get_weight_version())


def requires_token(method: str, path: str) -> bool:
    """Whether ``method path`` needs the bridge token (when one is set): everything but
    ``OPEN_ROUTES``; HEAD as its GET, OPTIONS where the path has an open route (a CORS
    preflight is answered before this, by vLLM's CORS middleware); ``WEBSOCKET`` for a
    websocket."""
    methods = {"GET"} if method == "HEAD" else {method}
    if method == "OPTIONS":
        methods = {m for m, _ in _OPEN}
    return not any(m in methods and regex.match(path) for m, regex in _OPEN)


def token_ok(headers: dict[str, str], token: str) -> bool:
    given = headers.get(TOKEN_HEADER, "")
    auth = headers.get("authorization", "")
    if not given and auth.lower().startswith("bearer "):
        given = auth[7:]
    return same_secret(given, token)


def route_path(scope) -> str:
    """The path the router matches (``scope["path"]`` less ``root_path``, as starlette)."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


class BridgeMiddleware:
    """Pure ASGI middleware (streaming-safe): token check + version header + version cache."""

    def __init__(self, app, state: BridgeState, token: str | None) -> None:
        self.app = app
        self.state = state
        self.token = token

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "websocket":
            if self.token and requires_token("WEBSOCKET", route_path(scope)):
                headers = {
                    k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]
                }
                if not token_ok(headers, self.token):
                    await send({"type": "websocket.close", "code": 1008})
                    return
            await self.app(scope, receive, send)
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        method, path = scope["method"], scope["path"]
        if self.token and requires_token(method, route_path(scope)):
            headers = {
                k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]
            }
            if not token_ok(headers, self.token):
                await _deny(send)
                return
        if self.state.settings.backend is None and route_path(scope) in WEIGHT_TRANSFER_PATHS:
            mode = self.state.settings.mode
            await _reply(
                send,
                400,
                f"{route_path(scope)}: this server runs bridge mode {mode}, "
                "which has no weight-transfer engine (shared_vllm has one)",
            )
            return
        if method == "POST" and (refusal := await self.not_now(route_path(scope))):
            await _reply(send, *refusal)
            return
        version = self.state.version
        scope.setdefault("state", {})["weight_version"] = version  # a route may report it too
        header = (VERSION_HEADER.encode(), header_value(version))
        status = 0

        async def send_with_version(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                if path in VERSIONED_PATHS:
                    message.setdefault("headers", [])
                    message["headers"] = [*message["headers"], header]
            await send(message)

        try:
            await self.app(scope, receive, send_with_version)
        except RecursionError:
            # vLLM's routes that parse their body with json.loads (collective_rpc,
            # abort_requests, invocations, scale_elastic_ep...) let a body nested deeper than
            # the parser goes escape: a 400, not a dropped connection.
            if status:
                raise
            await _reply(send, 400, "request body nested too deeply to parse")
            return
        if (
            method not in SAFE_METHODS
            and status < 400
            and path
            in {
                "/finish_weight_update",
                "/update_weight_version",
            }
        ):
            await self.state.refresh_version()

    async def not_now(self, path: str) -> tuple[int, str] | None:
        """Two of vLLM's dev-mode routes (token only) whose handlers answer 500 when the
        server is not in the state they need: said as a client error before they run. Their
        own check stays: ``/release_kv_cache_memory`` also needs no kept request (a pause in
        ``keep`` mode with requests in flight still reaches vLLM's 500)."""
        st = self.state
        if path == "/scale_elastic_ep" and not getattr(st.args, "enable_elastic_ep", False):
            return 400, "/scale_elastic_ep: this server was not started with --enable-elastic-ep"
        if path == "/release_kv_cache_memory" and st.engine_client is not None:
            client = st.engine_client
            if not await client.is_paused() or await client.is_sleeping():
                why = "/release_kv_cache_memory needs a paused, awake server: POST /pause first"
                return 409, why
        return None


def header_value(version: str) -> bytes:
    """``version`` as an HTTP field value: printable ASCII as it is, any other character
    percent-encoded. vLLM's /update_weight_version takes any string, and a control character
    in the header made uvicorn drop every reply of the versioned routes."""
    return quote(version, safe=_HEADER_SAFE, errors="surrogatepass").encode("ascii")


async def _deny(send) -> None:
    await _reply(
        send,
        HTTPStatus.UNAUTHORIZED.value,
        "missing or wrong bridge token (header x-shop-r1-bridge-token)",
    )


async def _reply(send, status: int, error: str) -> None:
    body = json.dumps({"error": error}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json")],
        }
    )
    await send({"type": "http.response.body", "body": body})
