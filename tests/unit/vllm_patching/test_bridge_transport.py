"""Packing plan, shared-memory segment and gloo group of the bridge's data plane."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from settings.ports import free_port
from vllm_patching.gloo_group import (
    allgather_flags,
    broadcast,
    gloo_group,
    gloo_group_on,
    gloo_store,
    remote_group,
    remote_ranks,
)
from vllm_patching.shm_segment import (
    NONCE_BYTES,
    SHM_DIR,
    SHM_PREFIX,
    ShmSegment,
    check_segment_name,
    shm_handshake,
    write_nonce,
)
from vllm_patching.transport import (
    Packer,
    TensorMeta,
    bucket_views,
    dtype_name,
    metas_from_wire,
    metas_to_wire,
    pack_into,
    plan_buckets,
    unpack,
)

pytestmark = pytest.mark.unit


def _tensors() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("model.embed_tokens.weight", torch.randn(33, 8, generator=g)),
        ("model.layers.0.self_attn.q_proj.weight", torch.randn(8, 8, generator=g)),
        ("model.layers.0.self_attn.q_proj.bias", torch.randn(8, generator=g).to(torch.bfloat16)),
        ("model.norm.weight", torch.randn(3, generator=g)),
    ]


def _metas(ts) -> list[TensorMeta]:
    return [TensorMeta(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in ts]


@pytest.mark.parametrize("bucket_bytes", [64, 300, 1 << 30])
def test_pack_unpack_roundtrip_in_order(bucket_bytes: int) -> None:
    ts = _tensors()
    plan = plan_buckets(_metas(ts), bucket_bytes)
    assert all(s.offset % 64 == 0 for s in plan.slots)
    buckets = [torch.zeros(n, dtype=torch.uint8) for n in plan.bucket_sizes]
    pack_into(plan, [t for _, t in ts], buckets)
    out = list(unpack(plan, buckets))
    assert [n for n, _ in out] == [n for n, _ in ts]
    for (_, got), (_, want) in zip(out, ts, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_buckets_respect_size_and_oversized_tensor_travels_alone() -> None:
    ts = _tensors()
    plan = plan_buckets(_metas(ts), bucket_bytes=300)
    # the 33x8 float32 embedding (1056 B) is larger than a bucket: alone in bucket 0
    assert plan.slots[0].bucket == 0 and plan.bucket_sizes[0] >= 1056
    assert plan.slots[1].bucket == 1
    assert all(size <= 300 for size in plan.bucket_sizes[1:])


def test_pack_casts_to_wire_dtype_and_rejects_wrong_shape() -> None:
    ts = _tensors()
    metas = [TensorMeta(m.name, "bfloat16", m.shape) for m in _metas(ts)]
    plan = plan_buckets(metas)
    buckets = [torch.zeros(n, dtype=torch.uint8) for n in plan.bucket_sizes]
    pack_into(plan, [t for _, t in ts], buckets)
    name, first = next(iter(unpack(plan, buckets)))
    assert first.dtype == torch.bfloat16 and torch.equal(first, ts[0][1].to(torch.bfloat16))
    with pytest.raises(ValueError, match="expected"):
        pack_into(plan, [torch.zeros(2, 2)] + [t for _, t in ts[1:]], buckets)


def test_packer_reuses_its_views_and_packs_new_values_every_time() -> None:
    ts = _tensors()
    plan = plan_buckets(_metas(ts), bucket_bytes=300)
    buckets = [torch.zeros(n, dtype=torch.uint8) for n in plan.bucket_sizes]
    packer = Packer(plan, buckets)
    for step in range(3):  # the trainer's syncs: same packer, new weights each time
        values = [t + step for _, t in ts]
        packer.pack(values)
        for (_, got), want in zip(unpack(plan, buckets), values, strict=True):
            assert torch.equal(got, want)
    with pytest.raises(ValueError, match="plan has 4 tensors, got 3"):
        packer.pack([t for _, t in ts[:3]])


def test_wire_metadata_roundtrip_and_validation() -> None:
    metas = _metas(_tensors())
    wire = metas_to_wire(metas)
    assert metas_from_wire(**wire) == metas
    with pytest.raises(ValueError):
        metas_from_wire(["a"], [], [[1]])
    with pytest.raises(ValueError, match="unknown dtype"):
        TensorMeta("a", "nodtype", (1,)).nbytes  # noqa: B018


def test_shared_memory_segment_is_read_in_place_and_unlinked() -> None:
    name = f"{SHM_PREFIX}unittest{free_port()}"
    owner = ShmSegment(name, 4096, create=True)
    reader = ShmSegment(name, 4096, create=False)
    try:
        owner.buffer[:4].copy_(torch.tensor([1, 2, 3, 4], dtype=torch.uint8))
        assert reader.buffer[:4].tolist() == [1, 2, 3, 4]  # same pages, no copy
        reader.buffer[4] = 9
        assert int(owner.buffer[4]) == 9
    finally:
        reader.close()
        owner.close()
    with pytest.raises(FileNotFoundError):
        ShmSegment(name, 4096, create=False)


@pytest.mark.parametrize(
    "bad", ["../etc/passwd", "psm_123", f"{SHM_PREFIX}a/b", f"{SHM_PREFIX}a.b"]
)
def test_segment_names_are_restricted(bad: str) -> None:
    with pytest.raises(ValueError):
        check_segment_name(bad)


def test_gloo_broadcast_reaches_every_rank() -> None:
    port = free_port()
    got: dict[int, torch.Tensor] = {}

    def rank(r: int) -> None:
        group = gloo_group("127.0.0.1", port, r, 3, timeout_s=60)
        t = (
            torch.arange(1000, dtype=torch.uint8)
            if r == 0
            else torch.zeros(1000, dtype=torch.uint8)
        )
        broadcast(group, t)
        got[r] = t

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert set(got) == {0, 1, 2}
    assert torch.equal(got[1], got[0]) and torch.equal(got[2], got[0])


# ------------------------------------------------- same-host shared-memory fast path pieces


def test_bucket_views_lay_buckets_back_to_back_without_copy() -> None:
    ts = _tensors()
    plan = plan_buckets(_metas(ts), bucket_bytes=300)
    flat = torch.zeros(plan.total_bytes + 64, dtype=torch.uint8)
    views = bucket_views(flat, plan)
    assert [v.numel() for v in views] == list(plan.bucket_sizes)
    pack_into(plan, [t for _, t in ts], views)
    for (_, got), (_, want) in zip(unpack(plan, views), ts, strict=True):
        assert torch.equal(got, want)
    assert views[1].data_ptr() == flat.data_ptr() + plan.bucket_sizes[0]  # same memory
    with pytest.raises(ValueError, match="needs"):
        bucket_views(flat[: plan.total_bytes - 1], plan)


def test_nonce_handshake_proves_the_segment_is_shared() -> None:
    name = f"{SHM_PREFIX}nonce{free_port()}"
    owner = ShmSegment(name, 4096, create=True)
    try:
        nonce = write_nonce(owner)
        seg = shm_handshake(name, 4096, nonce)
        assert seg is not None
        seg.close()
        # a different nonce (another segment under the same name), a missing segment (another
        # host / IPC namespace) or a too-small one: fall back to the network, no error
        assert shm_handshake(name, 4096, "00" * NONCE_BYTES) is None
        assert shm_handshake(f"{SHM_PREFIX}missing{free_port()}", 4096, nonce) is None
        assert shm_handshake(name, 8192, nonce) is None
        with pytest.raises(ValueError):
            shm_handshake("../etc/passwd", 4096, nonce)
    finally:
        owner.close()


def test_segment_creation_fails_cleanly_when_dev_shm_is_too_small() -> None:
    name = f"{SHM_PREFIX}huge{free_port()}"
    with pytest.raises(OSError, match="cannot reserve"):
        ShmSegment(name, 1 << 60, create=True)  # 1 EiB: never fits
    assert not os.path.exists(os.path.join(SHM_DIR, name))  # nothing left behind


@pytest.mark.parametrize(
    ("local", "remote"),
    [([True, True, False], [2]), ([True, True, True], []), ([True, False, False], [1, 2])],
)
def test_remote_ranks(local: list[bool], remote: list[int]) -> None:
    assert remote_ranks(local) == remote


def test_allgather_flags_and_remote_subgroup_broadcast() -> None:
    """Rank 1 is local (shared memory), ranks 2 and 3 remote: only they join the sub-group,
    and a broadcast on it reaches them, with the sub-group's own rank numbering."""
    port = free_port()
    flags = [True, True, False, False]
    seen: dict[int, list[bool]] = {}
    got: dict[int, torch.Tensor | None] = {}
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            store = gloo_store("127.0.0.1", port, r, 4, timeout_s=60)
            full = gloo_group_on(store, "shop_r1_bridge", r, 4, timeout_s=60)
            seen[r] = allgather_flags(full, flags[r])
            sub = remote_group(store, r, seen[r], timeout_s=60)
            if sub is None:
                got[r] = None
                return
            t = (
                torch.arange(100, dtype=torch.uint8)
                if r == 0
                else torch.zeros(100, dtype=torch.uint8)
            )
            broadcast(sub, t)
            got[r] = t
        except BaseException as e:  # noqa: BLE001 - surfaced below
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert all(seen[r] == flags for r in range(4))
    assert got[1] is None  # the local rank takes no part in the broadcast
    assert torch.equal(got[2], torch.arange(100, dtype=torch.uint8))
    assert torch.equal(got[3], torch.arange(100, dtype=torch.uint8))


def test_sweep_removes_only_segments_of_dead_trainers(tmp_path):
    import subprocess

    from vllm_patching.shm_segment import (
        SHM_PREFIX,
        check_segment_name,
        new_segment_name,
        sweep_stale_segments,
    )

    dead = subprocess.Popen(["true"])
    dead.wait()  # a PID that just exited (reaped): no process has it now
    mine = new_segment_name()
    assert check_segment_name(mine) == mine and f"{SHM_PREFIX}{os.getpid()}_" in mine
    stale = f"{SHM_PREFIX}{dead.pid}_{'ab' * 16}"
    legacy = f"{SHM_PREFIX}{'cd' * 16}"  # no owner recorded: never touched
    for name in (mine, stale, legacy, "psm_other"):
        (tmp_path / name).write_bytes(b"x")
    assert sweep_stale_segments(str(tmp_path)) == [stale]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([mine, legacy, "psm_other"])
