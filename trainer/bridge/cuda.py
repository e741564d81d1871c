"""``shared_vllm`` on CUDA: vLLM's native ``nccl`` (broadcast) and ``ipc`` (single-copy)
trainer engines, driven through our token-carrying HTTP client.

The native engines enter vLLM's layerwise reload in ``start_weight_update`` (layers go to
the meta device), so generation is paused around the whole round:
pause(keep) -> start -> update (NCCL broadcast / IPC handles) -> finish(version) -> resume.
Needs vLLM installed in the trainer's environment (the engines live there).

Transport facts proven on an H100 with plain torch (tests/gpu/test_bridge_cuda_transport.py,
docs/BRIDGE.md): CUDA IPC shares a parameter between processes with no copy; NCCL refuses
two ranks on one GPU ("Duplicate GPU detected"), hence IPC for same-device transfer.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from launch.procs import free_port
from trainer.bridge.base import SyncStats, WeightBridge
from trainer.bridge.http import ServerClient
from trainer.bridge.params import check_against_server, hf_tensors


class _HTTPSyncClient:
    """vLLM's ``VLLMWeightSyncClient`` protocol over our authenticated ServerClient."""

    def __init__(self, server: ServerClient) -> None:
        self.server = server
        self.version: int | None = None

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.server.post("/init_weight_transfer_engine", json={"init_info": init_info})

    def start_weight_update(self) -> None:
        self.server.post("/start_weight_update")

    def update_weights(self, update_info: Any) -> None:
        # IPC handles are not JSON: vLLM's own HTTP client pickles+base64s them.
        from vllm.distributed.weight_transfer.clients import _json_safe_update_payload

        self.server.post(
            "/update_weights", json={"update_info": _json_safe_update_payload(update_info)}
        )

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        version = weight_version if weight_version is not None else self.version
        body = {"weight_version": str(version)} if version is not None else None
        self.server.post("/finish_weight_update", json=body)


def _source(model_ref: list[torch.nn.Module]):
    """A vLLM ``WeightSource`` over the trainer model's HF-named tensors."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class HFWeightSource(WeightSource):
        def metadata(self) -> list[ParamMeta]:
            return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in hf_tensors(model_ref[0])]

        def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
            yield from hf_tensors(model_ref[0])

    return HFWeightSource()


class NativeCudaBridge(WeightBridge):
    """One CUDA server (the native engines rendezvous with a single engine client)."""

    mode = "shared_vllm"

    def __init__(
        self,
        server_urls: Sequence[str],
        token: str | None = None,
        single_copy: bool = False,
        master_address: str = "127.0.0.1",
        master_port: int | None = None,
        timeout: float = 600.0,
    ) -> None:
        if len(server_urls) != 1:
            raise ValueError("the native CUDA engines drive exactly one server per trainer engine")
        super().__init__(server_urls, token=token, timeout=timeout)
        self.info = self.servers[0].info()
        want = "ipc" if single_copy else "nccl"
        if self.info["backend"] != want:
            raise ValueError(
                f"server runs backend {self.info['backend']!r}, this bridge needs {want!r}"
            )
        self.single_copy = single_copy
        self.master_address = master_address
        self.master_port = master_port
        self.client = _HTTPSyncClient(self.servers[0])
        self._model: list[torch.nn.Module] = []
        self.engine = None

    def _init(self) -> None:
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        if self.single_copy:
            from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

            init_info = IPCTrainerInitInfo(rank=0)
        else:
            from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

            init_info = NCCLTrainerInitInfo(
                rank=0,
                master_address=self.master_address,
                master_port=self.master_port or free_port(self.master_address),
                world_size=1 + int(self.info["world_size"]),
            )
        self.engine = WeightTransferTrainerFactory.trainer_init(
            init_info, client=self.client, source=_source(self._model)
        )

    def sync(self, model: torch.nn.Module, version: int) -> SyncStats:
        t0 = time.perf_counter()
        self._model[:] = [model]
        if self.engine is None:
            check_against_server([n for n, _ in hf_tensors(model)], self.info["param_map"])
            self._init()
        self.client.version = version
        server = self.servers[0]
        server.pause()
        try:
            t1 = time.perf_counter()
            self.engine.send_weights()  # start -> update -> finish(version)
        finally:
            server.resume()
        end = time.perf_counter()
        stats = SyncStats(
            version=version,
            total_s=end - t0,
            transfer_s=end - t1,
            stall_s=end - t1,
            bytes=sum(t.numel() * t.element_size() for _, t in hf_tensors(model)),
        )
        self.last_stats = stats
        return stats

    def close(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
        super().close()
