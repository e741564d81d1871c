"""Transport pieces shared by the trainer (sender) and the vLLM workers (receivers).

Pure torch, no vLLM import: the trainer imports this module too. Both sides compute the
same packing plan from the same metadata, so only names/dtypes/shapes travel over HTTP and
the tensor bytes travel over the data plane (a gloo broadcast or a POSIX shared-memory
segment) as a few large flat ``uint8`` buckets instead of one message per tensor.
"""

from __future__ import annotations

import datetime
import mmap
import os
import secrets
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

ALIGN = 64
"""Every tensor starts on a 64-byte boundary (cache line; any dtype's alignment)."""
DEFAULT_BUCKET_BYTES = 256 * 1024 * 1024
"""Largest broadcast message; a bigger tensor travels alone in its own bucket."""
SHM_DIR = "/dev/shm"
SHM_PREFIX = "shop_r1_bridge_"
"""Segment names the shared-memory engine accepts (never an arbitrary path)."""


@dataclass(frozen=True)
class TensorMeta:
    """One tensor in checkpoint (HF) format: name, dtype name (``"float32"``) and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        numel = 1
        for d in self.shape:
            numel *= d
        return numel * torch.empty((), dtype=torch_dtype(self.dtype)).element_size()


@dataclass(frozen=True)
class Slot:
    """Where one tensor lives: bucket index and byte offset inside the bucket."""

    meta: TensorMeta
    bucket: int
    offset: int


@dataclass(frozen=True)
class PackPlan:
    """Deterministic layout of a list of tensors into flat byte buckets."""

    slots: tuple[Slot, ...]
    bucket_sizes: tuple[int, ...]

    @property
    def total_bytes(self) -> int:
        return sum(self.bucket_sizes)


def torch_dtype(name: str) -> torch.dtype:
    """``"float32"`` -> ``torch.float32``; refuses names that are not torch dtypes."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype name {name!r}")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def plan_buckets(metas: Sequence[TensorMeta], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> PackPlan:
    """Pack tensors in order into buckets of at most ``bucket_bytes`` (greedy, aligned).

    Order is preserved so that tensors of one decoder layer (and every shard of a fused
    q/k/v or gate/up group) arrive together and vLLM's layerwise loader can process a
    layer as soon as it is complete.
    """
    if bucket_bytes <= 0:
        raise ValueError("bucket_bytes must be positive")
    slots: list[Slot] = []
    sizes: list[int] = []
    used = 0
    for meta in metas:
        size = _aligned(meta.nbytes)
        if not sizes or (used + size > bucket_bytes and used > 0):
            sizes.append(0)
            used = 0
        slots.append(Slot(meta, len(sizes) - 1, used))
        used += size
        sizes[-1] = used
    return PackPlan(tuple(slots), tuple(sizes))


class Packer:
    """Copies tensors into a plan's buckets; the destination views are built once.

    The sync packs the same parameter set into the same buckets every step, so the
    per-tensor work that does not depend on the values (slicing the bucket, numpy views,
    dtype lookups) is done here, once. What is left per tensor is a shape/dtype check and
    one single-threaded memcpy: on the tiny model (50 tensors, 14.6 MiB) that is ~1.05x a
    plain memcpy of the same bytes, vs ~1.5x when every view was rebuilt each sync
    (``docs/BRIDGE.md``).
    """

    def __init__(self, plan: PackPlan, buckets: Sequence[torch.Tensor]) -> None:
        self.plan = plan
        self.buckets = list(buckets)
        self._dst = [
            self.buckets[s.bucket][s.offset : s.offset + s.meta.nbytes].numpy() for s in plan.slots
        ]
        self._dtypes = [torch_dtype(s.meta.dtype) for s in plan.slots]
        self._ptrs = [d.ctypes.data for d in self._dst]

    def slot_views(self) -> list[torch.Tensor]:
        """Typed views of every slot, in plan order: where each tensor's bytes go."""
        return [tensor_view(self.buckets[s.bucket], s) for s in self.plan.slots]

    def pack(self, tensors: Sequence[torch.Tensor]) -> int:
        """Copy ``tensors`` (same order as the plan) into the buckets; returns bytes copied.

        Each tensor is cast to the plan's (serving) dtype first if it differs. A tensor that
        already *is* its slot (the trainer keeps its weights in the buckets, see
        ``trainer.bridge.shared_vllm.ResidentWeights``) is not copied at all.
        """
        copied = 0
        slots = self.plan.slots
        if len(tensors) != len(slots):
            raise ValueError(f"plan has {len(slots)} tensors, got {len(tensors)}")
        for slot, dtype, dst, ptr, t in zip(
            slots, self._dtypes, self._dst, self._ptrs, tensors, strict=True
        ):
            if t.shape != slot.meta.shape:
                raise ValueError(
                    f"{slot.meta.name}: expected {slot.meta.dtype}{list(slot.meta.shape)}, "
                    f"got {dtype_name(t.dtype)}{list(t.shape)}"
                )
            if t.dtype == dtype and t.data_ptr() == ptr and t.is_contiguous():
                continue  # resident: the bytes are already in place
            if t.dtype != dtype:
                t = t.to(dtype)
            src = t.detach().contiguous().view(-1).view(torch.uint8).numpy()
            # A single-threaded memcpy: torch's parallel copy_ stalls for tens of ms when the
            # other cores are busy generating (measured on the 2-core CI box: 160 ms for the
            # tiny model's 50 tensors while a training job ran, vs 0.5 ms here).
            np.copyto(dst, src)
            copied += dst.nbytes
        return copied


def pack_into(
    plan: PackPlan, tensors: Sequence[torch.Tensor], buckets: Sequence[torch.Tensor]
) -> None:
    """One-off :meth:`Packer.pack` (builds the destination views on every call)."""
    Packer(plan, buckets).pack(tensors)


def tensor_view(bucket: torch.Tensor, slot: Slot) -> torch.Tensor:
    """A zero-copy typed view of one tensor inside its ``uint8`` bucket."""
    nbytes = slot.meta.nbytes
    raw = bucket[slot.offset : slot.offset + nbytes]
    return raw.view(torch_dtype(slot.meta.dtype)).view(slot.meta.shape)


def bucket_views(buffer: torch.Tensor, plan: PackPlan) -> list[torch.Tensor]:
    """The plan's buckets laid out back to back in one flat ``uint8`` buffer (no copy).

    How the broadcast's shared-memory fast path places its buckets in the segment: the
    trainer packs into these views and broadcasts them to remote ranks, local ranks read
    the same views from their own mapping.
    """
    if buffer.numel() < plan.total_bytes:
        raise ValueError(f"buffer has {buffer.numel()} bytes, the plan needs {plan.total_bytes}")
    views, offset = [], 0
    for size in plan.bucket_sizes:
        views.append(buffer[offset : offset + size])
        offset += size
    return views


def unpack(plan: PackPlan, buckets: Sequence[torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, view)`` for every tensor of the plan, views into ``buckets`` (no copy)."""
    for slot in plan.slots:
        yield slot.meta.name, tensor_view(buckets[slot.bucket], slot)


def metas_to_wire(metas: Sequence[TensorMeta]) -> dict[str, list]:
    """Metadata as JSON lists (the shape of vLLM's own NCCL update_info)."""
    return {
        "names": [m.name for m in metas],
        "dtype_names": [m.dtype for m in metas],
        "shapes": [list(m.shape) for m in metas],
    }


def metas_from_wire(
    names: list[str], dtype_names: list[str], shapes: list[list[int]]
) -> list[TensorMeta]:
    if not (len(names) == len(dtype_names) == len(shapes)):
        raise ValueError("names, dtype_names and shapes must have the same length")
    return [
        TensorMeta(n, d, tuple(int(x) for x in s))
        for n, d, s in zip(names, dtype_names, shapes, strict=True)
    ]


# ---------------------------------------------------------------- gloo process group


def gloo_store(
    host: str, port: int, rank: int, world_size: int, timeout_s: float = 300.0
) -> torch.distributed.Store:
    """The TCP store of the transfer group (rank 0 hosts it)."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    return dist.TCPStore(
        host, port, world_size, is_master=(rank == 0), timeout=timeout, wait_for_workers=False
    )


def gloo_group_on(
    store: torch.distributed.Store,
    prefix: str,
    rank: int,
    world_size: int,
    timeout_s: float = 300.0,
) -> torch.distributed.ProcessGroup:
    """A stand-alone gloo group on ``store`` under ``prefix`` (several groups can share one
    store: the full group and the remote-only group of the shared-memory fast path)."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    return dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, world_size, timeout)


def gloo_group(
    host: str, port: int, rank: int, world_size: int, timeout_s: float = 300.0
) -> torch.distributed.ProcessGroup:
    """A stand-alone gloo group (no ``init_process_group``: the trainer's own default
    group, if any, and vLLM's groups stay untouched). Rank 0 hosts the TCP store.

    Blocks until all ``world_size`` ranks have joined.
    """
    store = gloo_store(host, port, rank, world_size, timeout_s)
    return gloo_group_on(store, "shop_r1_bridge", rank, world_size, timeout_s)


def allgather_flags(group: torch.distributed.ProcessGroup, flag: bool) -> list[bool]:
    """Every rank's ``flag``, in rank order (a collective: every rank must call it).

    An all-reduce of one-hot vectors (the gloo all-gather options type is not exported by
    every torch build; the all-reduce one is).
    """
    import torch.distributed as dist

    vec = torch.zeros(group.size(), dtype=torch.int32)
    vec[group.rank()] = int(flag)
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    group.allreduce([vec], opts).wait()
    return [bool(v) for v in vec.tolist()]


def remote_ranks(local: Sequence[bool]) -> list[int]:
    """Ranks (other than the sender, rank 0) that did not map the segment: they get gloo."""
    return [r for r in range(1, len(local)) if not local[r]]


REMOTE_GROUP_PREFIX = "shop_r1_bridge_remote"
"""Store prefix of the sub-group {trainer} + remote ranks (same store as the full group)."""


def remote_group(
    store: torch.distributed.Store,
    rank: int,
    local: Sequence[bool],
    timeout_s: float = 300.0,
) -> torch.distributed.ProcessGroup | None:
    """The gloo sub-group of rank 0 and the ranks without shared memory, or None when this
    rank is not in it (a local receiver) or nobody needs it (every receiver is local).

    Its ranks are renumbered in order: rank 0 stays 0, remote rank r becomes its index + 1.
    """
    remote = remote_ranks(local)
    if not remote or (rank != 0 and rank not in remote):
        return None
    sub_rank = 0 if rank == 0 else remote.index(rank) + 1
    return gloo_group_on(store, REMOTE_GROUP_PREFIX, sub_rank, len(remote) + 1, timeout_s)


def broadcast(group: torch.distributed.ProcessGroup, tensor: torch.Tensor, root: int = 0) -> None:
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = root
    group.broadcast([tensor], opts).wait()


# ---------------------------------------------------------------- POSIX shared memory


NONCE_BYTES = 16


def write_nonce(segment: ShmSegment) -> str:
    """Write a fresh random nonce at the start of ``segment`` (trainer, before init).

    A worker that reads the same nonce through its own mapping of the segment name is
    proven to share this machine's /dev/shm (same host, same IPC namespace): the broadcast
    can skip the network for it. The packed weights overwrite the nonce later; the
    handshake only happens at init, before the first pack.
    """
    nonce = secrets.token_bytes(NONCE_BYTES)
    segment.buffer[:NONCE_BYTES].copy_(torch.frombuffer(bytearray(nonce), dtype=torch.uint8))
    return nonce.hex()


def shm_handshake(name: str, size: int, nonce_hex: str) -> ShmSegment | None:
    """Map the trainer's segment and check its nonce; None if this worker cannot see it.

    Any failure (no such file: another host or IPC namespace; wrong size; wrong nonce: a
    different segment with the same name) means "use the network"; only a bad name, which
    only a broken or malicious request sends, is an error.
    """
    check_segment_name(name)
    try:
        seg = ShmSegment(name, size, create=False)
    except (OSError, ValueError):
        return None
    if bytes(seg.buffer[:NONCE_BYTES].tolist()) != bytes.fromhex(nonce_hex):
        seg.close()
        return None
    return seg


def new_segment_name() -> str:
    """A fresh trainer-owned segment name that records the owner's PID.

    A trainer killed with SIGKILL cannot unlink its segment; the PID in the name lets the next
    trainer on this host remove segments whose owner is gone (:func:`sweep_stale_segments`).
    """
    return f"{SHM_PREFIX}{os.getpid()}_{uuid.uuid4().hex}"


def sweep_stale_segments(shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink our segments whose owning process no longer exists; returns the removed names.

    Only names of the form ``<prefix><pid>_<hex>`` are touched (older unnamed-owner segments
    are left alone), and a PID that exists but belongs to someone else counts as alive.
    """
    removed = []
    try:
        names = os.listdir(shm_dir)
    except FileNotFoundError:
        return removed
    for name in names:
        if not name.startswith(SHM_PREFIX):
            continue
        pid_part, sep, _ = name[len(SHM_PREFIX) :].partition("_")
        if not sep or not pid_part.isdigit() or _pid_alive(int(pid_part)):
            continue
        try:
            os.unlink(os.path.join(shm_dir, name))
            removed.append(name)
        except FileNotFoundError:
            pass
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def check_segment_name(name: str) -> str:
    """Accept only our own flat segment names (no path tricks from an HTTP body)."""
    if not name.startswith(SHM_PREFIX) or "/" in name or not name.replace("_", "").isalnum():
        raise ValueError(f"bad shared-memory segment name {name!r}")
    return name


class ShmSegment:
    """A POSIX shared-memory file in /dev/shm mapped into this process.

    The trainer creates it (``create=True``) and unlinks it on close; a worker maps the
    same name read-only and builds tensor views straight on the mapping, so the bytes the
    trainer wrote are read in place: no second transfer copy.
    """

    def __init__(self, name: str, size: int, create: bool) -> None:
        self.name = check_segment_name(name)
        self.path = os.path.join(SHM_DIR, self.name)
        self.size = size
        self.owner = create
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(self.path, flags, 0o600)
        try:
            if create:
                self._reserve(fd, size)
            elif os.fstat(fd).st_size < size:
                raise ValueError(f"segment {name} is smaller than {size} bytes")
            self._mmap = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.buffer = torch.frombuffer(self._mmap, dtype=torch.uint8)

    def _reserve(self, fd: int, size: int) -> None:
        try:
            os.ftruncate(fd, size)
            # Reserve the pages now: a /dev/shm too small for the model fails here with
            # ENOSPC instead of a SIGBUS at the first write into a sparse page.
            os.posix_fallocate(fd, 0, size)
        except OSError as e:
            os.unlink(self.path)
            raise OSError(e.errno, f"cannot reserve {size} bytes in {SHM_DIR}: {e.strerror}") from e

    def close(self) -> None:
        # Drop the tensor view first: mmap.close() fails while a buffer export is alive.
        self.buffer = None  # type: ignore[assignment]
        try:
            self._mmap.close()
        except BufferError:
            pass  # a view is still referenced elsewhere; the mapping goes with it
        if self.owner:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
