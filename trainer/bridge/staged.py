"""The staged flow shared by ``shared_vllm``'s CPU bridges (docs/BRIDGE.md).

One sync: pack -> ``start_weight_update`` + ``update_weights`` (each worker's updater thread
starts receiving; generation continues) -> transfer -> pause -> ``finish_weight_update
{version}`` (apply) -> resume. Only the last three steps stall generation. The data plane is
the subclass's: ``trainer/bridge/gloo_broadcast.py`` (engine ``gloo_bcast``) and
``trainer/bridge/shared_memory.py`` (engine ``shm``, ``--single-copy``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from trainer.bridge.base import SyncStats, WeightBridge
from trainer.bridge.deadline import SyncDeadlines, SyncTimeout, bounded
from trainer.bridge.http import BridgeHTTPError, ServerClient
from trainer.bridge.params import check_against_server, hf_parameters, wire_metas
from trainer.bridge.resident import ResidentWeights
from vllm_patching.shm_segment import sweep_stale_segments
from vllm_patching.transport import Packer, PackPlan, TensorMeta, metas_to_wire, plan_buckets

T = TypeVar("T")

log = logging.getLogger(__name__)


class StagedBridge(WeightBridge):
    """Shared flow; subclasses provide the data plane."""

    backend: str = ""
    bucket_bytes: int = 0

    def __init__(
        self,
        server_urls: Sequence[str],
        token: str | None = None,
        timeout: float = 600.0,
        deadlines: SyncDeadlines | None = None,
    ):
        super().__init__(server_urls, token=token, timeout=timeout, deadlines=deadlines)
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
        self.runs.record([i["run_id"] for i in self.infos])
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

    def _adopt(self, packer: Packer, params: list[torch.nn.Parameter]) -> ResidentWeights | None:
        """Move the trainer's parameters into the data plane's buckets (``ResidentWeights``),
        so syncs copy nothing; called once per data plane."""
        return ResidentWeights.adopt(packer, params)

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
        self.runs.record([i["run_id"] for i in self.infos])
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
        if self.runs.restarted():
            self._reset()

    def _each_run(self, fn: Callable[[ServerClient, str], T], phase: str) -> list[T]:
        """``fn(server, its run_id)`` on every server concurrently, within ``phase``'s
        deadline."""
        ids = self.runs.ids
        assert ids is not None  # recorded when the bridge was built
        calls = [
            (s.base_url, lambda s=s, rid=rid: fn(s, rid))
            for s, rid in zip(self.servers, ids, strict=True)
        ]
        return bounded(phase, calls, self.deadlines.of(phase))

    @torch.no_grad()
    def sync(self, model: torch.nn.Module, version: int) -> SyncStats:
        t0 = time.perf_counter()
        phases: dict[str, float] = {}
        if self.remote:
            self._check_restarts()
            phases["check_s"] = time.perf_counter() - t0
        try:
            return self._sync(model, version, t0, phases)
        except SyncTimeout:
            # A server froze mid-sync and may wake up and go on reading this data plane:
            # take the parameters out of its buffers and drop it (the workers' side within
            # the close deadline), so nothing the trainer does next can reach a half-read
            # buffer and a later sync sets everything up afresh (docs/FAULT_TOLERANCE.md).
            self._drop_data_plane()
            raise

    def _sync(
        self, model: torch.nn.Module, version: int, t0: float, phases: dict[str, float]
    ) -> SyncStats:
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
            self._resident = self._adopt(self._packer, [p for _, p in params])
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
                ),
                "stage",
            )
            t3 = time.perf_counter()
            self._send()
            body: dict[str, Any] = {"version": version}
        else:
            t3 = time.perf_counter()
            body = {"version": version, "update_info": update_info}
        t4 = time.perf_counter()
        answers = self._each_run(
            lambda s, rid: s.post("/bridge/apply", json={**body, "run_id": rid}).json(),
            "apply",
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


def sweep_segments() -> None:
    """Free /dev/shm segments left by trainers that were killed before they could unlink."""
    for name in sweep_stale_segments():
        log.warning("removed stale weight segment /dev/shm/%s (its trainer is gone)", name)
