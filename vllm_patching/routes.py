"""Endpoint plugin (``vllm.endpoint_plugins``): the /bridge/* routes and Atropos's ``/generate``
(vllm_patching/generate.py), behind the token and version-header middleware
(vllm_patching/middleware.py).

Loaded only in the API-server process, and only when VLLM_PLUGINS names it (serve.py sets
that). Worker-side behaviour lives in the engines and in ``worker_ext.BridgeWorkerExtension``,
which these routes reach through ``engine_client.collective_rpc`` -- the access path vLLM's
plugin contract prescribes.
"""

from __future__ import annotations

import glob
import os
import time
from argparse import Namespace
from typing import Any

from fastapi import APIRouter, FastAPI, HTTPException, Request
from vllm.logger import init_logger

from settings.bind import OPT_OUT_FLAG
from vllm_patching.generate import api_keys
from vllm_patching.generate import router as generate_router
from vllm_patching.middleware import BridgeMiddleware, BridgeState
from vllm_patching.protocol import (
    PLUGIN_NAME,
    SETTINGS_ENV,
    TOKEN_ENV,
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
