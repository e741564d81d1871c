"""The worker-side gloo engine with its same-host shared-memory fast path, without a server.

Real parts: the engine class vLLM would instantiate, real gloo groups over loopback, a real
/dev/shm segment. The trainer's side (rank 0) runs in the test thread exactly as
``GlooBroadcastBridge._open`` / ``_send`` do it.
"""

from __future__ import annotations

import threading
import uuid
from types import SimpleNamespace

import pytest
import torch

from settings.ports import free_port
from vllm_patching.gloo_group import (
    allgather_flags,
    broadcast,
    gloo_group_on,
    gloo_store,
    remote_group,
)
from vllm_patching.shm_segment import SHM_PREFIX, ShmSegment, write_nonce
from vllm_patching.transport import (
    TensorMeta,
    bucket_views,
    dtype_name,
    metas_to_wire,
    pack_into,
    plan_buckets,
)

pytestmark = pytest.mark.unit

gloo_engine = pytest.importorskip("vllm_patching.engines.gloo")


def _engine():
    pc = SimpleNamespace(rank=0, world_size=1, data_parallel_index=0)  # rank = rank_offset
    cfg = SimpleNamespace(parallel_config=pc, model_config=None)
    return gloo_engine.GlooBroadcastWeightTransferEngine(None, cfg, torch.device("cpu"), None)


def _tensors() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(f"w{i}", torch.randn(64, 32 + i, generator=g)) for i in range(5)]


def test_local_rank_reads_shared_memory_remote_rank_gets_gloo() -> None:
    """Rank 1 maps the trainer's segment (same host); rank 2 is told a segment name it
    cannot open (as on another host) and falls back to the remote gloo sub-group."""
    tensors = _tensors()
    metas = [TensorMeta(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in tensors]
    bucket_bytes = 20_000  # several buckets
    plan = plan_buckets(metas, bucket_bytes)
    port = free_port()
    seg = ShmSegment(f"{SHM_PREFIX}{uuid.uuid4().hex}", plan.total_bytes, create=True)
    nonce = write_nonce(seg)
    engines = {1: _engine(), 2: _engine()}
    errors: list[BaseException] = []

    def init(rank: int) -> None:
        name = seg.name if rank == 1 else f"{SHM_PREFIX}{uuid.uuid4().hex}"
        info = {
            "master_address": "127.0.0.1",
            "master_port": port,
            "rank_offset": rank,
            "world_size": 3,
            "timeout_s": 60,
            "shm_segment": name,
            "shm_size": seg.size,
            "shm_nonce": nonce,
        }
        try:
            eng = engines[rank]
            eng.init_transfer_engine(eng.parse_init_info(info))
        except BaseException as e:  # noqa: BLE001 - surfaced below
            errors.append(e)

    try:
        threads = [threading.Thread(target=init, args=(r,)) for r in (1, 2)]
        for t in threads:
            t.start()
        store = gloo_store("127.0.0.1", port, 0, 3, timeout_s=60)
        full = gloo_group_on(store, "shop_r1_bridge", 0, 3, timeout_s=60)
        local = allgather_flags(full, True)
        group = remote_group(store, 0, local, timeout_s=60)
        for t in threads:
            t.join(60)
        assert not errors, errors
        assert local == [True, True, False] and group is not None
        assert engines[1].segment is not None and engines[1].group is None
        assert engines[2].segment is None and engines[2].group is not None

        for version in range(2):  # the second round reuses the receive buffers
            for _, t in tensors:
                t.add_(version)
            update = {**metas_to_wire(metas), "bucket_bytes": bucket_bytes}
            for eng in engines.values():  # what /bridge/stage does on each worker
                eng.start_weight_update()
                eng.update_weights(update)
            buckets = bucket_views(seg.buffer, plan)
            pack_into(plan, [t for _, t in tensors], buckets)  # the one copy
            for b in buckets:
                broadcast(group, b)  # only rank 2 listens
            for rank, eng in engines.items():
                eng._thread.join(60)
                staged = eng._staged
                assert eng._error is None and staged is not None
                assert eng.last_path == ("shm" if rank == 1 else "gloo")
                for (name, got), (want_name, want) in zip(staged, tensors, strict=True):
                    assert name == want_name and torch.equal(got, want)
                eng.discard()  # (apply needs a vLLM model: covered by the integration tests)
        # rank 1's views are on the segment itself: no copy on the local receive side
        ptr = engines[1].segment.buffer.data_ptr()
        assert bucket_views(engines[1].segment.buffer, plan)[0].data_ptr() == ptr
    finally:
        for eng in engines.values():
            eng.shutdown()
        seg.close()


def test_discard_refuses_while_receiving_and_clears_after() -> None:
    eng = _engine()
    gate = threading.Event()
    eng._thread = threading.Thread(target=gate.wait)
    eng._thread.start()
    with pytest.raises(RuntimeError, match="still being received"):
        eng.discard()
    gate.set()
    eng._thread.join()
    eng._staged = [("w", torch.zeros(1))]
    eng.discard()
    assert eng._thread is None and eng._staged is None
    eng.finish_weight_update()  # nothing staged: a no-op, which lets vLLM close the session


def test_a_new_transfer_abandons_an_update_still_receiving_over_the_old_one() -> None:
    """A frozen server that wakes runs the stale /bridge/stage of a sync the trainer gave up
    on: its updater thread waits on the old group. The trainer's next connect (a new group:
    ``abandon``) must not be refused by it, and when the old thread ends its result (here an
    error) must not land on the new update."""
    eng = _engine()
    gate, started = threading.Event(), threading.Event()

    def old_receive(info):  # the stale receive: blocked until the old group fails
        started.set()
        gate.wait(60)
        raise RuntimeError("Connection closed by peer")

    eng.stage = old_receive
    eng.start_weight_update()
    eng.update_weights({"names": [], "dtype_names": [], "shapes": []})
    old = eng._thread
    assert started.wait(60)
    with pytest.raises(RuntimeError, match="still being received"):
        eng.discard()  # the same transfer: still refused
    eng.abandon()  # what init_transfer_engine does first
    eng.start_weight_update()  # not refused
    new = [("w", torch.ones(1))]
    eng.stage = lambda info: new
    eng.update_weights({"names": [], "dtype_names": [], "shapes": []})
    eng._thread.join(60)
    gate.set()
    old.join(60)
    assert not old.is_alive()
    assert eng._error is None and eng._staged == new  # the old thread's error was dropped
