"""Bad requests to the patched vLLM server's own routes answer 4xx, never 5xx (what fuzzing
both servers found, tests/integration/test_fuzz_servers.py): the bridge's routes and
middleware in process, on a stand-in engine client."""

from __future__ import annotations

import asyncio
import json
from argparse import Namespace
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, HTTPException, Request

from vllm_patching.generate import check_plain, sampling_params
from vllm_patching.generate import router as generate_router
from vllm_patching.middleware import BridgeMiddleware, BridgeState, header_value
from vllm_patching.protocol import TOKEN_HEADER, VERSION_HEADER, BridgeSettings
from vllm_patching.routes import router

pytestmark = pytest.mark.unit
TOKEN = "t0ken"


class Engine:
    """What the routes use of vLLM's engine client; ``collective_rpc`` answers ``reply``."""

    def __init__(self, reply: dict[str, Any]) -> None:
        self.reply, self.rpcs, self.version = reply, [], "0"

    async def collective_rpc(self, method: str, kwargs: dict | None = None) -> list[dict]:
        self.rpcs.append(method)
        return [self.reply]

    async def update_weight_version(self, version: str) -> None:
        self.version = version

    async def get_weight_version(self) -> str:
        return self.version

    async def pause_generation(self, **_: Any) -> None:
        pass

    async def resume_generation(self) -> None:
        pass

    paused = sleeping = False

    async def is_paused(self) -> bool:
        return self.paused

    async def is_sleeping(self) -> bool:
        return self.sleeping


def app_for(mode: str, backend: str | None, engine: Engine | None = None) -> FastAPI:
    """Our routes and middleware as the plugin attaches them (no vLLM app around them)."""
    settings = BridgeSettings(
        mode=mode, backend=backend, run_id="r", config_path="/x", served_model_name="tiny"
    )
    st = BridgeState(settings)
    st.engine_client = engine
    app = FastAPI()
    app.state.bridge = st
    app.include_router(router)
    app.include_router(generate_router)
    app.add_middleware(BridgeMiddleware, state=st, token=TOKEN)

    @app.post("/update_weights")
    async def update_weights() -> dict[str, str]:  # stands in for vLLM's dev-mode route
        return {"reached": "vllm"}

    @app.post("/release_kv_cache_memory")
    @app.post("/scale_elastic_ep")
    async def dev_state_route() -> dict[str, str]:  # vLLM's: 500 in the wrong state
        return {"reached": "vllm"}

    @app.post("/collective_rpc")
    async def collective_rpc(request: Request) -> dict[str, str]:  # as vLLM's parses it
        return {"method": json.loads(await request.body())["method"]}

    return app


def post(app: FastAPI, path: str, content: bytes | str, token: bool = True) -> httpx.Response:
    async def run() -> httpx.Response:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            headers = {"content-type": "application/json"}
            if token:
                headers[TOKEN_HEADER] = TOKEN
            return await c.post(path, content=content, headers=headers)

    return asyncio.run(run())


def test_sampling_fields_of_the_wrong_type_or_size_are_400() -> None:
    """What reached vLLM's engine and failed there (500): a logit_bias key that is no token
    id, a non-string bad word, integers beyond 64 bits (msgpack), a lone surrogate."""
    for body in [
        {"logit_bias": {"abc": 1.0}},
        {"bad_words": [5]},
        {"seed": 2**100},
        {"top_k": 2**70},
        {"stop_token_ids": [2**64]},
        {"temperature": "hot"},
        {"stop": ["\ud800"]},
    ]:
        with pytest.raises(HTTPException) as e:
            sampling_params(body)
        assert e.value.status_code == 400, body
    params = sampling_params({"logit_bias": {"5": 1.5}, "seed": 2**63 - 1, "temperature": 1})
    assert params.logit_bias == {5: 1.5} and params.seed == 2**63 - 1
    assert params.temperature == 1.0


def test_check_plain_walks_any_depth() -> None:
    deep: list = []
    for _ in range(5000):  # deeper than Python's recursion limit
        deep = [deep]
    check_plain(deep)
    check_plain({"k": [1, -(2**63), "text", {"5": None}]})
    with pytest.raises(ValueError, match="64 bits"):
        check_plain({2**64: 1})
    with pytest.raises(ValueError, match="Unicode"):
        check_plain([[["\udfff"]]])


def test_generate_refuses_deep_json_and_surrogate_prompts_before_the_engine() -> None:
    app = app_for("none", None, engine=None)  # the engine is never reached
    deep = "[" * 100_000 + "]" * 100_000
    assert post(app, "/generate", deep).status_code == 400
    r = post(app, "/generate", '{"prompt": "\\ud800", "max_tokens": 2}')
    assert r.status_code == 400 and "Unicode" in r.text
    r = post(app, "/generate", '{"prompt": {"prompt_token_ids": [18446744073709551616]}}')
    assert r.status_code == 400 and "64 bits" in r.text


