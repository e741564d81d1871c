"""Endpoint plugin (``vllm.endpoint_plugins``): /bridge/* routes, token auth, version header,
and Atropos's ``/generate`` (vllm_patching/generate.py).

Loaded only in the API-server process, and only when VLLM_PLUGINS names it (serve.py sets
that). Worker-side behaviour lives in the engines and in ``worker_ext.BridgeWorkerExtension``,
which these routes reach through ``engine_client.collective_rpc`` -- the access path vLLM's
plugin contract prescribes.
"""

from __future__ import annotations

import asyncio
import glob
import json
import os
import time
from argparse import Namespace
from http import HTTPStatus
from typing import Any
from urllib.parse import quote

from fastapi import APIRouter, FastAPI, HTTPException, Request
from starlette.routing import compile_path
from vllm.logger import init_logger

from settings.bind import OPT_OUT_FLAG, same_secret
from vllm_patching.generate import api_keys
from vllm_patching.generate import router as generate_router
from vllm_patching.protocol import (
    PLUGIN_NAME,
    SETTINGS_ENV,
    TOKEN_ENV,
    TOKEN_HEADER,
    VERSION_HEADER,
    ApplyRequest,
    BridgeInfo,
    BridgeSettings,
    LoraLoadRequest,
    ParamEntry,
    ReloadRequest,
    StageRequest,
    SyncResult,
)

logger = init_logger("vllm.shop_r1_bridge.routes")

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


def load_settings() -> BridgeSettings:
    raw = os.environ.get(SETTINGS_ENV)
    if not raw:
        raise RuntimeError(
            f"{SETTINGS_ENV} is not set: start the server with `python -m vllm_patching.serve`"
        )
    return BridgeSettings.model_validate_json(raw)


router = APIRouter(prefix="/bridge")


def _state(request: Request) -> BridgeState:
    return request.app.state.bridge


@router.get("/health")
async def health(request: Request) -> dict[str, Any]:
    st = _state(request)
    return {
        "status": "ok",
        "mode": st.settings.mode,
        "weight_version": st.version,
        "run_id": st.settings.run_id,
    }


@router.get("/info", response_model=BridgeInfo)
async def info(request: Request) -> BridgeInfo:
    st = _state(request)
    await st.refresh_version()
    vcfg = st.engine_client.vllm_config
    return BridgeInfo(
        mode=st.settings.mode,
        single_copy=st.settings.single_copy,
        backend=st.settings.backend,
        device=st.settings.device,
        weight_version=st.version,
        world_size=vcfg.parallel_config.world_size_across_dp,
        dtype=str(vcfg.model_config.dtype).removeprefix("torch."),
        model=str(vcfg.model_config.model),
        served_model=st.served_model,
        tied_embeddings=st.tied_embeddings,
        param_map={k: ParamEntry(**v) for k, v in st.param_map.items()},
        run_id=st.settings.run_id,
        pid=os.getpid(),
    )


async def _paused(
    st: BridgeState, work, timings: dict[str, float] | None = None
) -> tuple[Any, float]:
    """Run ``work()`` with the scheduler frozen; in-flight requests resume afterwards.

    ``keep`` freezes running requests instead of aborting them; ``clear_cache`` drops the
    prefix/KV cache, so frozen requests are recomputed with the new weights on resume.
    ``timings`` (if given) receives ``pause_s`` (incl. the cache reset) and ``resume_s``.
    """
    engine = st.engine_client
    t0 = time.perf_counter()
    core = getattr(engine, "engine_core", None)
    if hasattr(core, "pause_scheduler_async"):
        # AsyncLLM.pause_generation is this call plus a 20 ms courtesy sleep (and an MM
        # cache clear for multimodal models); the sleep would be a third of our stall.
        renderer = getattr(engine, "renderer", None)
        if renderer is not None and hasattr(renderer, "clear_mm_cache_async"):
            await renderer.clear_mm_cache_async()
        await core.pause_scheduler_async(mode="keep", clear_cache=True)
    else:
        await engine.pause_generation(mode="keep", clear_cache=True)
    t1 = time.perf_counter()
    try:
        result = await work()
    finally:
        t2 = time.perf_counter()
        await engine.resume_generation()
    t3 = time.perf_counter()
    if timings is not None:
        timings.update(pause_s=t1 - t0, resume_s=t3 - t2)
    return result, t3 - t0


def _check_run(st: BridgeState, run_id: str | None) -> None:
    if st.settings.mode != "shared_vllm":
        raise HTTPException(400, f"this route is for shared_vllm, server runs {st.settings.mode}")
    if run_id is not None and run_id != st.settings.run_id:
        # The trainer's transfer (gloo group, segment) belongs to another run of this server.
        raise HTTPException(
            409, f"server restarted: run_id is {st.settings.run_id}, trainer has {run_id}"
        )


@router.post("/stage")
async def stage(request: Request, body: StageRequest) -> dict[str, Any]:
    """start_weight_update + update_weights in one call: the workers' updater threads start
    receiving while generation goes on (one HTTP call and one collective_rpc)."""
    st = _state(request)
    _check_run(st, body.run_id)
    t0 = time.perf_counter()
    await st.engine_client.collective_rpc("bridge_stage", kwargs={"update_info": body.update_info})
    return {"stage_rpc_s": time.perf_counter() - t0}


