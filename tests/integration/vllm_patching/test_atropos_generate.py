"""Atropos's ``/generate`` on our patched vLLM server, driven by atroposlib 0.4.0's own
``server_type="vllm"`` client (``atropos_generate_client.py``, in the atroposlib virtualenv):
sampled and greedy completions, a token-id prompt, prompt logprobs, a ``ManagedServer``
completion, vLLM's ``--api-key`` (a wrong key is a 401 to atroposlib's client). Then, by
hand, what atroposlib cannot show: the same greedy tokens and logprobs as ``/v1/completions``,
the weight version in the header and body after a weight reload, and clear 4xx errors."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

from api.client import bearer
from bench.api.servers import ensure_atropos
from launch.vllm_server import start_bridge_server
from vllm_patching.protocol import TOKEN_HEADER, VERSION_HEADER

pytestmark = pytest.mark.integration
HERE = Path(__file__).parent.resolve().parent
API_KEY, BRIDGE_TOKEN = "atropos-key", "bridge-token"


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("generate") / "vllm.log"
    srv = start_bridge_server(
        tiny_model_dir, "none", log, token=BRIDGE_TOKEN, extra=["--api-key", API_KEY], forked=True
    )
    yield srv
    srv.stop()


def _post(url: str, body: dict, key: str | None = API_KEY) -> httpx.Response:
    return httpx.post(url, json=body, headers=bearer(key), timeout=300)


def test_atroposlib_vllm_client_rolls_out_against_generate(
    server, tiny_model_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "client.json"
    script = str(HERE / "atropos_generate_client.py")
    argv = [str(ensure_atropos()), script, server.base_url, str(tiny_model_dir), API_KEY, str(out)]
    subprocess.run(argv, check=True, timeout=900)
    res = json.loads(out.read_text())
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)

    sampled = res["sampled"]
    assert sampled["prompt"] == tok.encode("search for running shoes")  # atroposlib tokenizes
    assert len(sampled["tokens"]) == len(sampled["logprobs"]) == len(sampled["finish"]) == 3
    for toks, lps, fin in zip(
        sampled["tokens"], sampled["logprobs"], sampled["finish"], strict=True
    ):
        assert 1 <= len(toks) <= 6 and len(lps) == len(toks) and fin in ("stop", "length")
        assert all(math.isfinite(x) and x <= 0.0 for x in lps)
        assert all(0 <= t < len(tok) for t in toks)

    ids = tok.encode("click add to cart", add_special_tokens=False)
    greedy = res["greedy_ids"]
    assert greedy["prompt"] == ids and len(greedy["tokens"]) == 1
    ref = _post(
        f"{server.base_url}/v1/completions",
        {
            "model": "tiny",
            "prompt": ids,
            "max_tokens": 5,
            "temperature": 0.0,
            "logprobs": 0,
            "return_token_ids": True,
        },
    ).json()["choices"][0]
    assert greedy["tokens"][0] == ref["token_ids"]  # the same tokens as /v1/completions
    assert greedy["logprobs"][0] == pytest.approx(ref["logprobs"]["token_logprobs"], abs=1e-5)
    assert greedy["finish"] == [ref["finish_reason"]]

    plp = res["prompt_logprobs"]
    assert plp["prompt_tokens"] == ids
    assert len(plp["prompt_topk_token_ids"]) == len(ids) and plp["prompt_topk_token_ids"][0] == []
    for k in range(1, len(ids)):  # the prompt's own token first, then the top 3
        assert plp["prompt_topk_token_ids"][k][0] == ids[k]
        assert 1 <= len(plp["prompt_topk_token_ids"][k]) <= 4
        assert all(x <= 0.0 for x in plp["prompt_topk_logprobs"][k])

    assert len(res["managed"]) == 2
    for node in res["managed"]:
        n_prompt = sum(1 for m in node["masked_tokens"] if m == -100)
        assert n_prompt >= 1 and len(node["tokens"]) == len(node["logprobs"]) > n_prompt
        assert node["logprobs"][:n_prompt] == [1.0] * n_prompt  # atroposlib's prompt marker
        assert all(x <= 0.0 for x in node["logprobs"][n_prompt:])

    assert res["wrong_key"] == "ClientResponseError: 401"


def test_generate_weight_version_and_errors(server, tiny_model_dir: Path) -> None:
    url = f"{server.base_url}/generate"
    body = {"prompt": {"prompt_token_ids": [5, 6, 7]}, "max_tokens": 3, "logprobs": 0}
    first = _post(url, body)
    assert first.status_code == 200, first.text
    assert first.headers[VERSION_HEADER] == first.json()["weight_version"] == "0"
    reload = httpx.post(
        f"{server.base_url}/bridge/reload",
        json={"path": str(tiny_model_dir), "version": 7},
        headers={TOKEN_HEADER: BRIDGE_TOKEN},
        timeout=300,
    )
    assert reload.status_code == 200, reload.text
    after = _post(url, body)
    assert after.headers[VERSION_HEADER] == after.json()["weight_version"] == "7"
    reply = after.json()
    assert set(reply) == {
        "text",
        "prompt",
        "finish_reasons",
        "logprobs",
        "prompt_token_ids",
        "token_ids",
        "weight_version",
    }
    assert reply["prompt_token_ids"] == [5, 6, 7]
    assert [int(next(iter(p[0]))) for p in reply["logprobs"][0]] == reply["token_ids"][0]

    assert _post(url, body, key=None).status_code == 401
    assert _post(url, body, key="nope").status_code == 401
    bad = _post(url, {**body, "model": "tiny"})
    assert bad.status_code == 400 and "model" in bad.text
    assert _post(url, {"max_tokens": 3}).status_code == 400
    assert _post(url, {**body, "prompt": [1, 2]}).status_code == 400
    assert _post(url, {**body, "temperature": -1.0}).status_code == 400
    assert _post(url, {**body, "prompt": {"prompt_token_ids": [10**9]}}).status_code == 400
    assert _post(url, {**body, "stream": True}).status_code == 400
