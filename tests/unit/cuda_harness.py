"""CPU stand-in of CUDA vLLM servers, for the GPU path of the bridge (trainer/bridge/cuda.py).

What is real: vLLM 0.32's RL router (``vllm.entrypoints.rl.online.api_router``: /pause,
/resume, /init_weight_transfer_engine, /start_weight_update, /update_weights,
/finish_weight_update, ...) and our ``/bridge/*`` endpoint plugin, served by uvicorn on a free
port; vLLM's ``AsyncLLM`` weight methods (bound to the stand-in engine client); vLLM's GPU
``Worker`` weight-update methods (session bookkeeping, parsing); vLLM's worker engines
``NCCLWeightTransferEngine`` / ``IPCWeightTransferEngine`` (``parse_init_info``,
``parse_update_info``, the rank computation, the packed NCCL consumer, the IPC handle lookup by
GPU UUID) and the trainer engines, unchanged.

What is stubbed, at the narrowest point (``gpu_stubs``): NCCL (``stateless_init_process_group``
returns a ``FakeComm`` of an in-process ``Fabric``: a rendezvous that waits for every rank, and a
broadcast that completes only when every receiver took the bytes, hangs while one does not, and
fails at once when its communicator is aborted -- what NCCL does), CUDA streams, the current
device (thread-local, set by ``torch.cuda.set_device``), device UUIDs (``GPU-fake-<index>``),
CUDA IPC (``reduce_tensor`` / ``rebuild_cuda_tensor``: a handle names the tensor by a weak
reference, so a trainer that drops a shared tensor too early is caught), and vLLM's layerwise
reload (recorded; it rewrites real GPU layers). The engine client's ``collective_rpc`` runs each
worker in a thread of its own and, like vLLM's engine core, one rpc at a time per server.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
import weakref
from argparse import Namespace
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

HANG_S = 120.0
"""How long a fake NCCL call waits for a peer that never comes before it raises (real NCCL
waits forever; the fake gives up so that a broken bridge fails a test instead of hanging it)."""

_DEVICE = threading.local()
_IPC: dict[int, weakref.ref] = {}


def current_device() -> int:
    return getattr(_DEVICE, "index", 0)


def set_current_device(index: int) -> None:
    _DEVICE.index = index


# ---------------------------------------------------------------------------- fake NCCL
class FakeCommAborted(RuntimeError):
    pass


class FakeComm:
    """One rank of a fake NCCL communicator (what ``PyNcclCommunicator`` offers the engines)."""

    def __init__(self, fabric: Fabric, key: tuple, rank: int, world: int, device: int) -> None:
        self.fabric, self.key, self.rank, self.world, self.device = fabric, key, rank, world, device
        self.inbox: list[tuple[torch.Tensor, threading.Event]] = []
        self.dead = threading.Event()
        self.sent_bytes = 0

    def destroy(self) -> None:  # ncclCommAbort: pending calls on this rank fail
        self.dead.set()
        self.fabric.destroyed.append((self.key, self.rank))

    def _wait(self, ready, what: str) -> None:
        deadline = time.monotonic() + self.fabric.hang_s
        while not ready():
            if self.dead.is_set():
                raise FakeCommAborted(f"fake NCCL rank {self.rank}: {what} aborted")
            if time.monotonic() > deadline:
                raise TimeoutError(f"fake NCCL rank {self.rank}: {what} hung (a GPU waits forever)")
            time.sleep(0.005)

    def broadcast(self, tensor: torch.Tensor, src: int, stream: Any = None) -> None:
        peers = self.fabric.groups[self.key]
        if self.rank == src:
            acks = []
            for r, peer in peers.items():
                if r != src:
                    ev = threading.Event()
                    peer.inbox.append((tensor.detach().clone(), ev))
                    acks.append((peer, ev))
            self.sent_bytes += tensor.numel() * tensor.element_size()
            # Completes only once every receiver took the bytes (a dead peer never does).
            self._wait(lambda: all(ev.is_set() for _, ev in acks), "broadcast send")
            return
        self._wait(lambda: bool(self.inbox), "broadcast receive")
        data, ev = self.inbox.pop(0)
        if data.shape != tensor.shape or data.dtype != tensor.dtype:
            raise RuntimeError(f"fake NCCL: receive {tensor.shape} {tensor.dtype} got {data.shape}")
        tensor.copy_(data)
        ev.set()


@dataclass
class Fabric:
    """All fake NCCL groups of a test: ``joins`` records every rank that joined."""

    hang_s: float = HANG_S
    groups: dict[tuple, dict[int, FakeComm]] = field(default_factory=dict)
    joins: list[dict[str, Any]] = field(default_factory=list)
    destroyed: list[tuple] = field(default_factory=list)

    def join(self, master_address: str, master_port: int, rank: int, world_size: int, device):
        key = (master_address, master_port, world_size)
        group = self.groups.setdefault(key, {})
        if rank in group or not 0 <= rank < world_size:
            raise RuntimeError(f"fake NCCL: bad or duplicate rank {rank} of {world_size}")
        comm = FakeComm(self, key, rank, world_size, int(device))
        group[rank] = comm
        self.joins.append(
            {"port": master_port, "rank": rank, "world_size": world_size, "device": int(device)}
        )
        comm._wait(lambda: len(group) == world_size, "rendezvous")  # TCPStore waits for all
        return comm


# ----------------------------------------------------------------------------- fake IPC
def fake_reduce_tensor(t: torch.Tensor):
    """``reduce_tensor`` of a CUDA tensor: (rebuild, args) with args[6] = the owner's device."""
    key = id(t)
    _IPC[key] = weakref.ref(t)
    args = ("fake-ipc", key, str(t.dtype), tuple(t.shape), t.numel(), 0, current_device())
    return fake_rebuild_cuda_tensor, args


