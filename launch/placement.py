"""Where each process of launch/run_all.sh runs, and how many inference servers (pure functions).

On CPU everything shares the machine. On CUDA every vLLM server gets its own GPU(s) through
``CUDA_VISIBLE_DEVICES`` (``tensor_parallel_size`` of them) and the trainer gets:
- broadcast (``shared_vllm``): a GPU of its own, after the servers' -- NCCL refuses two ranks
  on one GPU ("Duplicate GPU detected : rank 0 and rank 1 both on CUDA device");
- single copy (``shared_vllm --single-copy``): the server's GPU (CUDA IPC needs the same
  device); refused with tensor parallelism > 1 or several servers (vLLM's ipc worker only
  opens handles of its own GPU, and the trainer's weights live on one);
- ``lora_only`` / ``none``: a GPU of its own when one is left, else the first server's.
Inside its own ``CUDA_VISIBLE_DEVICES`` the trainer's device is always ``cuda:0``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from typing import Literal

from pydantic import BaseModel, Field


class PlacementError(ValueError):
    """The requested layout cannot run on the devices there are (the message says why)."""


class Placement(BaseModel):
    """Devices of every process of one run."""

    server_gpus: list[list[str]] = Field(
        description="Per inference server, its CUDA_VISIBLE_DEVICES ids ([] on CPU)."
    )
    trainer_gpus: list[str] = Field(description="The trainer's CUDA_VISIBLE_DEVICES ([] on CPU).")
    trainer_device: str = Field(description="The trainer's `--device` (`cpu` or `cuda:0`).")
    shares_gpu: bool = Field(description="The trainer shares a GPU with a vLLM server.")


def num_servers_from_env(environ: Mapping[str, str] | None = None) -> int:
    """Inference servers to start by default: ``NUM_INFERENCE_NODES`` as in Atropos, where
    unset or 0 means the single local server."""
    raw = (os.environ if environ is None else environ).get("NUM_INFERENCE_NODES", "").strip()
    if not raw:
        return 1
    try:
        n = int(raw)
    except ValueError:
        raise PlacementError(f"NUM_INFERENCE_NODES must be a number, got {raw!r}") from None
    if n < 0:
        raise PlacementError(f"NUM_INFERENCE_NODES must be >= 0, got {n}")
    return max(1, n)


def visible_gpus(environ: Mapping[str, str] | None = None) -> list[str]:
    """GPU ids this run may use: ``CUDA_VISIBLE_DEVICES`` if set, else every GPU
    ``nvidia-smi -L`` lists ([] without nvidia-smi)."""
    env = os.environ if environ is None else environ
    if "CUDA_VISIBLE_DEVICES" in env:
        return [g.strip() for g in env["CUDA_VISIBLE_DEVICES"].split(",") if g.strip()]
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, line in enumerate(out.splitlines()) if line.startswith("GPU ")]


def plan_placement(
    device: Literal["cpu", "cuda"],
    mode: str,
    single_copy: bool,
    num_servers: int,
    tensor_parallel_size: int,
    gpus: Sequence[str],
    trainer_procs: int = 1,
) -> Placement:
    """The devices of every process, or a ``PlacementError`` saying what is missing.

    ``trainer_procs`` > 1 (an FSDP trainer under torchrun, one GPU per rank) takes that many
    GPUs of its own after the servers'."""
    if num_servers < 1 or tensor_parallel_size < 1:
        raise PlacementError("num_servers and tensor_parallel_size must be >= 1")
    if device == "cpu":
        return Placement(
            server_gpus=[[] for _ in range(num_servers)],
            trainer_gpus=[],
            trainer_device="cpu",
            shares_gpu=False,
        )
    broadcast = mode == "shared_vllm" and not single_copy
    tp = tensor_parallel_size
    if mode == "shared_vllm" and single_copy and num_servers * tp > 1:
        # vLLM's ipc worker rebuilds each tensor from the handle stored under its own GPU's
        # UUID; the trainer can only export memory of its own GPU (trainer/bridge/cuda.py).
        raise PlacementError(
            f"--single-copy (CUDA IPC) needs every vLLM worker on the trainer's GPU, but "
            f"{num_servers} server(s) x tensor-parallel {tp} use {num_servers * tp} GPUs: "
            "drop --single-copy (NCCL broadcast) for tensor-parallel-size > 1 or several servers"
        )
    need = num_servers * tp + (1 if broadcast else 0)
    if len(gpus) < need:
        why = " + 1 for the trainer (NCCL broadcast needs its own GPU)" if broadcast else ""
        hint = "; or --single-copy to share the server's GPU" if broadcast and need == 2 else ""
        raise PlacementError(
            f"{num_servers} server(s) x tensor-parallel {tp}{why} need {need} GPU(s), "
            f"found {len(gpus)} ({','.join(gpus) or 'none'}){hint}"
        )
    servers = [list(gpus[i * tp : (i + 1) * tp]) for i in range(num_servers)]
    left = list(gpus[num_servers * tp :])
    if trainer_procs > 1:
        if single_copy:
            raise PlacementError(
                "--single-copy shares the server's GPU with one trainer process; "
                f"--trainer-procs {trainer_procs} needs the broadcast (drop --single-copy)"
            )
        if len(left) < trainer_procs:
            raise PlacementError(
                f"{num_servers} server(s) x tensor-parallel {tp} + {trainer_procs} trainer "
                f"ranks need {num_servers * tp + trainer_procs} GPU(s), found {len(gpus)}"
            )
        return Placement(
            server_gpus=servers,
            trainer_gpus=left[:trainer_procs],
            trainer_device="cuda",
            shares_gpu=False,
        )
    if single_copy or not left:
        trainer, shares = [servers[0][0]], True
    else:
        trainer, shares = [left[0]], False
    return Placement(
        server_gpus=servers, trainer_gpus=trainer, trainer_device="cuda:0", shares_gpu=shares
    )
