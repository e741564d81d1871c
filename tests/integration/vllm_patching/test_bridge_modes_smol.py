"""Every bridge mode on a real pretrained LLM's code path: SmolLM2-135M-Instruct (Llama, a
49k-token tokenizer, tied embeddings, GQA with 9 query / 3 KV heads) with its real weights,
cut to its first 4 of 30 decoder layers (``smol_first_layers``, tests/conftest.py), served by
the real vLLM CPU server.

For each mode: vLLM's greedy output equals transformers' on real Shop-R1 prompts (chat
template, the environment's prompt builder), then a real optimizer step on the trainer's
model (full weights, or a LoRA adapter on q/k/v/o/gate/up/down), ``sync``, and vLLM's greedy
output equals the stepped model's token for token (logprobs close), with the weight version
advanced. One vLLM start per mode (each mode's server differs: engine ``gloo_bcast`` or
``shm``, ``--enable-lora``, ``/bridge/reload`` only in mode ``none``); the cut model is built
once per run. transformers' greedy outputs, the costly part, are computed once per state of
the trainer's model and shared: the start weights' outputs (``base_outs``) and the weights
after the first AdamW step (``stepped``: the first sync of the gloo, single-copy and reload
tests, which took the same step from the same weights each) once for the module, the later
states before their sync and reused as the next step's "before". Their prefill computes the
logits of the last position only (``logits_to_keep=1``): the other 639 rows of the 576 x
49152 head were thrown away.

Why the cut keeps the point of the module: every decoder layer has the same tensor names
(``model.layers.N.*``) and shapes, so the bridge's name/shard map, vLLM's fused
``qkv_proj``/``gate_up_proj`` and the tied 576 x 49152 embedding (the largest tensor, whole)
take the same code path at 4 layers as at 30; the map is checked up to the last layer. The
gloo broadcast sends in 32 MiB buckets so that the model still spans several of them (the
whole model fills three of the default 256 MiB; the cut model's 162 MiB would fit in one).
What 30 layers added was compute (vLLM's start, transformers' greedy decoding and the
optimizer step on 7.5x the layers) and rounding, not another code path. The greedy tokens
stay decisive on the cut model: the smallest top-1/top-2 logprob gap over the 3 prompts x 12
tokens is 0.086 (measured with transformers), 17x the logprob tolerance. The states after
AdamW steps were not measured beforehand, so every comparison also holds on a near-tie:
where transformers' top two are within ``LOGPROB_TOL``, vLLM may take the runner-up (the two
kernels round apart on some CPU), and the texts are compared up to there (``assert_serves``;
each state's smallest gap is printed, ``SMOL_GREEDY``; measured 2026-11-29 on an AVX2-only
AMD EPYC: 0.086 at the start, 0.056 and 0.186 after the full-weight steps, 0.024 and 0.215
after the LoRA steps, so none parted there).
The in-flight and restart behaviour of each mode is covered on the tiny model
(test_bridge_modes.py); here the point is the real model's code path.
"""

from __future__ import annotations

import copy
import json
import secrets
from pathlib import Path
from typing import NamedTuple

import httpx
import pytest
import torch

from launch.vllm_server import BridgeServer, start_bridge_server
from tests.integration.bridge_checks import hf_model, optimizer_step, vllm_greedy
from trainer.bridge import make_bridge

pytestmark = [pytest.mark.integration, pytest.mark.smol]

TOKEN = secrets.token_hex(16)
SERVED = "smol"
N_TOKENS = 12
LOGPROB_TOL = 5e-3
"""vLLM's and transformers' logprob of the same token on the same weights (fp32 kernels)."""
MAX_PROMPT_TOKENS = 640
GLOO = {"token": TOKEN, "bucket_bytes": 32 << 20}
"""The broadcast bridges' options: buckets small enough that the cut model spans several
(the 108 MiB embedding alone, then the layers: 3 buckets, as the whole model in the default
256 MiB ones)."""
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def smol(smol_first_layers: Path) -> Path:
    """The model every test here serves and steps: SmolLM2 cut to its first layers."""
    return smol_first_layers


@pytest.fixture(scope="module")
def prompts(smol: Path) -> list[list[int]]:
    """Three real Shop-R1 prompts: the first test-split row of each gold action type."""
    from transformers import AutoTokenizer

    from env_server.data.dataset import build_dataset
    from env_server.rollout import prompt_ids

    tok = AutoTokenizer.from_pretrained(smol)
    rows = build_dataset(num_sessions=24, seed=0)["test"].to_list()
    first = {}
    for row in rows:
        first.setdefault(row["action_type"], row)
    assert set(first) == {"click", "type_and_submit", "terminate"}
    return [prompt_ids(r, tok, MAX_PROMPT_TOKENS, latest_only=False) for r in first.values()]


