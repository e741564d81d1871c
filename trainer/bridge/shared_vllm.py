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

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, wait
from typing import Any, TypeVar

import torch

from settings.ports import free_port
from trainer.bridge.base import SyncStats, WeightBridge
from trainer.bridge.http import BridgeHTTPError, ServerClient
from trainer.bridge.params import check_against_server, hf_parameters, wire_metas
from vllm_patching.gloo_group import (
    allgather_flags,
    broadcast,
    gloo_group_on,
    gloo_store,
    remote_group,
    remote_ranks,
)
from vllm_patching.shm_segment import (
    NONCE_BYTES,
    ShmSegment,
    new_segment_name,
    sweep_stale_segments,
    write_nonce,
)
from vllm_patching.transport import (
    DEFAULT_BUCKET_BYTES,
    Packer,
    PackPlan,
    TensorMeta,
    bucket_views,
    metas_to_wire,
    plan_buckets,
)

T = TypeVar("T")

log = logging.getLogger(__name__)


class _StagedBridge(WeightBridge):
    """Shared flow; subclasses provide the data plane."""

    backend: str = ""
    bucket_bytes: int = 0

    def __init__(
        self,
        server_urls: Sequence[str],
        token: str | None = None,
        timeout: float = 600.0,
        resident: bool = True,
    ):
        super().__init__(server_urls, token=token, timeout=timeout)
        self.resident = resident
        """Keep the trainer's parameters in the data plane's buckets (``ResidentWeights``):
        syncs copy nothing. Off: every sync packs (copies) the weights into the buckets."""
        self._resident: ResidentWeights | None = None
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
        self._packer: Packer | None = None
        """Copies the weights into the data plane's buckets; built once per data plane."""
        self.remote = False
        """Some receiver gets the bytes over the network: the trainer must stage first (so
        its updater thread listens), send, then apply. Otherwise one call per server."""

    # data plane hooks
    def _open(self, plan: PackPlan) -> None: ...
    def _close_data_plane(self) -> None: ...
    def _buckets(self) -> list[torch.Tensor]: ...
    def _send(self) -> None: ...

    def _prepare(self, params: Sequence[tuple[str, torch.Tensor]]) -> None:
        metas = wire_metas(list(params), self.dtype)
        if self.metas is None:
            for info in self.infos:
                check_against_server([m.name for m in metas], info["param_map"])
            self.plan = plan_buckets(metas, self.bucket_bytes or (1 << 62))
            self.metas = metas
            try:
                self._open(self.plan)
            except BaseException:
                # Half-open (a server refused, a rendezvous failed): forget it all, so the
                # caller's retry sets the data plane up from scratch instead of packing
                # into buffers no receiver maps.
                self._drop_data_plane()
                raise
        elif metas != self.metas:
            raise ValueError("the model's parameter set changed between syncs")

    def _reset(self) -> None:
        """A server restarted (new run_id): its transfer engine is gone. Set the data plane
        up again from scratch; nothing from the old run (group, segment) is reused."""
        self.infos = self.each(ServerClient.info)
        self.run_ids = [i["run_id"] for i in self.infos]
        self._drop_data_plane()

    def close(self) -> None:
        self._drop_data_plane()
        super().close()

    def _drop_data_plane(self) -> None:
        """Close the data plane and forget its plan: the next sync opens a new one."""
        if self._resident is not None:  # the parameters must leave the buckets first
            self._resident.release()
            self._resident = None
        self._close_data_plane()
        self.plan, self.metas, self._packer = None, None, None

    def _check_restarts(self) -> None:
        """Ask every server for its run_id before a network round: a worker left waiting on
        a broadcast that never comes would hold its update open for minutes, so restarts
        must be known before staging anywhere. (Local-only rounds skip this round trip:
        the run_id travels with the one call and a mismatch is a 409 with nothing staged.)
        """
        if [h["run_id"] for h in self.each(ServerClient.health)] != self.run_ids:
            self._reset()

    def _each_run(self, fn: Callable[[ServerClient, str], T]) -> list[T]:
        """``fn(server, its run_id)`` on every server concurrently."""
        futures = [
            self._pool.submit(fn, s, rid) for s, rid in zip(self.servers, self.run_ids, strict=True)
        ]
        return [f.result() for f in futures]

    @torch.no_grad()
    def sync(self, model: torch.nn.Module, version: int) -> SyncStats:
        t0 = time.perf_counter()
        phases: dict[str, float] = {}
        if self.remote:
            self._check_restarts()
            phases["check_s"] = time.perf_counter() - t0
        params = hf_parameters(model)
        self._prepare(params)
        for attempt in range(2):
            try:
                return self._sync_once(params, version, t0, phases)
            except BridgeHTTPError as e:
                if e.status != 409 or attempt:
                    raise
                self._reset()  # a server restarted since the last sync: once more, afresh
                self._prepare(params)
        raise AssertionError("unreachable")

    def _sync_once(
        self,
        params: list[tuple[str, torch.nn.Parameter]],
        version: int,
        t0: float,
        phases: dict[str, float],
    ) -> SyncStats:
        assert self.plan is not None and self.metas is not None
        t1 = time.perf_counter()
        if self._packer is None:
            self._packer = Packer(self.plan, self._buckets())
            if self.resident:
                self._resident = ResidentWeights.adopt(self._packer, [p for _, p in params])
        copied = self._packer.pack([p.detach() for _, p in params])
        t2 = time.perf_counter()
        update_info: dict[str, Any] = {
            **metas_to_wire(self.metas),
            "bucket_bytes": self.bucket_bytes,
        }
        if self.remote:
            self._each_run(
                lambda s, rid: s.post(
                    "/bridge/stage", json={"update_info": update_info, "run_id": rid}
                )
            )
            t3 = time.perf_counter()
            self._send()
            body: dict[str, Any] = {"version": version}
        else:
            t3 = time.perf_counter()
            body = {"version": version, "update_info": update_info}
        t4 = time.perf_counter()
        answers = self._each_run(
            lambda s, rid: s.post("/bridge/apply", json={**body, "run_id": rid}).json()
        )
        t5 = time.perf_counter()
        phases.update(pack_s=t2 - t1, stage_call_s=t3 - t2, send_s=t4 - t3, apply_call_s=t5 - t4)
        stats = SyncStats(
            version=version,
            total_s=t5 - t0,
            pack_s=t2 - t1,
            transfer_s=t4 - t2,
            stall_s=t5 - t4,
            bytes=self.plan.total_bytes,
            detail={
                "servers": answers,
                "phases": phases,
                "remote": self.remote,
                "packed_bytes": copied,
                "resident_params": len(self._resident.params) if self._resident else 0,
            },
        )
        self.last_stats = stats
        return stats


