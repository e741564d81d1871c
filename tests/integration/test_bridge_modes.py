"""Every bridge mode against the real vLLM CPU server and the embedded tiny model.

For each mode: a real optimizer step on the trainer's HF model, ``sync``, then vLLM's greedy
completion equals the HF model's greedy generation token for token (logprobs close), the
weight version advanced, and a request in flight during the sync completed.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from launch.vllm_server import BridgeServer, restart_bridge_server, start_bridge_server
from trainer.bridge import make_bridge
from vllm_patching.protocol import TOKEN_HEADER, VERSION_HEADER
from vllm_patching.shm_segment import SHM_DIR, SHM_PREFIX

pytestmark = pytest.mark.integration

TOKEN = secrets.token_hex(16)
PROMPT = "Click the search button to find running shoes"
N_TOKENS = 16


# ------------------------------------------------------------------------------- helpers
def hf_model(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def prompt_ids(model_dir: Path) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)(PROMPT)["input_ids"]


def optimizer_step(model: torch.nn.Module, ids: list[int], lr: float = 1e-2) -> None:
    """One real AdamW step on next-token loss: moves every trainable tensor, embeddings too."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    x = torch.tensor([ids])
    model.train()
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    model.eval()


@torch.no_grad()
def hf_greedy(
    model: torch.nn.Module, ids: list[int], n: int = N_TOKENS
) -> tuple[list[int], list[float]]:
    seq, logprobs = list(ids), []
    for _ in range(n):
        logits = model(input_ids=torch.tensor([seq])).logits[0, -1].float()
        lp = torch.log_softmax(logits, -1)
        tok = int(lp.argmax())
        seq.append(tok)
        logprobs.append(float(lp[tok]))
    return seq[len(ids) :], logprobs


def vllm_greedy(
    url: str, model: str, ids: list[int], n: int = N_TOKENS
) -> tuple[list[int], list[float], str]:
    r = httpx.post(
        f"{url}/v1/completions",
        json={
            "model": model,
            "prompt": ids,
            "max_tokens": n,
            "temperature": 0.0,
            "ignore_eos": True,
            "logprobs": 0,
            "return_token_ids": True,
        },
        timeout=120,
    )
    r.raise_for_status()
    choice = r.json()["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"], r.headers[VERSION_HEADER]


def assert_serves(
    url: str, served: str, model: torch.nn.Module, ids: list[int], version: int
) -> None:
    want_ids, want_lp = hf_greedy(model, ids)
    got_ids, got_lp, header = vllm_greedy(url, served, ids)
    assert got_ids == want_ids
    assert got_lp == pytest.approx(want_lp, abs=2e-3)
    assert header == str(version)
    assert httpx.get(f"{url}/bridge/health").json()["weight_version"] == str(version)


class InFlight:
    """A long streamed completion that is decoding when the sync starts.

    The sync starts only once the first token has streamed back (not after a fixed sleep:
    on an idle machine a short request could finish before the sync, on a loaded one it
    might not have started), and the request is long enough to outlast the sync: 500 tokens
    are 4-7 s of decoding for vLLM on the CPU (70-120 tokens/s on the tiny model, measured
    on a quiet 2-core box), a sync of the tiny model well under a second, and a loaded box
    slows both. (It was 1,500 tokens: 12-20 s per request, six of them, waited out in full.)
    """

    def __init__(self, url: str, model: str, ids: list[int], n: int = 500) -> None:
        self.result: dict = {}
        self.n = n
        self.done_at = 0.0
        self.decoding = threading.Event()

        def run() -> None:
            body = {
                "model": model,
                "prompt": ids,
                "max_tokens": n,
                "temperature": 0.0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            try:
                with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
                    self.result["status"] = r.status_code
                    self.result["version"] = r.headers.get(VERSION_HEADER)
                    for line in r.iter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[len("data: ") :])
                        if chunk.get("choices"):
                            self.decoding.set()
                            if chunk["choices"][0].get("finish_reason"):
                                self.result["finish_reason"] = chunk["choices"][0]["finish_reason"]
                        if chunk.get("usage"):
                            self.result["usage"] = chunk["usage"]
            finally:
                self.done_at = time.monotonic()
                self.decoding.set()  # never leave the constructor waiting on a failed request

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert self.decoding.wait(180), "the in-flight request never started decoding"
        self.sync_started_at = time.monotonic()

    def check(self, version_at_start: int, require_overlap: bool = True) -> bool:
        """The request completed in full on the version it started with; returns whether it
        was still running when the sync started (asserted unless ``require_overlap=False``:
        a sync with no pause can miss a request that a loaded box finished first)."""
        self.thread.join(300)
        overlapped = self.done_at > self.sync_started_at
        assert overlapped or not require_overlap, "the request did not overlap the sync"
        assert self.result["status"] == 200
        assert self.result["finish_reason"] == "length"
        assert self.result["usage"]["completion_tokens"] == self.n
        assert self.result["version"] == str(version_at_start)
        return overlapped


