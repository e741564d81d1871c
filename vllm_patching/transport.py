"""The packing plan shared by the trainer (sender) and the vLLM workers (receivers).

Pure torch, no vLLM import: the trainer imports this module too. Both sides compute the
same packing plan from the same metadata, so only names/dtypes/shapes travel over HTTP and
the tensor bytes travel over the data plane (a gloo broadcast, ``vllm_patching.gloo_group``,
or a POSIX shared-memory segment, ``vllm_patching.shm_segment``) as a few large flat
``uint8`` buckets instead of one message per tensor (docs/BRIDGE.md).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

ALIGN = 64
"""Every tensor starts on a 64-byte boundary (cache line; any dtype's alignment)."""
DEFAULT_BUCKET_BYTES = 256 * 1024 * 1024
"""Largest broadcast message; a bigger tensor travels alone in its own bucket."""


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
        ``trainer.bridge.resident.ResidentWeights``) is not copied at all.
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
