"""Every bridge mode against the real vLLM CPU server and the embedded tiny model.

For each mode: a real optimizer step on the trainer's HF model, ``sync``, then vLLM's greedy
completion equals the HF model's greedy generation token for token (logprobs close), the
weight version advanced, and a request in flight through the sync completed
(``tests/integration/bridge_checks.py``).

What runs where (5 vLLM starts and a restart; one server per kind, as a server's mode and
engine are fixed at its start: ``/bridge/stage`` and ``/bridge/apply`` answer only in mode
``shared_vllm``, ``/bridge/reload`` only in ``none``, ``/bridge/lora/load`` only in
``lora_only``; the engine, ``gloo_bcast`` or ``shm`` (``--single-copy``), is a vLLM option):
- ``gloo_server`` (module): the process tree, the token, the broadcast (same-host and TCP
  paths), and the first of the two servers of ``test_one_trainer_broadcasts_to_two_servers``
  (the second starts there: one gloo group must span two live servers);
- ``shm_server`` (``TestSingleCopy``): the LoRA merge into a full-weight sync, then the single
  copy, the legacy restart from a checkpoint and the fresh segment after it (one restart);
- a ``lora_only`` server of its own (``--enable-lora``);
- the session's ``none`` server (tests/conftest.py ``none_server``, shared with the GRPO
  trainer tests when they run in the same process).
"""

from __future__ import annotations

import copy
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch

from launch.vllm_server import BridgeServer, start_bridge_server
from tests.integration.bridge_checks import (
    InFlight,
    assert_serves,
    hf_greedy,
    hf_model,
    optimizer_step,
    prompt_ids,
    vllm_greedy,
)
from trainer.bridge import make_bridge
from vllm_patching.protocol import TOKEN_HEADER
from vllm_patching.shm_segment import SHM_DIR, SHM_PREFIX

pytestmark = pytest.mark.integration

TOKEN = secrets.token_hex(16)


def _server(tiny_model_dir: Path, tmp_path_factory, mode: str, **kw) -> BridgeServer:
    log = tmp_path_factory.mktemp(f"bridge-{mode}") / "server.log"
    return start_bridge_server(tiny_model_dir, mode, log, token=TOKEN, forked=True, **kw)


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
    assert httpx.get(f"{url}/is_paused").status_code == 401  # a dev-mode GET: token too
    paused = httpx.get(f"{url}/is_paused", headers={TOKEN_HEADER: TOKEN})
    assert paused.json()["is_paused"] is False
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
        stats = bridge.sync(model, 1)
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
        # with a request in flight: this bridge's second sync (its first set up the gloo
        # group and the segment before it paused, which a request could outlast no longer)
        inflight = InFlight(url, served, ids)
        bridge.sync(model, 2)
        inflight.check(version_at_start=1)
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
@dataclass
class Slot:
    """The single-copy server; a test that restarts it puts the new one here."""

    server: BridgeServer


@pytest.fixture(scope="class")
def shm_server(tiny_model_dir, tmp_path_factory) -> Iterator[Slot]:
    """One ``shared_vllm --single-copy`` server (engine ``shm``) for ``TestSingleCopy``: the LoRA
    merge, then the restarts (which replace it in the slot); stopped after the class."""
    slot = Slot(_server(tiny_model_dir, tmp_path_factory, "shared_vllm", single_copy=True))
    yield slot
    slot.server.stop()


def served_version(url: str) -> int:
    return int(httpx.get(f"{url}/bridge/health").json()["weight_version"])