class ResidentWeights:
    """The trainer's parameters, moved into the data plane's buckets: zero-copy syncs.

    A sync packs the same parameters into the same slots every step, so instead the
    parameters are made to live there: ``param.data`` becomes the slot's typed view (the
    values are copied once, here). The optimizer then updates the shared bytes in place and
    a sync has nothing left to copy: with ``--single-copy`` (and the broadcast's same-host
    fast path) vLLM's workers read the trainer's own parameters. This is safe because a
    sync is synchronous -- the trainer does not step while the workers read -- and because
    ``release`` moves the values back into private memory before the buckets go away.

    Parameters that cannot live in their slot (another device or dtype than the serving
    one, non-contiguous) are left alone and copied by every sync as before.
    """

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.params = params

    @classmethod
    @torch.no_grad()
    def adopt(cls, packer: Packer, params: Sequence[torch.nn.Parameter]) -> ResidentWeights:
        moved = []
        for p, view in zip(params, packer.slot_views(), strict=True):
            if p.device != view.device or p.dtype != view.dtype or p.shape != view.shape:
                continue
            if not p.is_contiguous() or not isinstance(p, torch.nn.Parameter):
                continue  # (a LoRA-merged weight is a new tensor each sync: copied)
            view.copy_(p.data)
            p.data = view
            moved.append(p)
        log.info(
            "%d of %d parameters now live in the weight-transfer buffers (zero-copy syncs)",
            len(moved),
            len(params),
        )
        return cls(moved)

    @torch.no_grad()
    def release(self) -> None:
        """Give every adopted parameter private memory again (same values)."""
        for p in self.params:
            p.data = p.data.clone()
        self.params = []