def fake_rebuild_cuda_tensor(*args: Any) -> torch.Tensor:
    ref = _IPC.get(args[1])
    t = ref() if ref is not None else None
    if t is None:
        raise RuntimeError(
            "fake CUDA IPC: the trainer freed the shared tensor before it was opened"
        )
    return t


@contextlib.contextmanager
def gpu_stubs(monkeypatch, fabric: Fabric):
    """Replace the GPU transfer (and nothing else) with the fakes above."""
    import vllm.model_executor.model_loader.reload as reload
    from vllm.distributed.weight_transfer import ipc_engine, nccl_common, packed_tensor

    fake_stream = SimpleNamespace(synchronize=lambda: None)
    monkeypatch.setattr(nccl_common, "stateless_init_process_group", fabric.join)
    monkeypatch.setattr(packed_tensor, "_get_streams", lambda idx, n: (fake_stream,) * n)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: fake_stream)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: set_current_device(_index(d)))
    monkeypatch.setattr(torch.cuda, "ipc_collect", lambda: None)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda i: SimpleNamespace(uuid=f"GPU-fake-{i}")
    )
    monkeypatch.setattr(torch.accelerator, "current_device_index", current_device)
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda *a: None)
    monkeypatch.setattr(ipc_engine, "reduce_tensor", fake_reduce_tensor)
    monkeypatch.setattr(ipc_engine, "rebuild_cuda_tensor", fake_rebuild_cuda_tensor)
    monkeypatch.setattr(reload, "initialize_layerwise_reload", lambda m: m.events.append("reload"))
    monkeypatch.setattr(
        reload, "finalize_layerwise_reload", lambda m, c: m.events.append("finalize")
    )
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    set_current_device(0)
    yield


def _index(d: Any) -> int:
    d = torch.device(d) if not isinstance(d, int) else torch.device("cuda", d)
    return d.index or 0


# ------------------------------------------------------------------- workers, engine client
class RecordingModel(torch.nn.Module):
    """The worker's model: records what ``load_weights`` got (name, dtype, shape, values)."""

    def __init__(self) -> None:
        super().__init__()
        self.loaded: list[tuple[str, torch.Tensor]] = []
        self.events: list[str] = []

    def load_weights(self, weights) -> set[str]:
        names = set()
        for name, t in weights:
            self.loaded.append((name, t.detach().clone()))
            names.add(name)
        self.events.append("load")
        return names


def make_worker(backend: str, tp: int, rank: int, gpu: int):
    """vLLM's GPU ``Worker`` (its real weight-update methods) around a real worker engine."""
    from vllm.config import ParallelConfig, VllmConfig
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.v1.worker.gpu_worker import Worker

    parallel = ParallelConfig(tensor_parallel_size=tp)
    parallel.rank = rank
    wt = WeightTransferConfig(backend=backend)
    vcfg = VllmConfig(parallel_config=parallel, weight_transfer_config=wt)
    model = RecordingModel()
    # The NCCL receive buffers are allocated on the worker's device: CPU here (the stub);
    # the IPC engine rebuilds on ``device.index`` and looks that GPU's UUID up in the handles.
    device = torch.device("cuda", gpu) if backend == "ipc" else torch.device("cpu")
    engine = WeightTransferEngineFactory.create_engine(wt, vcfg, device, model)
    worker = object.__new__(Worker)
    worker.vllm_config, worker.rank, worker.weight_transfer_engine = vcfg, rank, engine
    worker._weight_update_active, worker._weight_update_is_draft = False, False
    worker.model_runner = SimpleNamespace(reset_lora_state=lambda: None)
    worker.gpu, worker.model, worker.parsed = gpu, model, []
    for kind in ("init", "update"):  # spy on vLLM's own parsers: keep every typed request
        parse = getattr(engine, f"parse_{kind}_info")

        def spy(d, parse=parse, kind=kind):
            typed = parse(d)
            worker.parsed.append((kind, typed))
            return typed

        setattr(engine, f"parse_{kind}_info", spy)
    return worker