def test_reload_of_a_folder_without_safetensors_is_400_and_pauses_nothing(
    tmp_path: Path,
) -> None:
    engine = Engine({"tensors": 1.0})
    r = post(
        app_for("none", None, engine), "/bridge/reload", f'{{"path": "{tmp_path}", "version": 3}}'
    )
    assert r.status_code == 400 and "no *.safetensors" in r.text
    assert engine.rpcs == [] and engine.version == "0"


def test_a_checkpoint_the_model_cannot_load_is_422_and_keeps_the_version(tmp_path: Path) -> None:
    """The worker reports the failure (across collective_rpc every exception is a bare one):
    422 naming it, the version unchanged; a loadable one still answers 200 as before."""
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    body = f'{{"path": "{tmp_path}", "version": 3}}'
    bad = Engine({"error": "SafetensorError: header too small"})
    r = post(app_for("none", None, bad), "/bridge/reload", body)
    assert r.status_code == 422 and "header too small" in r.text, r.text
    assert bad.rpcs == ["bridge_reload_from_path"] and bad.version == "0"
    good = Engine({"tensors": 50.0, "apply_s": 0.1})
    r = post(app_for("none", None, good), "/bridge/reload", body)
    assert r.status_code == 200 and r.json()["weight_version"] == "3"


def test_weight_transfer_routes_of_a_server_without_a_backend_are_400() -> None:
    """vLLM's /update_weights & co. fail with 500 on a server without a weight-transfer
    backend (modes none, lora_only): the middleware answers 400 naming the mode, after the
    token check; a shared_vllm server's requests reach vLLM's route."""
    r = post(app_for("none", None), "/update_weights", "{}")
    assert r.status_code == 400 and "bridge mode none" in r.json()["error"]
    assert post(app_for("none", None), "/update_weights", "{}", token=False).status_code == 401
    r = post(app_for("shared_vllm", "gloo_bcast"), "/update_weights", "{}")
    assert r.status_code == 200 and r.json() == {"reached": "vllm"}


def test_a_body_too_deep_for_a_vllm_route_s_json_parser_is_400() -> None:
    """vLLM's routes that read their body with ``json.loads`` let its ``RecursionError``
    escape (the connection dropped): the middleware answers 400 instead."""
    app = app_for("shared_vllm", "gloo_bcast")
    r = post(app, "/collective_rpc", "[" * 100_000)
    assert r.status_code == 400 and "nested too deeply" in r.json()["error"]
    assert post(app, "/collective_rpc", '{"method": "m"}').json() == {"method": "m"}


def test_a_version_label_that_is_no_header_value_is_percent_encoded() -> None:
    """vLLM's /update_weight_version takes any string; with a control character in the
    x-weight-version header uvicorn dropped every reply of the versioned routes. Printable
    ASCII labels (ours are integers) go out as they are."""
    assert header_value("17") == b"17" and header_value("v1.2-rc 3") == b"v1.2-rc 3"
    assert header_value("é") == b"%C3%A9" and header_value("50%") == b"50%25"
    app = app_for("none", None)
    app.state.bridge.version = "a\nb\x00"
    r = post(app, "/generate", "{}")  # refused (no prompt), and versioned all the same
    assert r.status_code == 400 and r.headers[VERSION_HEADER] == "a%0Ab%00"


def test_dev_routes_that_need_a_state_the_server_is_not_in_are_refused_first() -> None:
    """vLLM's /release_kv_cache_memory answers 500 unless the server is paused (and awake),
    /scale_elastic_ep unless it runs elastic expert parallelism: the middleware answers 409 /
    400 saying what is missing, and lets them through once it is there."""
    engine = Engine({})
    app = app_for("none", None, engine)
    app.state.bridge.args = Namespace(enable_elastic_ep=False)
    r = post(app, "/release_kv_cache_memory", "")
    assert r.status_code == 409 and "POST /pause first" in r.json()["error"], r.text
    engine.paused = engine.sleeping = True
    assert post(app, "/release_kv_cache_memory", "").status_code == 409
    engine.sleeping = False
    assert post(app, "/release_kv_cache_memory", "").json() == {"reached": "vllm"}
    r = post(app, "/scale_elastic_ep", '{"new_data_parallel_size": 2}')
    assert r.status_code == 400 and "--enable-elastic-ep" in r.json()["error"], r.text
    app.state.bridge.args = Namespace(enable_elastic_ep=True)
    assert post(app, "/scale_elastic_ep", "{}").json() == {"reached": "vllm"}
    assert post(app, "/scale_elastic_ep", "{}", token=False).status_code == 401