class GlooBroadcastBridge(_StagedBridge):
    """CPU broadcast to every worker of every server over one gloo group.

    ``shm_fast_path`` (default): receivers on this host (proven by a nonce handshake
    through a /dev/shm segment) read the packed bytes from shared memory instead of over
    loopback TCP; only the others are sent the bytes over gloo. Off: everyone gets gloo.
    """

    backend = "gloo_bcast"

    def __init__(
        self,
        server_urls: Sequence[str],
        token: str | None = None,
        master_address: str = "127.0.0.1",
        master_port: int | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout: float = 600.0,
        shm_fast_path: bool = True,
        resident: bool = True,
    ) -> None:
        super().__init__(server_urls, token=token, timeout=timeout, resident=resident)
        self.bucket_bytes = bucket_bytes
        self.master_address = master_address
        self.master_port = master_port
        self.shm_fast_path = shm_fast_path
        self.group = None
        self.segment: ShmSegment | None = None
        self.local: list[bool] = []
        """Per rank of the full group: True where the receiver reads shared memory."""
        self._store = None
        self._bufs: list[torch.Tensor] = []

    def _open(self, plan: PackPlan) -> None:
        port = self.master_port or free_port(self.master_address)
        sizes = [int(i["world_size"]) for i in self.infos]
        world = 1 + sum(sizes)
        log.info(
            "weight broadcast group at %s:%d, %d ranks (trainer = rank 0)",
            self.master_address,
            port,
            world,
        )
        offsets = [1 + sum(sizes[:k]) for k in range(len(sizes))]
        shm: dict[str, Any] = {}
        if self.shm_fast_path:
            _sweep()
            name = new_segment_name()
            self.segment = ShmSegment(name, max(plan.total_bytes, NONCE_BYTES), create=True)
            shm = {
                "shm_segment": name,
                "shm_size": self.segment.size,
                "shm_nonce": write_nonce(self.segment),
            }

        def init(s: ServerClient, offset: int) -> None:
            s.post(
                "/init_weight_transfer_engine",
                json={
                    "init_info": {
                        "master_address": self.master_address,
                        "master_port": port,
                        "rank_offset": offset,
                        "world_size": world,
                        **shm,
                    }
                },
            )

        # The workers block in the rendezvous until the trainer joins: issue the HTTP calls
        # concurrently, join as rank 0 (group, handshake all-gather, remote sub-group), then
        # surface any server-side error.
        futures = [
            self._pool.submit(init, s, o) for s, o in zip(self.servers, offsets, strict=True)
        ]
        self._store = gloo_store(self.master_address, port, 0, world, RENDEZVOUS_S)

        store, shared = self._store, self.segment is not None

        def join() -> tuple[list[bool], Any]:
            full = gloo_group_on(store, "shop_r1_bridge", 0, world, RENDEZVOUS_S)
            local = allgather_flags(full, shared)
            return local, remote_group(store, 0, local, RENDEZVOUS_S)

        self.local, self.group = _join_unless_refused(join, futures)
        self.remote = bool(remote_ranks(self.local))
        if self.segment is not None and not any(self.local[1:]):
            self.segment.close()  # nobody shares this host's memory: pack into private buffers
            self.segment = None
        if self.segment is not None:
            self._bufs = bucket_views(self.segment.buffer, plan)
        else:
            self._bufs = [torch.empty(n, dtype=torch.uint8) for n in plan.bucket_sizes]

    def _buckets(self) -> list[torch.Tensor]:
        return self._bufs

    def _send(self) -> None:
        if self.group is None:
            return  # every receiver is local: the pack was the transfer
        for buf in self._bufs:
            broadcast(self.group, buf, root=0)

    def _close_data_plane(self) -> None:
        if self._store is not None:
            # Workers drop their group and unmap the segment (best effort: a restarted or
            # stopped server has nothing to release).
            try:
                self.each(lambda s: s.post("/shutdown_weight_transfer_engine"))
            except Exception:  # noqa: BLE001
                pass
        self.group, self._store, self._bufs, self.remote = None, None, [], False
        if self.segment is not None:
            self.segment.close()
            self.segment = None


class SharedMemoryBridge(_StagedBridge):
    """CPU single copy: the trainer writes into /dev/shm, workers read it in place."""

    backend = "shm"

    def __init__(
        self,
        server_urls: Sequence[str],
        token: str | None = None,
        timeout: float = 600.0,
        resident: bool = True,
    ):
        super().__init__(server_urls, token=token, timeout=timeout, resident=resident)
        self.segment: ShmSegment | None = None

    def _open(self, plan: PackPlan) -> None:
        _sweep()
        name = new_segment_name()
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


RENDEZVOUS_S = 120.0
"""How long rank 0 waits for the workers to join the transfer group. They join within a
second of their init call on a healthy server; a server whose init failed is noticed at
once by ``_join_unless_refused``, so this only bounds a worker that hangs."""


def _join_unless_refused(join: Callable[[], T], inits: list[Future[Any]]) -> T:
    """Run the rank-0 side of the rendezvous (``join``) while the servers' init calls run.

    The workers block in the rendezvous until rank 0 joins, so the calls must overlap. A
    server that answers its init call with an error will never join: raise its error at once
    instead of sitting in gloo's connect loop until the timeout. (The blocked join thread is
    abandoned; it ends with gloo's timeout and its store is dropped.)
    """
    joined: Future[T] = Future()

    def run() -> None:
        try:
            joined.set_result(join())
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            joined.set_exception(e)

    threading.Thread(target=run, name="bridge-rendezvous", daemon=True).start()
    while not wait([joined], timeout=0.05).done:
        for f in inits:
            if f.done() and f.exception() is not None:
                raise f.exception()  # type: ignore[misc]
    result = joined.result()  # the join's own error, if it failed
    for f in inits:  # the servers' side of the rendezvous, and any error they raised after
        f.result()
    return result


def _sweep() -> None:
    """Free /dev/shm segments left by trainers that were killed before they could unlink."""
    for name in sweep_stale_segments():
        log.warning("removed stale weight segment /dev/shm/%s (its trainer is gone)", name)