def _server(tiny_model_dir: Path, tmp_path_factory, mode: str, **kw) -> BridgeServer:
    log = tmp_path_factory.mktemp(f"bridge-{mode}") / "server.log"
    return start_bridge_server(tiny_model_dir, mode, log, token=TOKEN, **kw)


# ------------------------------------------------------------------------ shared_vllm gloo
@pytest.fixture(scope="module")
def gloo_server(tiny_model_dir, tmp_path_factory) -> Iterator[BridgeServer]:
    server = _server(tiny_model_dir, tmp_path_factory, "shared_vllm")
    yield server
    server.stop()


def test_the_cpu_worker_runs_in_the_engine_core(gloo_server: BridgeServer) -> None:
    """On the CPU a server is two processes (``launch.vllm_server.cpu_env``): the
    API server and its engine core, which runs the model's worker (and our bridge's worker
    extension) itself; vLLM does not start a third process for it."""
    from launch.lifeline import descendants

    def title(pid: int) -> str:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()

    titles = [title(p.pid) for p in descendants(gloo_server.proc.pid)]
    assert titles.count("VLLM::EngineCore") == 1, titles
    assert not any("Worker" in t for t in titles), titles


def test_mutating_routes_need_the_token(gloo_server: BridgeServer) -> None:
    url = gloo_server.base_url
    for path in [
        "/pause",
        "/init_weight_transfer_engine",
        "/update_weights",
        "/collective_rpc",
        "/reset_prefix_cache",
        "/bridge/apply",
        "/bridge/stage",
        "/update_weight_version",
    ]:
        r = httpx.post(url + path, json={})
        assert r.status_code == 401, path
        r = httpx.post(url + path, json={}, headers={TOKEN_HEADER: "wrong"})
        assert r.status_code == 401, path
    assert httpx.get(f"{url}/is_paused").json()["is_paused"] is False
    info = httpx.get(f"{url}/bridge/info").json()
    assert info["mode"] == "shared_vllm" and info["backend"] == "gloo_bcast"
    assert info["tied_embeddings"] is True and info["world_size"] == 1
    q = info["param_map"]["model.layers.0.self_attn.q_proj.weight"]
    assert q["vllm_name"] == "model.layers.0.self_attn.qkv_proj.weight" and q["shard"] == "q"
    assert httpx.post(f"{url}/pause", headers={TOKEN_HEADER: TOKEN}).status_code == 200
    assert httpx.post(f"{url}/resume", headers={TOKEN_HEADER: TOKEN}).status_code == 200


def test_broadcast_sync_optimizer_step_and_embedding(
    gloo_server: BridgeServer, tiny_model_dir
) -> None:
    url, served = gloo_server.base_url, gloo_server.served_model_name
    model, ids = hf_model(tiny_model_dir), prompt_ids(tiny_model_dir)
    assert_serves(url, served, model, ids, version=0)
    before = vllm_greedy(url, served, ids)
    optimizer_step(model, ids)
    assert hf_greedy(model, ids)[1] != pytest.approx(before[1], abs=1e-3)  # the step matters
    with make_bridge("shared_vllm", [url], token=TOKEN) as bridge:
        inflight = InFlight(url, served, ids)
        stats = bridge.sync(model, 1)
        inflight.check(version_at_start=0)
        assert stats.bytes > 0 and stats.stall_s < stats.total_s
        # same host: the worker proved it maps the trainer's segment, nothing went over TCP
        assert not stats.detail["remote"]
        assert stats.detail["servers"][0]["detail"]["workers"][0]["path"] == "shm"
        # resident weights: the parameters live in the segment, the sync copied nothing
        assert stats.detail["packed_bytes"] == 0
        assert stats.detail["resident_params"] == len(list(model.parameters()))
        assert_serves(url, served, model, ids, version=1)
        # Only the (tied) embedding changes: the lm_head's packed CPU copy must follow.
        with torch.no_grad():
            model.model.embed_tokens.weight.mul_(1.5).add_(0.05)
        bridge.sync(model, 2)
        assert_serves(url, served, model, ids, version=2)
    # The network path (what a receiver on another host gets): gloo over loopback TCP,
    # /bridge/stage -> broadcast -> /bridge/apply, on a fresh transfer group.
    with make_bridge("shared_vllm", [url], token=TOKEN, shm_fast_path=False) as bridge:
        optimizer_step(model, ids)
        stats = bridge.sync(model, 3)
        assert stats.detail["remote"]
        assert stats.detail["servers"][0]["detail"]["workers"][0]["path"] == "gloo"
        assert_serves(url, served, model, ids, version=3)