def _engine_client_class():
    from vllm.v1.engine.async_llm import AsyncLLM

    class EngineClientStandIn:
        """``AsyncLLM``'s own weight methods over workers run in threads."""

        init_weight_transfer_engine = AsyncLLM.init_weight_transfer_engine
        shutdown_weight_transfer_engine = AsyncLLM.shutdown_weight_transfer_engine
        start_weight_update = AsyncLLM.start_weight_update
        update_weights = AsyncLLM.update_weights
        finish_weight_update = AsyncLLM.finish_weight_update

        def __init__(self, server: StandInServer) -> None:
            self.server, self.version = server, "0"
            self.core = asyncio.Lock()  # the engine core runs one rpc / utility call at a time
            self.vllm_config = SimpleNamespace(
                parallel_config=server.workers[0].vllm_config.parallel_config,
                model_config=SimpleNamespace(dtype=server.dtype, model="tiny"),
            )

        async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
            self.server.calls.append((method, kwargs))
            if method == "bridge_param_map":
                maps = {"params": self.server.param_map, "tied_embeddings": True}
                return [maps] * len(self.server.workers)

            def run(w):
                set_current_device(w.gpu)
                return getattr(w, method)(*args, **(kwargs or {}))

            async with self.core:
                out = await asyncio.gather(
                    *(asyncio.to_thread(run, w) for w in self.server.workers),
                    return_exceptions=True,
                )
            for r in out:  # vLLM answers once every worker answered; the first error wins
                if isinstance(r, BaseException):
                    raise r
            return out

        async def pause_generation(self, mode="abort", clear_cache=True) -> None:
            self.server.calls.append(("pause", {"mode": mode}))
            async with self.core:
                self.server.paused = True

        async def resume_generation(self) -> None:
            self.server.calls.append(("resume", None))
            async with self.core:
                self.server.paused = False

        async def update_weight_version(self, new_version: str) -> None:
            self.server.calls.append(("version", new_version))
            self.version = new_version

        async def get_weight_version(self) -> str:
            return self.version

    return EngineClientStandIn


# ------------------------------------------------------------------------------ servers
class StandInServer:
    """One "CUDA vLLM server" (TP ``tp`` on GPUs ``first_gpu..``) behind real uvicorn."""

    def __init__(
        self,
        monkeypatch,
        backend: str,
        tp: int,
        param_map: dict,
        token: str,
        dtype: torch.dtype = torch.bfloat16,
        first_gpu: int = 0,
    ) -> None:
        from settings.ports import free_port

        self.monkeypatch, self.backend, self.tp, self.token = monkeypatch, backend, tp, token
        self.dtype, self.first_gpu, self.param_map = dtype, first_gpu, param_map
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.calls: list[tuple[str, Any]] = []
        self.paused = False
        self._uvicorn = None
        self.start()

    def start(self) -> None:
        import uvicorn
        from fastapi import FastAPI
        from vllm.entrypoints.rl.online.api_router import router as rl_router
        from vllm.entrypoints.serve.exception_handling.register import init_exception_handler

        from vllm_patching.protocol import SETTINGS_ENV, TOKEN_ENV, BridgeSettings
        from vllm_patching.routes import BridgeEndpointPlugin

        self.run_id = uuid.uuid4().hex
        settings = BridgeSettings(
            mode="shared_vllm",
            single_copy=self.backend == "ipc",
            backend=self.backend,
            device="cuda",
            run_id=self.run_id,
            config_path="/nonexistent",
            served_model_name="tiny",
        )
        self.monkeypatch.setenv(SETTINGS_ENV, settings.model_dump_json())
        self.monkeypatch.setenv(TOKEN_ENV, self.token)
        self.workers = [
            make_worker(self.backend, self.tp, r, self.first_gpu + r) for r in range(self.tp)
        ]
        self.client = _engine_client_class()(self)
        plugin = BridgeEndpointPlugin()

        @contextlib.asynccontextmanager
        async def lifespan(app):
            await plugin.init_state(self.client, app.state, Namespace())
            yield

        app = FastAPI(lifespan=lifespan)
        app.state.engine_client = self.client
        app.state.args = Namespace(log_error_stack=False)
        init_exception_handler(app)  # vLLM's own: an error is a JSON answer (500 for a crash)
        app.include_router(rl_router)
        plugin.attach_router(app)
        config = uvicorn.Config(
            app, host="127.0.0.1", port=self.port, log_level="warning", timeout_graceful_shutdown=2
        )
        self._uvicorn = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._uvicorn.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 300  # generous: a busy box
        while not self._uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"stand-in server on port {self.port} did not start")
            time.sleep(0.02)
        self.calls.clear()

    def stop(self) -> None:
        """The process dies: its workers' communicators go with it."""
        for w in self.workers:
            group = getattr(w.weight_transfer_engine, "model_update_group", None)
            if group is not None:
                group.destroy()
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True
            self._thread.join(timeout=30)
            self._uvicorn = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def sequence(self) -> list[str]:
        """The weight protocol's calls, in order (init, pause, start, update, finish, ...)."""
        names = {
            "init_weight_transfer_engine": "init",
            "start_weight_update": "start",
            "update_weights": "update",
            "finish_weight_update": "finish",
            "shutdown_weight_transfer_engine": "shutdown",
        }
        return [names.get(m, m) for m, _ in self.calls]