@router.post("/apply", response_model=SyncResult)
async def apply(request: Request, body: ApplyRequest) -> SyncResult:
    """pause -> [stage] -> finish_weight_update -> version -> resume, in one call.

    The native protocol's steps, with one collective_rpc inside the pause (the apply, which
    also returns the workers' timings) instead of separate finish / timings / version rpcs;
    the resume is in a ``finally``.
    """
    st = _state(request)
    _check_run(st, body.run_id)
    async with st.lock:
        timings: dict[str, float] = {}

        async def work():
            t = time.perf_counter()
            if body.update_info is None:
                workers = await st.engine_client.collective_rpc("bridge_finish")
            else:
                workers = await st.engine_client.collective_rpc(
                    "bridge_update", kwargs={"update_info": body.update_info}
                )
            t1 = time.perf_counter()
            await st.engine_client.update_weight_version(str(body.version))
            # Before the resume: requests that arrived during the pause run on the new weights.
            st.version = str(body.version)
            timings.update(apply_rpc_s=t1 - t, version_s=time.perf_counter() - t1)
            return workers

        workers, stall = await _paused(st, work, timings)
    return SyncResult(
        weight_version=st.version,
        served_model=st.served_model,
        stall_s=stall,
        detail={"workers": workers, **timings},
    )


@router.post("/reload", response_model=SyncResult)
async def reload(request: Request, body: ReloadRequest) -> SyncResult:
    st = _state(request)
    if st.settings.mode != "none":
        raise HTTPException(400, f"/bridge/reload is for mode none, server runs {st.settings.mode}")
    if not os.path.isdir(body.path):
        raise HTTPException(400, f"no such checkpoint folder: {body.path}")
    if not glob.glob(os.path.join(glob.escape(body.path), "*.safetensors")):
        raise HTTPException(400, f"no *.safetensors in the checkpoint folder {body.path}")
    async with st.lock:

        async def work():
            res = await st.engine_client.collective_rpc(
                "bridge_reload_from_path", kwargs={"path": body.path}
            )
            failed = [r["error"] for r in res if "error" in r]
            if not failed:
                await st.engine_client.update_weight_version(str(body.version))
            return res, failed

        (detail, failed), stall = await _paused(st, work)
        await st.refresh_version()
    if failed:
        # The checkpoint's content (an unreadable file, a name or shape the model lacks): the
        # client's to fix. Layers loaded whole before the failure keep their new weights.
        raise HTTPException(
            422,
            f"checkpoint {body.path} could not be loaded: {failed[0]}; weight_version stays "
            f"{st.version}, reload a checkpoint that fits this model",
        )
    return SyncResult(
        weight_version=st.version,
        served_model=st.served_model,
        stall_s=stall,
        detail={"workers": detail},
    )


@router.post("/lora/load", response_model=SyncResult)
async def lora_load(request: Request, body: LoraLoadRequest) -> SyncResult:
    from vllm.entrypoints.serve.engine.protocol import ErrorResponse
    from vllm.entrypoints.serve.lora.protocol import (
        LoadLoRAAdapterRequest,
        UnloadLoRAAdapterRequest,
    )

    st = _state(request)
    if st.settings.mode != "lora_only":
        raise HTTPException(
            400, f"/bridge/lora/load is for lora_only, server runs {st.settings.mode}"
        )
    models = request.app.state.openai_serving_models
    name = f"{st.settings.served_model_name}-v{body.version}"
    async with st.lock:
        t0 = time.perf_counter()
        # Loading a new name needs no pause: requests already running keep their adapter,
        # new requests name the new one. Only the version label switches atomically.
        res = await models.load_lora_adapter(
            LoadLoRAAdapterRequest(lora_name=name, lora_path=body.path)
        )
        if isinstance(res, ErrorResponse):
            raise HTTPException(res.error.code, res.error.message)
        await st.engine_client.update_weight_version(str(body.version))
        st.served_model = name
        if name in st.loras:
            st.loras.remove(name)
        st.loras.append(name)
        while len(st.loras) > st.settings.lora_keep:
            old = st.loras.pop(0)
            await models.unload_lora_adapter(UnloadLoRAAdapterRequest(lora_name=old))
        await st.refresh_version()
        stall = time.perf_counter() - t0
    return SyncResult(
        weight_version=st.version,
        served_model=st.served_model,
        stall_s=0.0,
        detail={"load_s": stall, "loaded": list(st.loras)},
    )


class BridgeEndpointPlugin:
    """The ``vllm.endpoint_plugins`` entry point (factory = this class)."""

    name = PLUGIN_NAME
    required_tasks = ("generate",)

    def __init__(self) -> None:
        self.settings = load_settings()
        self.state = BridgeState(self.settings)

    def attach_router(self, app: FastAPI) -> None:
        token = os.environ.get(TOKEN_ENV) or None
        if token is None and self.settings.insecure_no_token:
            logger.warning(
                "INSECURE (%s): %s is not set: every route of this server, weight updates and "
                "collective_rpc included, is open to anyone who can reach it",
                OPT_OUT_FLAG,
                TOKEN_ENV,
            )
        elif token is None:
            logger.warning(
                "%s is not set: the weight and dev-mode routes are NOT protected (served on "
                "loopback only: python -m vllm_patching.serve refuses any other address "
                "without it)",
                TOKEN_ENV,
            )
        app.state.bridge = self.state
        app.include_router(router)
        app.include_router(generate_router)
        app.add_middleware(BridgeMiddleware, state=self.state, token=token)

    async def init_state(self, engine_client, state, args: Namespace) -> None:
        st = self.state
        st.engine_client = engine_client
        st.args = args
        st.api_keys = api_keys(args)
        if engine_client is None:
            return
        maps = await engine_client.collective_rpc("bridge_param_map")
        st.param_map = maps[0]["params"]
        st.tied_embeddings = bool(maps[0]["tied_embeddings"])
        await engine_client.update_weight_version(str(self.settings.initial_version))
        await st.refresh_version()
        logger.info(
            "shop-r1 bridge ready: mode=%s backend=%s version=%s",
            st.settings.mode,
            st.settings.backend,
            st.version,
        )