def test_one_trainer_broadcasts_to_two_servers(
    gloo_server, tiny_model_dir, tmp_path_factory
) -> None:
    """Several server_urls: one gloo group spans the trainer and both servers' workers."""
    second = _server(tiny_model_dir, tmp_path_factory, "shared_vllm")
    try:
        model, ids = hf_model(tiny_model_dir), prompt_ids(tiny_model_dir)
        optimizer_step(model, ids, lr=2e-2)
        urls = [gloo_server.base_url, second.base_url]
        with make_bridge("shared_vllm", urls, token=TOKEN) as bridge:
            bridge.sync(model, 7)
            for url in urls:
                assert_serves(url, "tiny", model, ids, version=7)
    finally:
        second.stop()


# ------------------------------------------------------------------- shared_vllm shm
def test_single_copy_shared_memory(tiny_model_dir, tmp_path_factory) -> None:
    server = _server(tiny_model_dir, tmp_path_factory, "shared_vllm", single_copy=True)
    try:
        url, served = server.base_url, server.served_model_name
        model, ids = hf_model(tiny_model_dir), prompt_ids(tiny_model_dir)
        optimizer_step(model, ids)
        bridge = make_bridge("shared_vllm", [url], single_copy=True, token=TOKEN)
        try:
            inflight = InFlight(url, served, ids)
            bridge.sync(model, 1)
            inflight.check(version_at_start=0)
            assert_serves(url, served, model, ids, version=1)
            segment = bridge.segment.name
            assert (Path(SHM_DIR) / segment).exists()
            # A restarted server (new run id) gets a fresh segment; nothing stale is reused.
            server = restart_bridge_server(server, model=tiny_model_dir, initial_version=1)
            optimizer_step(model, ids)
            stats = bridge.sync(model, 2)
            assert_serves(url, served, model, ids, version=2)
            # the parameters left the old segment before it closed and live in the new one
            assert stats.detail["packed_bytes"] == 0 and stats.detail["resident_params"] > 0
            assert bridge.segment.name != segment and not (Path(SHM_DIR) / segment).exists()
            segment = bridge.segment.name
        finally:
            bridge.close()
        assert not (Path(SHM_DIR) / segment).exists()
        assert segment.startswith(SHM_PREFIX)
    finally:
        server.stop()


# ------------------------------------------------------------------------------ lora_only
def test_lora_adapter_per_version(tiny_model_dir, tmp_path_factory, tmp_path) -> None:
    from peft import LoraConfig, get_peft_model

    server = _server(tiny_model_dir, tmp_path_factory, "lora_only")
    try:
        url = server.base_url
        ids = prompt_ids(tiny_model_dir)
        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        model = get_peft_model(
            hf_model(tiny_model_dir), LoraConfig(r=8, lora_alpha=16, target_modules=targets)
        )
        bridge = make_bridge("lora_only", [url], token=TOKEN, save_dir=tmp_path / "adapters")
        try:
            overlapped = []
            for version in (1, 2, 3):
                optimizer_step(model, ids, lr=5e-2)
                # A request on the previous adapter runs through every hot-swap. LoRA never
                # pauses, so on a loaded box one can finish before the sync starts: at least
                # one of the three must overlap its sync.
                inflight = InFlight(url, bridge.served_model or server.served_model_name, ids)
                bridge.sync(model, version)
                overlapped.append(inflight.check(version - 1, require_overlap=False))
                assert bridge.served_model == f"{server.served_model_name}-v{version}"
                assert httpx.get(f"{url}/bridge/info").json()["served_model"] == bridge.served_model
                assert_serves(url, bridge.served_model, model, ids, version=version)
            assert any(overlapped), "no request was in flight during a LoRA sync"
            names = {m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]}
            assert names == {"tiny", "tiny-v2", "tiny-v3"}  # older adapters unloaded (keep=2)
        finally:
            bridge.close()
    finally:
        server.stop()


# ----------------------------------------------------------------------------------- none
def test_checkpoint_reload_and_restart(tiny_model_dir, tmp_path_factory, tmp_path) -> None:
    server = _server(tiny_model_dir, tmp_path_factory, "none")
    try:
        url, served = server.base_url, server.served_model_name
        model, ids = hf_model(tiny_model_dir), prompt_ids(tiny_model_dir)
        optimizer_step(model, ids)
        with make_bridge("none", [url], token=TOKEN, save_dir=tmp_path / "ckpt") as bridge:
            inflight = InFlight(url, served, ids)
            bridge.sync(model, 1)
            inflight.check(version_at_start=0)
            assert_serves(url, served, model, ids, version=1)
        # The benchmark's legacy mode (bench/bridge_variants.py): restart the server from
        # the checkpoint every sync (by its PID).
        from bench.bridge_variants import RestartBridge

        optimizer_step(model, ids)
        old_pid = server.proc.pid
        bridge = RestartBridge([url], tmp_path / "ckpt2", server, token=TOKEN)
        try:
            stats = bridge.sync(model, 2)
            server = bridge.server
            assert server.proc.pid != old_pid and stats.detail["servers"][0]["restarted"]
            assert_serves(url, served, model, ids, version=2)
        finally:
            bridge.close()
    finally:
        server.stop()
