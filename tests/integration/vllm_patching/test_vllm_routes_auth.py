"""Who may reach the patched vLLM server (issue 48): every route of the real app against the
table in docs/BRIDGE.md, with and without the bridge token and vLLM's ``--api-key``; a route
added later is denied; every route sent without the token to a running server.

The app is vLLM's own ``build_app`` on the tiny model's config with our endpoint plugin, as
``python -m vllm_patching.serve`` sets it up (dev mode, runtime LoRA updating), without an
engine: a request our middleware lets through reaches its handler, which fails for want of
an engine (500) or of a valid body (4xx) -- anything but the 401s this checks. The running
server (the session's ``none`` server) shows the same routes (its OpenAPI schema) and refuses
each guarded one without the token.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from starlette.routing import Mount

from launch.vllm_server import BridgeServer
from tests.route_table import concrete, documented
from vllm_patching.middleware import OPEN_ROUTES
from vllm_patching.protocol import SETTINGS_ENV, TOKEN_ENV, TOKEN_HEADER, BridgeSettings

pytestmark = pytest.mark.integration
BRIDGE_MD = Path(__file__).parent.resolve().parents[2] / "docs" / "BRIDGE.md"
TOKEN, API_KEY = "bridge-s3cret", "vllm-key"
OURS = re.compile(r"missing or wrong bridge token")
VLLM_GUARDED = ("/v1", "/v2", "/inference", "/cohere")  # vLLM's --api-key prefixes
LORA_ONLY = {
    ("POST", "/v1/load_lora_adapter"),
    ("POST", "/v1/unload_lora_adapter"),
    ("POST", "/adapters"),
    ("DELETE", "/adapters/{adapter_name}"),
}
"""Registered with runtime LoRA updating only (``lora_only`` servers)."""
TASKS = ("generate",)  # what the tiny model's server reports (checked against its log below)


def build(
    mp: pytest.MonkeyPatch, model: Path, token: str | None, *flags: str, lora: bool = True
) -> FastAPI:
    """vLLM's app with our plugin, configured as serve.py configures a server."""
    from vllm.config import ModelConfig
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    mp.setenv("VLLM_SERVER_DEV_MODE", "1")
    mp.setenv("VLLM_PLUGINS", "shop_r1_bridge")
    settings = BridgeSettings(run_id="r", config_path="/nonexistent", served_model_name="tiny")
    mp.setenv(SETTINGS_ENV, settings.model_dump_json())
    if lora:
        mp.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")
    else:
        mp.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    mp.delenv("VLLM_API_KEY", raising=False)
    if token:
        mp.setenv(TOKEN_ENV, token)
    else:
        mp.delenv(TOKEN_ENV, raising=False)
    argv = ["--model", str(model), *(["--enable-lora"] if lora else []), *flags]
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
    return build_app(args, TASKS, ModelConfig(model=str(model)))


def routes(app: FastAPI, schema_only: bool = False) -> set[tuple[str, str]]:
    out = set()
    for r in app.routes:
        if isinstance(r, Mount):
            out |= set() if schema_only else {("GET", r.path + "/{path:path}")}
        elif not schema_only or getattr(r, "include_in_schema", False):
            out |= {(m, r.path) for m in getattr(r, "methods", None) or () if m != "HEAD"}
    return out


def call(app: FastAPI, reqs: list[tuple[str, str, dict[str, str]]]) -> list[httpx.Response]:
    """Each request through the app in process (its handlers' errors become 500s)."""

    async def run() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            out = []
            for method, path, headers in reqs:
                body = {} if method in ("POST", "PUT", "PATCH", "DELETE") else None
                out.append(await c.request(method, path, json=body, headers=headers))
            return out

    return asyncio.run(run())


@pytest.fixture(scope="module")
def table() -> dict[tuple[str, str], str]:
    return documented("vllm", BRIDGE_MD)


