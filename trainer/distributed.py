"""The trainer past one device: ``torchrun`` process group, FSDP2 sharding, work splitting.

Only used when the trainer was launched by ``torchrun`` (or ``srun`` with torchrun's
variables): ``init_distributed`` returns None otherwise, and a single process runs exactly as
before, without ``torch.distributed``. Under torchrun every rank:

- joins one process group (NCCL on CUDA, gloo on CPU) plus a gloo *control* group for the
  Python objects rank 0 hands out (leased batches, stop signals), whose timeout covers the
  longest wait for data;
- shards its model with FSDP2 (``fully_shard`` on every decoder layer, then the root):
  parameters, gradients and AdamW state are split across ranks; the fp32 master weights stay
  fp32 and, in bf16, ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` gathers
  bf16 copies for the forward/backward and reduces gradients in fp32;
- takes every ``world_size``-th micro-batch of the step (``Work.split``); ranks with one
  fewer run a zero-weight pass on a real micro-batch so every rank issues the same FSDP
  collectives. Gradients are *summed* across ranks (divide factor 1), and every loss is
  already divided by the whole step's normaliser, so the update is the one a single process
  computes on the same batch (up to float summation order).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)
T = TypeVar("T")

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
"""What torchrun (and our SLURM script) set in every rank's environment."""


def launched_by_torchrun(environ: Mapping[str, str] | None = None) -> bool:
    """True when every variable torchrun sets is present (single process: none is)."""
    env = os.environ if environ is None else environ
    return all(env.get(v) for v in TORCHRUN_VARS)


@dataclass
class Dist:
    """This rank's place in the trainer's process group."""

    rank: int
    world_size: int
    local_rank: int
    mesh: Any
    """The 1-D ``DeviceMesh`` FSDP shards over."""
    control: Any
    """A gloo group for Python objects (leases, stop signals), whatever the main backend."""
    device: torch.device
    """This rank's device: ``cuda:LOCAL_RANK`` on CUDA, else the CPU."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        dist.barrier(group=self.control)

    def broadcast(self, obj: T | None = None) -> T:
        """Rank 0's ``obj`` on every rank (pickled over the control group)."""
        box = [obj if self.is_main else None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]  # type: ignore[return-value]

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank (over the control group)."""
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.control)
        return out

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """In-place sum over ranks of a CPU tensor (statistics, not gradients)."""
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.control)
        return tensor


def init_distributed(device: str, control_timeout_s: float) -> Dist | None:
    """Join the process group torchrun set up, or return None when not under torchrun.

    ``device`` is the trainer's ``--device``: CUDA ranks take ``cuda:LOCAL_RANK`` and NCCL;
    CPU ranks take gloo. ``control_timeout_s`` bounds how long a rank waits for rank 0's next
    batch (the API may have nothing for ``wait_timeout`` seconds)."""
    if not launched_by_torchrun():
        return None
    from torch.distributed.device_mesh import init_device_mesh

    local_rank = int(os.environ["LOCAL_RANK"])
    use_cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    if use_cuda:
        torch.cuda.set_device(local_rank)
    timeout = timedelta(seconds=max(1800.0, control_timeout_s))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timeout)
    mesh = init_device_mesh("cuda" if use_cuda else "cpu", (dist.get_world_size(),))
    control = dist.new_group(backend="gloo", timeout=timeout)
    dev = torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")
    d = Dist(dist.get_rank(), dist.get_world_size(), local_rank, mesh, control, dev)
    log.info(
        "rank %d of %d (local rank %d), backend %s",
        d.rank,
        d.world_size,
        local_rank,
        dist.get_backend(),
    )
    if not d.is_main:  # one log of the run's progress is enough; warnings still show
        logging.getLogger().setLevel(logging.WARNING)
    return d


def shutdown(d: Dist | None) -> None:
    if d is not None and dist.is_initialized():
        dist.destroy_process_group()


def shard_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules each get their own FSDP unit: the transformer blocks, found by the class
    names transformers lists in ``_no_split_modules`` (``Qwen2DecoderLayer``, ...)."""
    names: set[str] = set()
    for m in model.modules():
        names.update(getattr(m, "_no_split_modules", None) or [])
    units = [m for m in model.modules() if type(m).__name__ in names]
    if not units:
        raise ValueError(
            f"{type(model).__name__}: no decoder layers found to shard (looked "
            f"for {sorted(names) or 'the _no_split_modules classes'})"
        )
    return units


def shard_model(model: torch.nn.Module, d: Dist, compute_dtype: torch.dtype) -> torch.nn.Module:
    """FSDP2 in place: each decoder layer, then the root (embeddings, norm, head; a tied
    head shares the root's embedding parameter). Gradients are summed, not averaged."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    params_dtype = {p.dtype for p in model.parameters()}
    mp = MixedPrecisionPolicy()
    if compute_dtype == torch.bfloat16 and params_dtype == {torch.float32}:
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for unit in shard_units(model):
        fully_shard(unit, mesh=d.mesh, mp_policy=mp)
    fully_shard(model, mesh=d.mesh, mp_policy=mp)
    for m in model.modules():  # every unit: the sum over ranks is the batch's gradient
        if hasattr(m, "set_gradient_divide_factor"):
            m.set_gradient_divide_factor(1.0)
            if hasattr(m, "set_force_sum_reduction_for_comms"):  # older torch lacks it (NCCL
                m.set_force_sum_reduction_for_comms(True)  # has PREMUL_SUM; gloo needs SUM)
    return model


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a (possibly) sharded one; a collective when it is a DTensor."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


@dataclass
class Work:
    """How a step's micro-batches are split over ranks (world 1: all of them, all real)."""

    rank: int = 0
    world_size: int = 1
    dist: Dist | None = None

    @classmethod
    def of(cls, d: Dist | None) -> Work:
        return cls() if d is None else cls(d.rank, d.world_size, d)

    def split(self, chunks: Sequence[T]) -> list[tuple[T, bool]]:
        """This rank's chunks (every ``world_size``-th), padded to the same count on every
        rank with ``(chunks[0], False)``: a pass that must run (FSDP collectives) but whose
        loss is multiplied by 0 and whose statistics are dropped."""
        if self.world_size == 1:
            return [(c, True) for c in chunks]
        mine = [(c, True) for c in chunks[self.rank :: self.world_size]]
        per_rank = -(-len(chunks) // self.world_size)
        return mine + [(chunks[0], False)] * (per_rank - len(mine))

    def sum(self, values: dict[str, float]) -> dict[str, float]:
        """Sum per-rank statistics over ranks (identity on one process)."""
        if self.dist is None:
            return values
        keys = sorted(values)
        t = torch.tensor([values[k] for k in keys], dtype=torch.float64)
        self.dist.all_reduce_sum(t)
        return dict(zip(keys, t.tolist(), strict=True))

    def sum_tensor(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.dist is None else self.dist.all_reduce_sum(t)
