"""Fuzzing the patched vLLM server (issue 48 point 4): schemathesis over the bridge's routes
and vLLM's weight-transfer routes, hypothesis over Atropos' ``/generate`` bodies, checkpoints
that do not fit the model, and malformed bodies on every route of the server, with the
bridge token and without it: no 5xx of ours, no hang, and the server still healthy and
serving the same weights afterwards.

The server is the session's ``none`` server (a real ``python -m vllm_patching.serve`` on the
tiny model, tests/conftest.py), reset before the test and after it. Counts:
docs/FAULT_TOLERANCE.md ("Fuzzing both servers"); ``pytest -s`` prints them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
import torch
from hypothesis import strategies as st
from safetensors.torch import save_file

from launch.vllm_server import BridgeServer
from tests.integration.fuzz_http import (
    TIMEOUT_S,
    Tally,
    client,
    fuzz_operations,
    fuzz_strategy,
    json_values,
    malformed_bodies,
    sweep,
)
from tests.integration.grpo_harness import TOKEN, reset_none_server
from tests.route_table import documented
from vllm_patching.generate import SAMPLING_FIELDS
from vllm_patching.protocol import TOKEN_HEADER

pytestmark = pytest.mark.integration
BRIDGE_MD = Path(__file__).parent.resolve().parents[2] / "docs" / "BRIDGE.md"
AUTH = {TOKEN_HEADER: TOKEN}
EXAMPLES = 25
"""Schemathesis cases per operation and mode (positive, negative)."""
GENERATE_EXAMPLES = 60
NASTY_VERSION = "v\n1\x00é"
"""A weight-version label with characters no HTTP header may carry raw."""
FUZZED = (
    "/bridge/",  # ours: health, info, stage, apply, reload, lora/load
    # vLLM's weight routes, which a trainer drives (and mutate the served weights)
    "/init_weight_transfer_engine",
    "/start_weight_update",
    "/start_draft_weight_update",
    "/update_weights",
    "/finish_weight_update",
    "/update_weight_version",
    "/shutdown_weight_transfer_engine",
)
TOGGLES = {"/pause": "/resume", "/sleep": "/wake_up"}
"""Routes that read no body and change what the server serves: undone after each request."""
NOT_NOW = {
    "/release_kv_cache_memory": (409, "POST /pause first"),
    "/scale_elastic_ep": (400, "--enable-elastic-ep"),
}
"""vLLM's dev-mode routes whose handlers answered 500 when the server is not in the state they
need (not paused; no elastic expert parallelism): the middleware says so first."""


SCALED = ("n", "max_tokens", "min_tokens")
"""Sampling fields that scale a valid request's work (``max_tokens: null`` is up to the
context length): always small or of a wrong type."""


def sampling_values() -> dict[str, st.SearchStrategy[Any]]:
    """A value of each ``SamplingParams`` field's own type (vLLM may still refuse it: out of
    range, beyond 64 bits, out of vocabulary); the ``SCALED`` ones small."""
    ids = st.integers(-1, 3000) | st.integers()
    words = st.text(min_size=1, max_size=4)
    number = st.floats(-1, 3) | st.integers(-1, 3)
    small = st.integers(-2, 4)
    flags = (
        "ignore_eos",
        "detokenize",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "include_stop_str_in_output",
    )
    return {
        **dict.fromkeys(SCALED, small),
        **dict.fromkeys(("temperature", "top_p", "min_p"), number),
        **dict.fromkeys(("presence_penalty", "frequency_penalty", "repetition_penalty"), number),
        **dict.fromkeys(("top_k", "logprobs", "prompt_logprobs"), st.integers(-2, 30)),
        **dict.fromkeys(flags, st.booleans()),
        "seed": st.integers(),
        "stop": words | st.lists(words, max_size=2),
        "stop_token_ids": st.lists(ids, max_size=3),
        "allowed_token_ids": st.lists(ids, min_size=1, max_size=3),
        "bad_words": st.lists(words, max_size=2),
        "logit_bias": st.dictionaries(ids.map(str), st.floats(-100, 100), max_size=2),
    }


def generate_bodies() -> st.SearchStrategy[dict[str, Any]]:
    """``/generate`` bodies: mostly the three prompt forms, sometimes any JSON; up to three
    sampling fields (now and then an unknown one), each 3 times in 4 a value of its type,
    else any JSON (the ``SCALED`` ones: a value of a wrong type, never null or a number)."""
    typed = sampling_values()
    assert set(typed) == SAMPLING_FIELDS
    wrong_type = st.text(max_size=3) | st.booleans() | st.lists(st.integers(), max_size=2)
    text = st.text(min_size=1, max_size=24)
    ids = st.lists(st.integers(0, 3000) | st.integers(), min_size=1, max_size=6)
    prompt = st.one_of(
        text,
        text,
        st.fixed_dictionaries({"prompt_token_ids": ids}),
        st.fixed_dictionaries({"prompt_token_ids": ids}),
        st.fixed_dictionaries({"prompt": text}),
        json_values(4),
    )

    def value(name: str) -> st.SearchStrategy[Any]:
        own = typed.get(name, json_values(2))
        if name in SCALED:
            return st.one_of(own, own, own, wrong_type)
        return st.one_of(own, own, own, json_values(4))

    names = sorted(typed) + ["model", "stream"]
    fields = st.lists(st.sampled_from(names), max_size=3, unique=True).flatmap(
        lambda keys: st.fixed_dictionaries({k: value(k) for k in keys})
    )
    has_prompt = st.sampled_from([True] * 9 + [False])  # about 1 in 10 without one
    return st.builds(
        lambda p, f, keep: {**({"prompt": p} if keep else {}), **f}, prompt, fields, has_prompt
    )


def bad_checkpoints(root: Path) -> dict[str, Path]:
    """Folders ``/bridge/reload`` must refuse (4xx) without touching the served weights."""
    out = {name: root / name.replace(" ", "-") for name in ("empty", "corrupt", "unknown", "shape")}
    for path in out.values():
        path.mkdir()
    (out["corrupt"] / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")
    save_file({"foo.weight": torch.zeros(3)}, str(out["unknown"] / "model.safetensors"))
    save_file(
        {"model.embed_tokens.weight": torch.zeros(3, 3)}, str(out["shape"] / "model.safetensors")
    )
    return out


def greedy(c: httpx.Client) -> list[int]:
    """The tokens the served weights pick greedily for a fixed prompt."""
    body = {"prompt": {"prompt_token_ids": [5, 6, 7, 8]}, "max_tokens": 8, "temperature": 0.0}
    r = c.post("/generate", json={**body, "logprobs": 0})
    assert r.status_code == 200, r.text
    return r.json()["token_ids"][0]


def schema_of(url: str) -> dict[str, Any]:
    return httpx.get(f"{url}/openapi.json", timeout=TIMEOUT_S).json()


def fuzzed_operations(schema: dict[str, Any]) -> list:
    paths = {p: ops for p, ops in schema["paths"].items() if p.startswith(FUZZED)}
    part = schemathesis.openapi.from_dict({**schema, "paths": paths})
    return [op.ok() for op in part.get_all_operations()]


def body_routes(schema: dict[str, Any]) -> set[tuple[str, str]]:
    """Routes that read a body: those the schema gives one, and ``POST /generate``."""
    out = {("POST", "/generate")}
    for path, ops in schema["paths"].items():
        out |= {(m.upper(), path) for m, op in ops.items() if "requestBody" in op}
    return out


def test_fuzzing_the_bridge_with_the_token(
    none_server: BridgeServer, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """With the token: schemathesis on the fuzzed operations, ``/generate`` bodies under a
    version label no header may carry raw, bad checkpoints, then every malformed body on every
    route; no 5xx, a body route refuses every malformed body (4xx), the ``NOT_NOW`` routes
    say why they cannot run now;
    afterwards ``/bridge/health`` answers and the weights are the ones served before (same
    greedy tokens)."""
    url, tally = none_server.base_url, Tally("vllm")
    schema = schema_of(url)
    ops = fuzzed_operations(schema)
    assert len(ops) >= 12, [op.label for op in ops]
    takes_body = body_routes(schema)
    with client(url, AUTH) as c:
        before = greedy(c)
        for route, (status, why) in NOT_NOW.items():
            r = c.post(route, json={"new_data_parallel_size": 2})
            assert r.status_code == status and why in r.json()["error"], (route, r.text)
        fuzz_operations(ops, url, AUTH, tally, EXAMPLES)
        # vLLM takes any label: every versioned reply must still go out (x-weight-version)
        r = c.post("/update_weight_version", json={"new_version": NASTY_VERSION})
        tally.record("POST /update_weight_version", r.status_code, lambda: r.text[:300])
        assert r.status_code == 200, r.text
        fuzz_strategy(c, "POST", "/generate", generate_bodies(), tally, GENERATE_EXAMPLES)
        for name, folder in bad_checkpoints(tmp_path).items():
            r = c.post("/bridge/reload", json={"path": str(folder), "version": 99})
            tally.record("POST /bridge/reload", r.status_code, lambda r=r: r.text[:300])
            assert 400 <= r.status_code < 500, (name, r.status_code, r.text[:300])

        def expect(method: str, route: str, name: str, status: int) -> bool:
            if (method, route) in takes_body:
                return 400 <= status < 500
            return status < 500

        def undo(method: str, route: str) -> None:
            if route in TOGGLES:
                assert c.post(TOGGLES[route]).status_code == 200

        table = documented("vllm", BRIDGE_MD)
        wrong = sweep(c, sorted(table), malformed_bodies(2**20), tally, expect, undo)
        health = c.get("/bridge/health")
        assert health.status_code == 200 and health.json()["status"] == "ok", health.text
        after = greedy(c)
    print("\n" + tally.report())
    reset_none_server(none_server, tiny_model_dir)  # the version the fuzzing may have set
    assert not tally.server_errors, "\n".join(tally.server_errors[:20])
    assert not wrong, "\n".join(wrong[:20])
    assert after == before
    assert {route for route, _ in tally.counts} == {f"{m} {p}" for m, p in table}


def test_fuzzing_the_bridge_without_the_token(none_server: BridgeServer) -> None:
    """Without the token: the fuzzed operations and every malformed body on every route;
    each ``token`` route of docs/BRIDGE.md's table answers 401, each ``open`` one never a
    5xx (a body route: 4xx); nothing changes what the server serves."""
    url, tally = none_server.base_url, Tally("vllm, no token")
    schema = schema_of(url)
    table = documented("vllm", BRIDGE_MD)
    takes_body = body_routes(schema)

    def refused(route: str, response: Any) -> None:
        method, path = route.split(" ", 1)
        if table[(method, path)] == "token":
            assert response.status_code == 401, route

    fuzz_operations(fuzzed_operations(schema), url, {}, tally, examples=3, check=refused)

    def expect(method: str, route: str, name: str, status: int) -> bool:
        if table[(method, route)] == "token":
            return status == 401
        return 400 <= status < 500 if (method, route) in takes_body else status < 500

    with client(url) as c:
        wrong = sweep(c, sorted(table), malformed_bodies(2**20), tally, expect)
        assert c.get("/bridge/health").json()["weight_version"] == "0"
    print("\n" + tally.report())
    assert not tally.server_errors, "\n".join(tally.server_errors[:20])
    assert not wrong, "\n".join(wrong[:20])
