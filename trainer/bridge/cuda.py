"""``shared_vllm`` on CUDA: vLLM 0.32's native ``nccl`` (broadcast) and ``ipc`` (single-copy)
trainer engines, driven through our token-carrying HTTP client.

The native engines enter vLLM's layerwise reload in ``start_weight_update`` (layers go to
the meta device), so generation is paused around the whole round, on every server:
pause(keep) -> start -> update (NCCL broadcast / IPC handles) -> finish(version) -> resume.

- **Several servers (NCCL)**: one NCCL group spans the trainer (rank 0) and every worker of
  every server; vLLM's engine hands its workers ``rank_offset`` 1, and ``_FanOutClient``
  gives server *k* ``1 + workers of servers 0..k-1`` instead (``world_size`` = 1 + all
  workers). One broadcast feeds them all.
- **IPC is one GPU only**: vLLM's ipc worker rebuilds each tensor from the handle stored under
  *its own* GPU's UUID, and a trainer can only export memory of its own GPU; a second worker
  GPU (tensor parallel > 1, or a second server) would fail half-way through an update. Making
  handles for it would mean the trainer holding a full copy of the model in that GPU's memory
  (which vLLM has already claimed for its KV cache) -- a broadcast, done worse. So it is
  refused when the bridge is built (and by launch/placement.py before anything starts).
- **Restarts**: every sync first reads each server's ``run_id`` (``bridge.runs``,
  trainer/bridge/runs.py); a new one means the server's
  engine (and its NCCL group) is gone: the trainer's engine is shut down and set up again.
- **Failures are bounded**: the send runs in a thread; the sync waits for it at most
  ``send_timeout`` s and stops at the first error a server answers (a worker that failed never
  joins the broadcast, so NCCL would wait forever). Then the trainer's engine is shut down (its
  NCCL communicator aborted, so the stuck broadcast returns), every server is resumed (each
  resume bounded by ``resume_timeout``), and the *first* error is raised -- a server error as
  ``BridgeHTTPError``, a timeout as ``WeightSendError`` (never an ``httpx`` transport error,
  which the trainer would take for a server restart). The next sync starts a new engine.
- **Wire dtype**: tensors are cast to the served dtype (bf16) as they are sent, not the fp32
  master copy (half the bytes); LoRA adapters are merged (``params.hf_parameters``).
- ``torch.cuda.set_device(trainer_device)`` in every thread that runs the engine (the current
  device is per thread): NCCL joins from, and IPC keys handles by, the current device.

Every vLLM name used is imported when the bridge is built (``vllm_compat.load``), and only
vLLM 0.32.0 is accepted. Proven without a GPU by tests/unit/trainer/test_bridge_cuda.py (docs/BRIDGE.md).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, wait
from typing import Any, TypeVar

import httpx
import torch

import trainer.bridge.vllm_compat as vllm_compat
from api.retry import is_transient
from settings.ports import free_port
from trainer.bridge.base import SyncStats, WeightBridge
from trainer.bridge.deadline import SyncDeadlines, spawn
from trainer.bridge.http import ServerClient
from trainer.bridge.params import check_against_server, hf_shapes, iter_hf_tensors
from vllm_patching.transport import torch_dtype

T = TypeVar("T")
log = logging.getLogger(__name__)


class WeightSendError(RuntimeError):
    """A GPU weight send did not complete (timed out); the engine was reset."""


class _FanOutClient:
    """vLLM's ``VLLMWeightSyncClient`` protocol over every server, with our token.

    Each call goes to every server at once and returns when all answered; the first error
    any server answers is kept in ``first_error`` (the sync raises that one).
    """

    def __init__(
        self, servers: list[ServerClient], offsets: list[int], json_safe: Callable[[Any], Any]
    ) -> None:
        # Connections of its own, and daemon threads: a request to a stuck server can neither
        # be interrupted (closing the socket does not wake a blocked read) nor be allowed to
        # hold the trainer's exit; ``close`` makes every caller stop waiting for it.
        self.servers = [ServerClient(s.base_url, s.token, s.timeout) for s in servers]
        self.offsets, self.json_safe = offsets, json_safe
        self.version: int | None = None
        self.first_error: BaseException | None = None
        self._lock = threading.Lock()
        self._closed = threading.Event()

    def _each(self, fn: Callable[[int, ServerClient], T]) -> list[T]:
        futures: list[Future[T]] = []
        for k, s in enumerate(self.servers):
            f: Future[T] = Future()
            threading.Thread(
                target=self._call, args=(f, fn, k, s), daemon=True, name=f"bridge-rpc-{k}"
            ).start()
            futures.append(f)
        while wait(futures, timeout=0.1).not_done:
            if self._closed.is_set():  # reset: vLLM's engine thread waiting here returns
                raise WeightSendError("the weight transfer was reset during a server call")
        return [f.result() for f in futures]

    def _call(
        self, out: Future[T], fn: Callable[[int, ServerClient], T], k: int, s: ServerClient
    ) -> None:
        try:
            out.set_result(fn(k, s))
            return
        except httpx.TimeoutException as e:  # the server hangs: not a restart (see module doc)
            err: BaseException = WeightSendError(f"{s.base_url}: no answer in time ({e!r})")
            err.__cause__ = e
        except BaseException as e:  # noqa: BLE001 - recorded, re-raised by the caller
            err = e
        with self._lock:
            if self.first_error is None:
                self.first_error = err
        out.set_exception(err)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        def init(k: int, s: ServerClient) -> None:
            info = dict(init_info)
            if "rank_offset" in info:  # NCCL: vLLM's engine says 1, i.e. one server
                info["rank_offset"] = self.offsets[k]
            s.post("/init_weight_transfer_engine", json={"init_info": info})

        self._each(init)

    def start_weight_update(self) -> None:
        self._each(lambda k, s: s.start_weight_update())

    def update_weights(self, update_info: Any) -> None:
        body = {"update_info": self.json_safe(update_info)}  # IPC handles: pickled + base64
        self._each(lambda k, s: s.post("/update_weights", json=body))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        version = weight_version if weight_version is not None else self.version
        body = {"weight_version": str(version)} if version is not None else None
        self._each(lambda k, s: s.post("/finish_weight_update", json=body))

    def close(self) -> None:
        self._closed.set()
        for s in self.servers:
            s.close()


def _source(vllm: vllm_compat.VllmNames, model_ref: list[torch.nn.Module], dtype: torch.dtype):
    """A vLLM ``WeightSource`` over the model's HF-named tensors (LoRA merged), cast to the
    served dtype one tensor at a time as the engine sends it."""

    class HFWeightSource(vllm.WeightSource):
        def metadata(self) -> list[Any]:
            return [vllm.ParamMeta(n, dtype, shape) for n, shape in hf_shapes(model_ref[0])]

        def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
            for name, t in iter_hf_tensors(model_ref[0]):
                yield name, t.to(dtype)

    return HFWeightSource()


class NativeCudaBridge(WeightBridge):
    """CUDA servers through vLLM's native engines: ``nccl`` (any number of servers, any
    tensor parallelism) or ``ipc`` (``single_copy``: one server on the trainer's GPU)."""

    def __init__(
        self,
        server_urls: Sequence[str],
        token: str | None = None,
        single_copy: bool = False,
        master_address: str = "127.0.0.1",
        master_port: int | None = None,
        timeout: float = 600.0,
        send_timeout: float = 600.0,
        resume_timeout: float = 30.0,
        trainer_device: str | torch.device | None = None,
        deadlines: SyncDeadlines | None = None,
    ) -> None:
        self.vllm = vllm_compat.load()  # every vLLM name, now (fails fast on another vLLM)
        super().__init__(server_urls, token=token, timeout=timeout, deadlines=deadlines)
        self.single_copy = single_copy
        self.master_address, self.master_port = master_address, master_port
        self.send_timeout, self.resume_timeout = send_timeout, resume_timeout
        self.trainer_device = torch.device(trainer_device) if trainer_device else None
        self._model: list[torch.nn.Module] = []
        self.engine: Any = None
        self.client: _FanOutClient | None = None
        self._read_infos()

    def _read_infos(self) -> None:
        self.infos = self.each(ServerClient.info)
        self.runs.record([i["run_id"] for i in self.infos])
        want = "ipc" if self.single_copy else "nccl"
        for s, info in zip(self.servers, self.infos, strict=True):
            if info["backend"] != want:
                raise ValueError(
                    f"{s.base_url} runs backend {info['backend']!r}, this bridge needs {want!r}"
                )
        sizes = [int(i["world_size"]) for i in self.infos]
        if self.single_copy and sum(sizes) > 1:
            raise ValueError(
                f"--single-copy (CUDA IPC) shares the trainer's weights with workers on one GPU "
                f"only, and these servers have {sum(sizes)} workers: vLLM's ipc worker looks "
                "its own GPU's UUID up in every handle. Use the NCCL broadcast (no "
                "--single-copy) for tensor-parallel-size > 1 or several servers."
            )
        dtypes = {i["dtype"] for i in self.infos}
        if len(dtypes) != 1:
            raise ValueError(f"servers disagree on dtype: {sorted(dtypes)}")
        self.dtype = torch_dtype(dtypes.pop())
        self.world_size = 1 + sum(sizes)
        self.offsets = [1 + sum(sizes[:k]) for k in range(len(sizes))]

    # -- engine lifecycle ------------------------------------------------------------------
    def _bind_device(self) -> None:
        """Make the trainer's GPU current in this thread (CUDA keeps one per host thread)."""
        if self.trainer_device is not None and self.trainer_device.type == "cuda":
            torch.cuda.set_device(self.trainer_device)

    def _open(self, model: torch.nn.Module) -> None:
        self._bind_device()
        for info in self.infos:
            check_against_server([n for n, _ in hf_shapes(model)], info["param_map"])
        self.client = _FanOutClient(self.servers, self.offsets, self.vllm.json_safe_update_payload)
        source = _source(self.vllm, self._model, self.dtype)
        if self.single_copy:
            init, engine_cls = self.vllm.IPCTrainerInitInfo(rank=0), self.vllm.IPCTrainerEngine
        else:
            init = self.vllm.NCCLTrainerInitInfo(
                rank=0,
                master_address=self.master_address,
                master_port=self.master_port or free_port(self.master_address),
                world_size=self.world_size,
            )
            engine_cls = self.vllm.NCCLTrainerEngine
        log.info(
            "GPU weight transfer: %s engine, %d server(s), world size %d",
            init.backend,
            len(self.servers),
            self.world_size,
        )
        client = self.client

        def init_engine() -> Any:  # NCCL: the rendezvous waits for every worker to join
            return engine_cls.trainer_init(init, client=client, source=source)

        try:
            self.engine = self._bounded(init_engine, self.send_timeout, "transfer setup")
        except BaseException:
            self._reset("its set-up failed")
            raise

    def _reset(self, why: str) -> None:
        """Drop the trainer's engine (its NCCL communicator is aborted, so a broadcast stuck
        on a dead peer returns); the next sync sets a new one up."""
        if self.engine is not None:
            log.warning("resetting the GPU weight-transfer engine: %s", why)
            try:
                self.engine.shutdown()
            except Exception:  # noqa: BLE001 - the engine is dropped either way
                log.exception("trainer engine shutdown failed")
        if self.client is not None:
            self.client.close()
        self.engine, self.client = None, None

    def _check_restarts(self) -> None:
        ids = self.runs.current()
        if self.runs.restarted(ids):
            self._reset(f"a server restarted (run_id {self.runs.ids} -> {ids})")
            self._read_infos()

    # -- one sync ----------------------------------------------------------------------------
    def sync(self, model: torch.nn.Module, version: int) -> SyncStats:
        t0 = time.perf_counter()
        self._check_restarts()
        self._model[:] = [model]
        if self.engine is None:
            self._open(model)
        assert self.client is not None
        self.client.version, self.client.first_error = version, None
        t1 = time.perf_counter()
        try:
            self.each(ServerClient.pause)
            self._send_bounded()
        except BaseException as e:
            first = self.client.first_error or e
            self._reset(f"the send of version {version} failed: {first!r}")
            self._resume_all(self.resume_timeout, quiet=True)
            if first is not e:
                log.warning("after the first error, the send also failed with %r", e)
            raise first from first.__cause__  # its own cause; ``e`` was logged above
        self._resume_all(None, quiet=False)
        end = time.perf_counter()
        stats = SyncStats(
            version=version,
            total_s=end - t0,
            transfer_s=end - t1,
            stall_s=end - t1,
            bytes=sum(n * self.dtype.itemsize for n in (_numel(s) for _, s in hf_shapes(model))),
            detail={"servers": len(self.servers), "world_size": self.world_size},
        )
        self.last_stats = stats
        return stats

    def _bounded(self, fn: Callable[[], T], timeout: float, what: str) -> T:
        """``fn()`` in a thread, waited for at most ``timeout`` s, and no longer once a server
        answered an error (its workers will never join the NCCL call ``fn`` is waiting in)."""
        assert self.client is not None
        client, done = self.client, Future()

        def run() -> None:
            try:
                self._bind_device()  # the current CUDA device is per thread
                done.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                done.set_exception(e)

        threading.Thread(target=run, name=f"bridge-{what}", daemon=True).start()
        deadline = time.monotonic() + timeout
        while not wait([done], timeout=0.05).done:
            if client.first_error is not None:
                raise client.first_error
            if time.monotonic() > deadline:
                raise WeightSendError(
                    f"the weight {what} did not finish within {timeout:g} s "
                    "(a worker is stuck or gone); the engine was reset"
                )
        return done.result()

    def _send_bounded(self) -> None:
        # start -> update (+ the broadcast) -> finish(version), as vLLM's engine drives it
        self._bounded(self.engine.send_weights, self.send_timeout, "send")

    def _resume_all(self, timeout: float | None, quiet: bool) -> None:
        """Resume every server; ``quiet``: after a failure, log (do not raise) resume errors,
        so the original error is the one the caller sees."""

        def resume(s: ServerClient) -> None:
            s.post(
                "/resume",
                retryable=_resume_retryable,
                **({} if timeout is None else {"timeout": timeout}),
            )

        futures = [spawn(lambda s=s: resume(s), "bridge-resume") for s in self.servers]
        for s, f in zip(self.servers, futures, strict=True):
            try:
                f.result()
            except Exception as e:
                if not quiet:
                    raise
                log.error("resume of %s after a failed sync failed: %r", s.base_url, e)

    def close(self) -> None:
        if self.engine is not None:
            # The workers release their side too (best effort: a server may be gone).
            for s in self.servers:
                try:
                    s.post("/shutdown_weight_transfer_engine", timeout=self.resume_timeout)
                except Exception as e:  # noqa: BLE001
                    log.info("%s kept its transfer engine (%r)", s.base_url, e)
            self.engine.shutdown()
            self.engine = None
        self._reset("closed")
        super().close()


def _resume_retryable(exc: BaseException) -> bool:
    """``/resume`` is idempotent, so the one transient rule (``api.retry.is_transient``)
    applies in full -- after an error answer uvicorn closes the keep-alive connection and the
    next request on it can be reset (seen in the harness after a failed /update_weights) --
    except a timeout: a server that hangs is not waited for again (each resume is bounded by
    the timeout its caller gives)."""
    return is_transient(exc) and not isinstance(exc, httpx.TimeoutException)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
