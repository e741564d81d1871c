"""``shared_vllm`` on CPU: ``GlooBroadcastBridge`` (engine ``gloo_bcast``), the trainer as
rank 0 of a gloo group with every worker of every server (several servers = one broadcast to
all of them). The staged flow it shares: ``trainer/bridge/staged.py``; docs/BRIDGE.md.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, wait
from typing import Any, TypeVar

import torch

from procutil.faults import fault_point
from settings.ports import free_port
from trainer.bridge.deadline import SyncDeadlines, SyncTimeout, bounded, spawn
from trainer.bridge.http import ServerClient
from trainer.bridge.staged import StagedBridge, sweep_segments
from vllm_patching.gloo_group import (
    allgather_flags,
    broadcast,
    gloo_group_on,
    gloo_store,
    remote_group,
    remote_ranks,
)
from vllm_patching.shm_segment import NONCE_BYTES, ShmSegment, new_segment_name, write_nonce
from vllm_patching.transport import DEFAULT_BUCKET_BYTES, PackPlan, bucket_views

T = TypeVar("T")

log = logging.getLogger(__name__)


class GlooBroadcastBridge(StagedBridge):
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
        deadlines: SyncDeadlines | None = None,
    ) -> None:
        super().__init__(server_urls, token=token, timeout=timeout, deadlines=deadlines)
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
            sweep_segments()
            name = new_segment_name()
            self.segment = ShmSegment(name, max(plan.total_bytes, NONCE_BYTES), create=True)
            shm = {
                "shm_segment": name,
                "shm_size": self.segment.size,
                "shm_nonce": write_nonce(self.segment),
            }

        # The gloo group's own timeout, on both sides: a worker woken after the trainer gave
        # up (a SIGCONT) leaves its rendezvous or receive by itself within it.
        group_s, connect_s = self.deadlines.group_s(), self.deadlines.connect

        def init(s: ServerClient, offset: int) -> None:
            s.post(
                "/init_weight_transfer_engine",
                json={
                    "init_info": {
                        "master_address": self.master_address,
                        "master_port": port,
                        "rank_offset": offset,
                        "world_size": world,
                        "timeout_s": group_s,
                        **shm,
                    }
                },
                timeout=connect_s,
            )

        # The workers block in the rendezvous until the trainer joins: issue the HTTP calls
        # concurrently, join as rank 0 (group, handshake all-gather, remote sub-group), then
        # surface any server-side error; all of it within the connect deadline.
        fault_point("connect")
        futures = [
            spawn(lambda s=s, o=o: init(s, o), "bridge-connect")
            for s, o in zip(self.servers, offsets, strict=True)
        ]
        self._store = gloo_store(self.master_address, port, 0, world, group_s)

        store, shared = self._store, self.segment is not None

        def join() -> tuple[list[bool], Any]:
            full = gloo_group_on(store, "shop_r1_bridge", 0, world, group_s)
            local = allgather_flags(full, shared)
            return local, remote_group(store, 0, local, group_s)

        urls = [s.base_url for s in self.servers]
        self.local, self.group = _join_unless_refused(join, futures, urls, connect_s)
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
        group, bufs = self.group, self._bufs

        def send() -> None:
            for buf in bufs:
                broadcast(group, buf, root=0)

        receivers = [
            s.base_url
            for s, local in zip(self.servers, self._server_local(), strict=True)
            if not local
        ]
        bounded("transfer", [(", ".join(receivers), send)], self.deadlines.transfer)

    def _server_local(self) -> list[bool]:
        """Per server: every worker of it reads shared memory (takes no part in the send)."""
        sizes = [int(i["world_size"]) for i in self.infos]
        out, rank = [], 1
        for n in sizes:
            out.append(all(self.local[rank : rank + n]))
            rank += n
        return out

    def _close_data_plane(self) -> None:
        if self._store is not None:
            # Workers drop their group and unmap the segment (best effort: a restarted or
            # stopped server has nothing to release).
            try:
                self.each(lambda s: s.post("/shutdown_weight_transfer_engine"), "close")
            except Exception:  # noqa: BLE001
                pass
        self.group, self._store, self._bufs, self.remote = None, None, [], False
        if self.segment is not None:
            self.segment.close()
            self.segment = None


def _join_unless_refused(
    join: Callable[[], T], inits: list[Future[Any]], urls: list[str], deadline_s: float
) -> T:
    """Run the rank-0 side of the rendezvous (``join``) while the servers' init calls run.

    The workers block in the rendezvous until rank 0 joins, so the calls must overlap. A
    server that answers its init call with an error will never join: raise its error at once
    instead of sitting in gloo's connect loop until the timeout. A rendezvous (or an init
    call, ``urls[k]`` for ``inits[k]``) not done within ``deadline_s`` raises
    ``SyncTimeout`` naming a server that did not answer. (A blocked thread is abandoned; it
    ends with gloo's or the request's timeout and its store is dropped.)
    """
    import httpx

    joined = spawn(join, "bridge-rendezvous")
    end = time.monotonic() + deadline_s

    def failed() -> None:
        for url, f in zip(urls, inits, strict=True):
            if f.done() and (e := f.exception()) is not None:
                if isinstance(e, httpx.TimeoutException):
                    raise SyncTimeout("connect", url, deadline_s) from e
                raise e

    while not wait([joined], timeout=0.05).done:
        failed()
        if time.monotonic() > end:
            late = [u for u, f in zip(urls, inits, strict=True) if not f.done()] or urls
            raise SyncTimeout("connect", ", ".join(late), deadline_s)
    result = joined.result()  # the join's own error, if it failed
    for url, f in zip(urls, inits, strict=True):  # the servers' side, and any error after
        if not wait([f], timeout=max(0.0, end - time.monotonic())).done:
            raise SyncTimeout("connect", url, deadline_s)
        failed()
    return result