class TestSingleCopy:
    """The two tests on the single-copy server (``shm_server``)."""

    def test_lora_model_full_weight_sync_serves_the_merged_model(
        self, shm_server: Slot, tiny_model_dir
    ) -> None:
        """A LoRA (peft) trainer with a full-weight bridge: the adapters are merged for the sync.

        The trainer wraps the base model in a real peft LoRA model, takes a real optimizer step
        on the adapters and syncs through ``shared_vllm --single-copy``: vLLM then generates
        exactly what peft's own ``merge_and_unload`` model generates (the same names and merge
        code serve the CUDA path, tests/unit/trainer/test_bridge_cuda.py). Runs on the module's
        single-copy server (it was a server of its own in test_bridge_lora_merge.py)."""
        from peft import LoraConfig, get_peft_model

        server = shm_server.server
        url, served = server.base_url, server.served_model_name
        version = served_version(url) + 1
        ids = prompt_ids(tiny_model_dir)
        torch.manual_seed(0)
        model = get_peft_model(
            hf_model(tiny_model_dir), LoraConfig(r=8, lora_alpha=32, target_modules="all-linear")
        )
        optimizer_step(model, ids, lr=5e-2)  # the adapters move (B leaves zero)
        with make_bridge("shared_vllm", [url], single_copy=True, token=TOKEN) as bridge:
            bridge.sync(model, version)
            merged = copy.deepcopy(model).merge_and_unload().eval()
            assert_serves(url, served, merged, ids, version=version)
        base = hf_model(tiny_model_dir)
        name = "model.layers.0.self_attn.q_proj.weight"
        assert not torch.equal(merged.state_dict()[name], base.state_dict()[name])

    def test_single_copy_and_restarts(self, shm_server: Slot, tiny_model_dir, tmp_path) -> None:
        """Single copy through /dev/shm, then again with a request in flight; then the
        benchmark's legacy mode (bench/sync/variants.py ``RestartBridge``: stop the server by
        its PID, start it from the saved checkpoint); then the single copy again into the
        restarted server, which (a new run id) gets a fresh segment, nothing stale reused.
        One restart serves both checks (they were one restart each, of this server and of the
        ``none`` server: ``RestartBridge`` restarts any server with its own launch options,
        whatever its mode)."""
        from bench.sync.variants import RestartBridge

        server = shm_server.server
        url, served = server.base_url, server.served_model_name
        v0 = served_version(url)
        model, ids = hf_model(tiny_model_dir), prompt_ids(tiny_model_dir)
        optimizer_step(model, ids)
        bridge = make_bridge("shared_vllm", [url], single_copy=True, token=TOKEN)
        try:
            bridge.sync(model, v0 + 1)  # creates the segment, the parameters move into it
            assert_serves(url, served, model, ids, version=v0 + 1)
            segment = bridge.segment.name
            assert (Path(SHM_DIR) / segment).exists()
            # In flight through a sync that pauses: not the first, whose set-up (the segment,
            # before the pause) once outlasted a whole request on a fast-decoding run.
            optimizer_step(model, ids)
            inflight = InFlight(url, served, ids)
            bridge.sync(model, v0 + 2)
            inflight.check(version_at_start=v0 + 1)
            assert_serves(url, served, model, ids, version=v0 + 2)
            # the legacy restart: from the checkpoint, by the PID
            optimizer_step(model, ids)
            old_pid = server.proc.pid
            restart = RestartBridge([url], tmp_path / "ckpt", server, token=TOKEN)
            try:
                stats = restart.sync(model, v0 + 3)
                server = shm_server.server = restart.server
                assert server.proc.pid != old_pid and stats.detail["servers"][0]["restarted"]
                assert_serves(url, served, model, ids, version=v0 + 3)
            finally:
                restart.close()
            # the single copy into the restarted server (new run id): a fresh segment
            optimizer_step(model, ids)
            stats = bridge.sync(model, v0 + 4)
            assert_serves(url, served, model, ids, version=v0 + 4)
            # the parameters left the old segment before it closed and live in the new one
            assert stats.detail["packed_bytes"] == 0 and stats.detail["resident_params"] > 0
            assert bridge.segment.name != segment and not (Path(SHM_DIR) / segment).exists()
            segment = bridge.segment.name
        finally:
            bridge.close()
        assert not (Path(SHM_DIR) / segment).exists()
        assert segment.startswith(SHM_PREFIX)


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
            for version in (1, 2, 3):
                optimizer_step(model, ids, lr=5e-2)
                # A request on the previous adapter runs through every hot-swap (LoRA never
                # pauses): it is still streaming, on its version, when the sync returns.
                served = bridge.served_model or server.served_model_name
                inflight = InFlight(url, served, ids)
                bridge.sync(model, version)
                inflight.check(version - 1)
                assert bridge.served_model == f"{server.served_model_name}-v{version}"
                assert httpx.get(f"{url}/bridge/info").json()["served_model"] == bridge.served_model
                assert_serves(url, bridge.served_model, model, ids, version=version)
            names = {m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]}
            assert names == {"tiny", "tiny-v2", "tiny-v3"}  # older adapters unloaded (keep=2)
        finally:
            bridge.close()
    finally:
        server.stop()


# ----------------------------------------------------------------------------------- none
def test_checkpoint_reload(none_server: BridgeServer, tiny_model_dir, tmp_path) -> None:
    """``none``: the server reloads the saved checkpoint in place (``/bridge/reload``) while a
    request is in flight. On the session's ``none`` server (tests/conftest.py, reset to the
    start weights at version 0; the GRPO trainer tests share it); the restart from a
    checkpoint runs in ``test_single_copy_and_restarts``."""
    from tests.integration.grpo_harness import TOKEN as NONE_TOKEN

    url, served = none_server.base_url, none_server.served_model_name
    # its engine core was forked from the server, not spawned (vllm_patching.plugin)
    assert "[bridge] engine core forked from server pid" in none_server.proc.log_path.read_text()
    model, ids = hf_model(tiny_model_dir), prompt_ids(tiny_model_dir)
    optimizer_step(model, ids)
    with make_bridge("none", [url], token=NONE_TOKEN, save_dir=tmp_path / "ckpt") as bridge:
        # a sync writes its checkpoint before the pause, and the first write also pays its
        # one-time costs: a request sent through it could finish before the pause on a loaded
        # box (it did once in a whole-suite run); the request goes through the second sync
        bridge.sync(model, 1)
        inflight = InFlight(url, served, ids)
        bridge.sync(model, 2)
        inflight.check(version_at_start=1)
        assert_serves(url, served, model, ids, version=2)