@pytest.mark.parametrize("api_key", [False, True], ids=["no-api-key", "api-key"])
def test_every_route_answers_as_documented(
    monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path, table: dict, api_key: bool
) -> None:
    """The table lists exactly the app's routes, its ``open`` ones are ``OPEN_ROUTES``. With
    the token set: a ``token`` route is refused by our middleware without it or with a wrong
    one, answered with it; an ``open`` one never sees our refusal, and without ``--api-key``
    answers anyone, with it answers as vLLM's own middleware decides (401 "Unauthorized"
    under its prefixes without the key, through with it)."""
    flags = ("--api-key", API_KEY) if api_key else ()
    app = build(monkeypatch, tiny_model_dir, TOKEN, *flags)
    assert set(table) == routes(app), "docs/BRIDGE.md's table and the app's routes differ"
    assert {r for r, need in table.items() if need == "open"} == OPEN_ROUTES
    assert set(table.values()) == {"open", "token"}
    key = {"Authorization": f"Bearer {API_KEY}"} if api_key else {}
    reqs, expect = [], []
    for (method, route), need in sorted(table.items()):
        path = concrete(route)
        for headers, who in [
            ({}, "nobody"),
            ({TOKEN_HEADER: "wrong", **key}, "wrong token"),
            ({TOKEN_HEADER: TOKEN, **key}, "token"),
            (key, "key only"),
        ]:
            reqs.append((method, path, headers))
            expect.append((method, route, need, who))
    for r, (method, route, need, who) in zip(call(app, reqs), expect, strict=True):
        what = (method, route, who, r.status_code, r.text[:200])
        ours = r.status_code == 401 and OURS.search(r.text) is not None
        vllms = r.status_code == 401 and r.json() == {"error": "Unauthorized"}
        keyed = api_key and route.startswith(VLLM_GUARDED)
        if who == "nobody" and keyed:
            assert vllms, what  # vLLM's middleware is outermost: its 401 first
        elif need == "token" and who in ("nobody", "wrong token", "key only"):
            assert ours, what
        else:
            assert r.status_code != 401, what
        if need == "open":
            assert not ours, what


def test_a_route_a_later_vllm_adds_is_denied_without_the_token(
    monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path
) -> None:
    """Default deny: routes registered after the plugin (a later vLLM's), GET included, and a
    lookalike of an open path answer 401 without the token, and are reached with it."""
    app = build(monkeypatch, tiny_model_dir, TOKEN, lora=False)

    async def future() -> dict[str, bool]:
        return {"ran": True}

    app.add_api_route("/v1/future_rl_update", future, methods=["POST"])
    app.add_api_route("/future_state", future, methods=["GET", "DELETE"])
    app.add_api_route("/v1/completions/{x}", future, methods=["POST"])
    cases = [
        ("POST", "/v1/future_rl_update"),
        ("GET", "/future_state"),
        ("DELETE", "/future_state"),
        ("HEAD", "/future_state"),
        ("POST", "/v1/completions/also"),
    ]
    without = call(app, [(m, p, {}) for m, p in cases])
    with_token = call(app, [(m, p, {TOKEN_HEADER: TOKEN}) for m, p in cases])
    for (m, p), r, ok in zip(cases, without, with_token, strict=True):
        assert r.status_code == 401 and (m == "HEAD" or OURS.search(r.text)), (m, p)
        assert ok.status_code != 401, (m, p)
        if m != "HEAD":
            assert ok.json() == {"ran": True}, (m, p)


def test_without_the_token_nothing_is_refused(
    monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path, table: dict
) -> None:
    """Loopback (or the opt-out) without a token: the middleware refuses nothing (and
    serve.py starts such a server on loopback only)."""
    app = build(monkeypatch, tiny_model_dir, None)
    replies = call(app, [(m, concrete(p), {}) for m, p in sorted(table)])
    assert not [r for r in replies if r.status_code == 401]


def test_a_running_server_refuses_every_guarded_route(
    monkeypatch: pytest.MonkeyPatch,
    tiny_model_dir: Path,
    table: dict,
    _none_server: BridgeServer,
) -> None:
    """The session's ``none`` server (a real ``python -m vllm_patching.serve`` with its token):
    the same routes as the app built here (its OpenAPI schema; the LoRA ones are not
    registered outside ``lora_only``), the tasks its log reports, every ``token`` route 401
    without the token (nothing runs), every ``open`` GET 200, every ``open`` POST answered (a
    4xx for the empty body) but never 401; the read-only dev-mode GETs answer with it."""
    from tests.integration.grpo_harness import TOKEN as SERVER_TOKEN

    url = _none_server.base_url
    log = _none_server.proc.log_path.read_text(errors="replace")
    assert f"Supported tasks: {list(TASKS)}" in log
    schema = httpx.get(f"{url}/openapi.json", timeout=30).json()["paths"]
    live = {(m.upper(), p) for p, ops in schema.items() for m in ops}
    # (vLLM keeps registries across builds in one process: the LoRA routes are left out here)
    app = build(monkeypatch, tiny_model_dir, TOKEN, lora=False)
    assert live == routes(app, schema_only=True) - LORA_ONLY
    with httpx.Client(base_url=url, timeout=60) as c:
        for (method, route), need in sorted(table.items()):
            if (method, route) in LORA_ONLY:
                continue  # lora_only servers only
            path = concrete(route)
            body = {} if method != "GET" else None
            r = c.request(method, path, json=body)
            what = (method, route, r.status_code, r.text[:200])
            if need == "token":
                assert r.status_code == 401 and OURS.search(r.text), what
                if method == "GET":
                    ok = c.get(path, headers={TOKEN_HEADER: SERVER_TOKEN})
                    assert ok.status_code == 200, (*what, ok.text[:200])
            elif method == "GET" and "{" not in route:
                assert r.status_code == 200, what
            else:
                assert r.status_code != 401, what
