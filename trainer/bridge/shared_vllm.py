"""``shared_vllm`` on CPU: full weights through our staged engines.

- ``GlooBroadcastBridge`` (engine ``gloo_bcast``): the trainer is rank 0 of a gloo group with
  every worker of every server (several servers = one broadcast to all of them).
- ``SharedMemoryBridge`` (engine ``shm``, ``--single-copy``): the trainer packs straight into
  one POSIX shared-memory segment that every worker maps; only metadata goes over HTTP.

One sync: pack -> ``start_weight_update`` + ``update_weights`` (each worker's updater thread
starts receiving; generation continues) -> transfer -> pause -> ``finish_weight_update
{version}`` (apply) -> resume. Only the last three steps stall generation.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any

import torch

from launch.procs import free_port
from trainer.bridge.base import SyncStats, WeightBridge
from trainer.bridge.http import ServerClient
from trainer.bridge.params import check_against_server, hf_tensors, wire_metas
from vllm_patching.transport import (
    DEFAULT_BUCKET_BYTES,
    SHM_PREFIX,
    PackPlan,
    ShmSegment,
    TensorMeta,
    broadcast,
    gloo_group,
    metas_to_wire,
    pack_into,
    plan_buckets,
)


class _StagedBridge(WeightBridge):
    """Shared flow; subclasses provide the data plane."""

    backend: str = ""
    bucket_bytes: int = 0

    def __init__(
        self, server_urls: Sequence[str], token: str | None = None, timeout: float = 600.0
    ):
        super().__init__(server_urls, token=token, timeout=timeout)
        self.infos = self.each(ServerClient.info)
        for url, info in zip(server_urls, self.infos, strict=True):
            if info["backend"] != self.backend:
                raise ValueError(
                    f"{url} runs weight-transfer backend {info['backend']!r}, "
                    f"{type(self).__name__} needs {self.backend!r}"
                )
        dtypes = {i["dtype"] for i in self.infos}
        if len(dtypes) != 1:
            raise ValueError(f"servers disagree on dtype: {sorted(dtypes)}")
        self.dtype = dtypes.pop()
        self.run_ids = [i["run_id"] for i in self.infos]
        self.plan: PackPlan | None = None
        self.metas: list[TensorMeta] | None = None

    # data plane hooks
    def _open(self, plan: PackPlan) -> None: ...
    def _close_data_plane(self) -> None: ...
    def _buckets(self) -> list[torch.Tensor]: ...
    def _send(self) -> None: ...

    def _prepare(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        metas = wire_metas(tensors, self.dtype)
        if self.metas is None:
            for info in self.infos:
                check_against_server([m.name for m in metas], info["param_map"])
            self.plan = plan_buckets(metas, self.bucket_bytes or (1 << 62))
            self.metas = metas
            self._open(self.plan)
        elif metas != self.metas:
            raise ValueError("the model's parameter set changed between syncs")

    def _check_restarts(self) -> None:
        """A restarted server (new run_id) lost its transfer engine: set it up again.

        Nothing from the old run (group, segment name) is reused on the server side.
        """
        run_ids = [h["run_id"] for h in self.each(ServerClient.health)]
        if run_ids != self.run_ids:
            self.infos = self.each(ServerClient.info)
            self.run_ids = run_ids
            self._close_data_plane()
            self.plan, self.metas = None, None

    @torch.no_grad()
    def sync(self, model: torch.nn.Module, version: int) -> SyncStats:
        t0 = time.perf_counter()
        self._check_restarts()
        tensors = hf_tensors(model)
        self._prepare(tensors)
        assert self.plan is not None and self.metas is not None
        pack_into(self.plan, [t for _, t in tensors], self._buckets())
        t1 = time.perf_counter()
        update_info: dict[str, Any] = {
            **metas_to_wire(self.metas),
            "bucket_bytes": self.bucket_bytes,
        }

        def stage(s: ServerClient) -> None:
            s.start_weight_update()
            s.post("/update_weights", json={"update_info": update_info})

        self.each(stage)
        self._send()
        t2 = time.perf_counter()
        stall, answers = self.paused_apply(version)
        stats = SyncStats(
            version=version,
            total_s=time.perf_counter() - t0,
            pack_s=t1 - t0,
            transfer_s=t2 - t1,
            stall_s=stall,
            bytes=self.plan.total_bytes,
            detail={"servers": answers},
        )
        self.last_stats = stats
        return stats


class GlooBroadcastBridge(_StagedBridge):
    """CPU broadcast to every worker of every server over one gloo group."""

    backend = "gloo_bcast"

    def __init__(
        self,
        server_urls: Sequence[str],
        token: str | None = None,
        master_address: str = "127.0.0.1",
        master_port: int | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout: float = 600.0,
    ) -> None:
        super().__init__(server_urls, token=token, timeout=timeout)
        self.bucket_bytes = bucket_bytes
        self.master_address = master_address
        self.master_port = master_port
        self.group = None
        self._bufs: list[torch.Tensor] = []

    def _open(self, plan: PackPlan) -> None:
        port = self.master_port or free_port(self.master_address)
        sizes = [int(i["world_size"]) for i in self.infos]
        world = 1 + sum(sizes)
        offsets = [1 + sum(sizes[:k]) for k in range(len(sizes))]

        def init(s: ServerClient, offset: int) -> None:
            s.post(
                "/init_weight_transfer_engine",
                json={
                    "init_info": {
                        "master_address": self.master_address,
                        "master_port": port,
                        "rank_offset": offset,
                        "world_size": world,
                    }
                },
            )

        # The workers block in the rendezvous until the trainer joins: issue the HTTP calls
        # concurrently, join as rank 0, then surface any server-side error.
        futures = [
            self._pool.submit(init, s, o) for s, o in zip(self.servers, offsets, strict=True)
        ]
        try:
            self.group = gloo_group(self.master_address, port, 0, world)
        finally:
            for f in futures:
                f.result()
        self._bufs = [torch.empty(n, dtype=torch.uint8) for n in plan.bucket_sizes]

    def _buckets(self) -> list[torch.Tensor]:
        return self._bufs

    def _send(self) -> None:
        for buf in self._bufs:
            broadcast(self.group, buf, root=0)

    def _close_data_plane(self) -> None:
        self.group = None

    def close(self) -> None:
        self._close_data_plane()
        super().close()


class SharedMemoryBridge(_StagedBridge):
    """CPU single copy: the trainer writes into /dev/shm, workers read it in place."""

    backend = "shm"

    def __init__(
        self, server_urls: Sequence[str], token: str | None = None, timeout: float = 600.0
    ):
        super().__init__(server_urls, token=token, timeout=timeout)
        self.segment: ShmSegment | None = None

    def _open(self, plan: PackPlan) -> None:
        name = f"{SHM_PREFIX}{uuid.uuid4().hex}"
        self.segment = ShmSegment(name, max(plan.total_bytes, 1), create=True)
        info = {"segment": name, "size": self.segment.size}
        self.each(lambda s: s.post("/init_weight_transfer_engine", json={"init_info": info}))

    def _buckets(self) -> list[torch.Tensor]:
        assert self.segment is not None and self.plan is not None
        return [self.segment.buffer[: self.plan.total_bytes]]

    def _send(self) -> None:
        """Nothing to send: the bytes are already where the workers read them."""

    def _close_data_plane(self) -> None:
        if self.segment is not None:
            try:
                self.each(lambda s: s.post("/shutdown_weight_transfer_engine"))
            except Exception:  # noqa: BLE001 - the server may be gone; still unlink
                pass
            self.segment.close()
            self.segment = None

    def close(self) -> None:
        self._close_data_plane()
        super().close()