class Decoded(NamedTuple):
    """transformers' greedy decoding of one prompt: each step's token and logprob, and its
    runner-up token with that one's logprob."""

    ids: list[int]
    lps: list[float]
    alt_ids: list[int]
    alt_lps: list[float]


@torch.no_grad()
def hf_greedy(model: torch.nn.Module, ids: list[int]) -> Decoded:
    """Greedy decoding with the KV cache (EOS ignored, as the vLLM request asks)."""
    out = model(input_ids=torch.tensor([ids]), use_cache=True, logits_to_keep=1)
    got = Decoded([], [], [], [])
    for _ in range(N_TOKENS):
        lp = torch.log_softmax(out.logits[0, -1].float(), -1)
        top = lp.topk(2)
        (tok, alt), (tok_lp, alt_lp) = top.indices.tolist(), top.values.tolist()
        got.ids.append(tok)
        got.lps.append(tok_lp)
        got.alt_ids.append(alt)
        got.alt_lps.append(alt_lp)
        out = model(
            input_ids=torch.tensor([[tok]]), past_key_values=out.past_key_values, use_cache=True
        )
    return got


Greedy = list[Decoded]
"""transformers' greedy decoding of every prompt, for one state of the model."""


def hf_outputs(model: torch.nn.Module, prompts: list[list[int]]) -> Greedy:
    """transformers' greedy decoding of every prompt on ``model`` as it is now."""
    return [hf_greedy(model, ids) for ids in prompts]


def assert_serves(
    url: str, served: str, want: Greedy, prompts: list[list[int]], version: int
) -> None:
    """vLLM's greedy tokens equal ``want`` (``hf_outputs`` of the weights just synced) on every
    prompt, logprobs close, served at ``version``. Where transformers' top two tokens are
    within ``LOGPROB_TOL`` (a near-tie), vLLM may take the runner-up instead; the texts then
    part and are compared up to there (module docstring)."""
    gaps = []
    for ids, hf in zip(prompts, want, strict=True):
        got_ids, got_lp, header = vllm_greedy(url, served, ids, n=N_TOKENS)
        assert header == str(version)
        gaps += [a - b for a, b in zip(hf.lps, hf.alt_lps, strict=True)]
        assert len(got_ids) == N_TOKENS
        pairs = enumerate(zip(got_ids, hf.ids, strict=True))
        same = next((i for i, (a, b) in pairs if a != b), N_TOKENS)  # tokens before they part
        assert got_lp[:same] == pytest.approx(hf.lps[:same], abs=LOGPROB_TOL)
        if same < N_TOKENS:  # only a near-tie may part them, and to the runner-up
            gap = hf.lps[same] - hf.alt_lps[same]
            assert gap <= LOGPROB_TOL and got_ids[same] == hf.alt_ids[same], (same, gap)
            assert got_lp[same] == pytest.approx(hf.alt_lps[same], abs=LOGPROB_TOL)
    print(f"SMOL_GREEDY version {version}: smallest top-1/top-2 gap {min(gaps):.3g}")
    assert httpx.get(f"{url}/bridge/health").json()["weight_version"] == str(version)


def step_moves_outputs(
    model: torch.nn.Module, prompts: list[list[int]], lr: float, before: Greedy | None = None
) -> Greedy:
    """A real AdamW step (on the first prompt's next-token loss) that changes the outputs;
    returns the stepped model's ``hf_outputs``. ``before``: the model's outputs before the
    step when already computed (transformers' greedy decoding is the costly part of this
    module: each one is computed once per model state, never again for the same weights)."""
    before = before if before is not None else hf_outputs(model, prompts)
    optimizer_step(model, prompts[0], lr=lr)
    after = hf_outputs(model, prompts)
    flat = lambda outs: [lp for out in outs for lp in out.lps]  # noqa: E731
    assert flat(after) != pytest.approx(flat(before), abs=1e-3), "the step changed nothing"
    return after


@pytest.fixture(scope="module")
def base_outs(smol: Path, prompts: list[list[int]]) -> Greedy:
    """transformers' greedy outputs of the start weights, once for the module: what vLLM
    serves at version 0, and the "before" of every test's first step (a LoRA model's
    adapters start at B = 0, so it computes the same)."""
    return hf_outputs(hf_model(smol), prompts)


@pytest.fixture(scope="module")
def stepped(
    smol: Path, prompts: list[list[int]], base_outs: Greedy
) -> tuple[torch.nn.Module, Greedy]:
    """The start weights after one real AdamW step (lr 3e-4) and its outputs, once for the
    module: the gloo, single-copy and reload tests each sync it first (a copy each, so no
    test sees what another's bridge did to its model)."""
    model = hf_model(smol)
    return model, step_moves_outputs(model, prompts, lr=3e-4, before=base_outs)


def _server(model_dir: Path, tmp_path_factory, mode: str, **kw) -> BridgeServer:
    log = tmp_path_factory.mktemp(f"smol-{mode}") / "server.log"
    kw |= dict(token=TOKEN, served_model_name=SERVED, forked=True)
    return start_bridge_server(model_dir, mode, log, **kw)


def test_broadcast_gloo_and_same_host(smol, prompts, base_outs, stepped, tmp_path_factory) -> None:
    server = _server(smol, tmp_path_factory, "shared_vllm")
    try:
        url = server.base_url
        info = httpx.get(f"{url}/bridge/info").json()
        assert info["backend"] == "gloo_bcast" and info["tied_embeddings"] is True
        last = json.loads((smol / "config.json").read_text())["num_hidden_layers"] - 1
        gate = info["param_map"][f"model.layers.{last}.mlp.gate_proj.weight"]
        assert gate["vllm_name"] == f"model.layers.{last}.mlp.gate_up_proj.weight"
        assert_serves(url, SERVED, base_outs, prompts, version=0)  # the converted model served
        model, outs = copy.deepcopy(stepped[0]), stepped[1]
        # the network path: gloo broadcast over loopback TCP (what another host gets)
        with make_bridge("shared_vllm", [url], shm_fast_path=False, **GLOO) as bridge:
            stats = bridge.sync(model, 1)
            assert stats.detail["servers"][0]["detail"]["workers"][0]["path"] == "gloo"
            assert len(bridge.plan.bucket_sizes) >= 3  # the embedding alone, then the layers
            assert_serves(url, SERVED, outs, prompts, version=1)
        # same host: the worker maps the trainer's resident weights
        outs = step_moves_outputs(model, prompts, lr=3e-4, before=outs)
        with make_bridge("shared_vllm", [url], **GLOO) as bridge:
            stats = bridge.sync(model, 2)
            assert stats.detail["servers"][0]["detail"]["workers"][0]["path"] == "shm"
            assert len(bridge.plan.bucket_sizes) >= 3
            assert_serves(url, SERVED, outs, prompts, version=2)
    finally:
        server.stop()


def test_single_copy_shared_memory(smol, prompts, stepped, tmp_path_factory) -> None:
    server = _server(smol, tmp_path_factory, "shared_vllm", single_copy=True)
    try:
        url = server.base_url
        model, outs = copy.deepcopy(stepped[0]), stepped[1]
        with make_bridge("shared_vllm", [url], single_copy=True, token=TOKEN) as bridge:
            stats = bridge.sync(model, 1)
            assert stats.detail["packed_bytes"] == 0 and stats.detail["resident_params"] > 0
            assert_serves(url, SERVED, outs, prompts, version=1)
    finally:
        server.stop()


def test_lora_hot_swap(smol, prompts, base_outs, tmp_path_factory, tmp_path) -> None:
    from peft import LoraConfig, get_peft_model

    server = _server(smol, tmp_path_factory, "lora_only")
    try:
        url = server.base_url
        torch.manual_seed(0)
        model = get_peft_model(
            hf_model(smol), LoraConfig(r=8, lora_alpha=16, target_modules=LORA_TARGETS)
        )
        wrapped = {n.split(".")[-2] for n, _ in model.named_modules() if n.endswith("lora_A")}
        assert wrapped == set(LORA_TARGETS)
        bridge = make_bridge("lora_only", [url], token=TOKEN, save_dir=tmp_path / "adapters")
        try:
            outs = base_outs
            for version in (1, 2):  # a second adapter replaces the first while serving
                outs = step_moves_outputs(model, prompts, lr=2e-3, before=outs)
                bridge.sync(model, version)
                assert bridge.served_model == f"{SERVED}-v{version}"
                assert_serves(url, bridge.served_model, outs, prompts, version=version)
        finally:
            bridge.close()
    finally:
        server.stop()


def test_checkpoint_reload(smol, prompts, stepped, tmp_path_factory, tmp_path) -> None:
    server = _server(smol, tmp_path_factory, "none")
    try:
        url = server.base_url
        model, outs = copy.deepcopy(stepped[0]), stepped[1]
        with make_bridge("none", [url], token=TOKEN, save_dir=tmp_path / "ckpt") as bridge:
            bridge.sync(model, 1)
            assert_serves(url, SERVED, outs, prompts, version=1)
    finally:
        server.stop()
