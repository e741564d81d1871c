"""What SFT and GRPO share: seeding, model + optimizer + schedule, resume, metrics.

Under torchrun (trainer/distributed.py) the same ``start_run`` also joins the process group,
shards the model with FSDP2 after the start model (and the KL reference) are built, and
resumes from a sharded or a single-process checkpoint; only rank 0 writes metrics."""

from __future__ import annotations

import ctypes
import json
import logging
import os
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from trainer.checkpoint import (
    TrainerState,
    checkpoints_dir,
    clean_partial,
    latest_checkpoint,
    list_checkpoints,
    load_weights,
    missing_parts,
    save_checkpoint,
)
from trainer.config import CommonConfig
from trainer.dist_checkpoint import is_sharded, load_any, save_sharded
from trainer.distributed import Dist, init_distributed, shard_model
from trainer.hub import push_checkpoint
from trainer.metrics import MetricsLogger
from trainer.model import LoadedModel, load_model
from trainer.optim import build_optimizer, build_scheduler
from trainer.precision import CpuBf16Source, choose_precision
from trainer.resume import resume_checkpoint

log = logging.getLogger(__name__)


@dataclass
class Run:
    cfg: CommonConfig
    loaded: LoadedModel
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    state: TrainerState
    metrics: MetricsLogger
    resumed_from: Path | None
    extra_state: dict[str, Any] = field(default_factory=dict)
    """Other stateful parts saved in every checkpoint as ``<name>.pt`` (name -> object with
    ``state_dict()``), e.g. the GAIL discriminator; each restores itself on resume."""
    dist: Dist | None = None
    """This rank under torchrun (the model is FSDP2-sharded); None: one process."""

    @property
    def is_main(self) -> bool:
        """The process that talks to the services and writes logs (rank 0, or the only one)."""
        return self.dist is None or self.dist.is_main

    def checkpoint(self) -> Path:
        lm, cfg = self.loaded, self.cfg
        if self.dist is not None:  # every rank writes its shards (trainer/dist_checkpoint.py)
            path = save_sharded(
                cfg.save_path,
                lm.model,
                lm.tokenizer,
                self.optimizer,
                self.scheduler,
                self.state,
                self.dist,
                keep=cfg.keep_checkpoints,
            )
        else:
            path = save_checkpoint(
                cfg.save_path,
                lm.model,
                lm.tokenizer,
                self.optimizer,
                self.scheduler,
                self.state,
                keep=cfg.keep_checkpoints,
                extra_state=self.extra_state,
            )
        if self.is_main:
            push_checkpoint(cfg, path)  # only with --hub-repo-id
        return path


def setup_logging() -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True
    )


STARTS = "starts.jsonl"
"""One line per start of a trainer in its ``save_path``: when, its PID, the checkpoint it
resumed from (null: a fresh start) and the step it starts from; a supervisor or a benchmark
reads a restart's outcome here, not in the log."""


def record_start(save_path: Path, resumed_from: Path | None, step: int) -> None:
    """Append this start to ``save_path/starts.jsonl`` (:data:`STARTS`)."""
    row = {"time": time.time(), "pid": os.getpid(), "step": step}
    row["resumed_from"] = None if resumed_from is None else str(resumed_from)
    with (save_path / STARTS).open("a") as f:
        f.write(json.dumps(row) + "\n")


def read_starts(save_path: Path) -> list[dict[str, Any]]:
    """The rows :func:`record_start` wrote in ``save_path`` (none yet: ``[]``)."""
    path = save_path / STARTS
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(x) for x in lines if x.strip()]


def start_run(cfg: CommonConfig, before_resume=None) -> Run:
    """Seed, load the model and optimizer, and (``--resume``) restore the latest checkpoint.

    ``before_resume(loaded, dist)`` runs after the start model is loaded and before checkpointed
    weights replace it (GRPO builds its KL reference there: the reference is the start model)
    and, under torchrun, before the model is sharded.
    """
    d = init_distributed(cfg.device, _control_timeout(cfg))
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    save_path = Path(cfg.save_path)
    save_path.mkdir(parents=True, exist_ok=True)
    on_rank = cfg
    if d is not None:  # every rank computes in rank 0's precision
        on_rank = cfg.model_copy(
            update={"device": str(d.device), "precision": ranks_precision(cfg, d)}
        )
    loaded = load_model(on_rank)  # under torchrun on CUDA: each rank on its own GPU
    loaded.model.train()  # from_pretrained returns eval mode
    if before_resume is not None:
        before_resume(loaded, d)
    resumed_from = _checkpoint_to_resume(cfg, d)  # the same on every rank
    if d is not None:
        if resumed_from is not None and not is_sharded(resumed_from):
            load_weights(loaded.model, resumed_from / "model")  # a one-process checkpoint
        shard_model(loaded.model, d, loaded.compute_dtype)
    optimizer = build_optimizer(loaded.model, cfg)
    scheduler = build_scheduler(optimizer, cfg)
    state = TrainerState()
    if resumed_from is not None:
        state = load_any(resumed_from, loaded.model, optimizer, scheduler, d)
        log.info("resumed from %s at step %d", resumed_from, state.step)
    if d is None or d.is_main:
        metrics = MetricsLogger(
            save_path / "metrics.jsonl",
            tb_dir=save_path / "tb" if cfg.tensorboard else None,
            wandb_project=cfg.wandb_project,
            run_config=cfg.model_dump(),
        )
        (save_path / "trainer_config.json").write_text(cfg.model_dump_json(indent=1))
        record_start(save_path, resumed_from, state.step)
    else:
        metrics = MetricsLogger(None)
    return Run(cfg, loaded, optimizer, scheduler, state, metrics, resumed_from, dist=d)


def ranks_precision(cfg: CommonConfig, d: Dist, source: CpuBf16Source | None = None) -> str:
    """``--precision`` for every rank as rank 0 resolves it (``bf16`` or ``fp32``). ``auto``
    times a matmul on the CPU (trainer/precision.py), and ranks that each timed it on a busy box
    could disagree: a rank in bf16 beside one in fp32 all-gathers shards of other sizes, and
    gloo aborts ("Received data size doesn't match expected size"; seen once in the suite on
    an Intel Xeon whose bf16 is ~2x slower than fp32: most likely a preempted timing). So rank
    0 decides, logs why, and tells the other ranks (over the control group)."""
    if cfg.precision != "auto":
        return cfg.precision
    choice = None
    if d.is_main:
        dtype, why = choose_precision("auto", d.device, source)
        choice = "bf16" if dtype == torch.bfloat16 else "fp32"
        log.info(
            "compute precision %s on all %d ranks, as rank 0 resolved %s", choice, d.world_size, why
        )
    return d.broadcast(choice)


def _checkpoint_to_resume(cfg: CommonConfig, d: Dist | None) -> Path | None:
    """Which checkpoint to resume (``--resume``), after the checks against mixing lineages;
    decided (and ``--overwrite`` carried out) by rank 0 alone, then told to every rank."""
    if d is not None and not d.is_main:
        outcome = d.broadcast()
    else:
        try:
            outcome = ("ok", _decide_resume(cfg))
        except SystemExit as e:
            outcome = ("exit", str(e.code))
        if d is not None:
            d.broadcast(outcome)
    if outcome[0] == "exit":
        raise SystemExit(outcome[1])
    return outcome[1]


def _decide_resume(cfg: CommonConfig) -> Path | None:
    save_path = Path(cfg.save_path)
    if cfg.resume:  # --resume latest|PATH (trainer/resume.py)
        for line in clean_partial(save_path):  # what a kill mid-write or mid-prune left
            log.warning("checkpoints: %s", line)
        resumed_from = resume_checkpoint(cfg)
        if resumed_from is None:
            log.warning("--resume: no checkpoint under %s yet; starting fresh", save_path)
        elif missing := missing_parts(resumed_from):
            raise SystemExit(_incomplete(resumed_from, missing))
        return resumed_from
    if cfg.overwrite:
        shutil.rmtree(checkpoints_dir(save_path), ignore_errors=True)
    elif latest_checkpoint(save_path) is not None:
        raise SystemExit(
            f"error: {save_path} already holds checkpoints; pass --resume to continue them "
            "--overwrite to start over, or another --save-path (refusing to mix two runs in one lineage)"
        )
    return None


def _incomplete(path: Path, missing: list[str]) -> str:
    """Why a checkpoint cannot be resumed, and what to do about it."""
    older = [p for p in list_checkpoints(path.parent.parent) if p.name < path.name]
    before = f"the one before it, {older[-1].name}" if older else "the start"
    return (
        f"error: checkpoint {path} is incomplete (missing {', '.join(missing)}). This trainer "
        "publishes a checkpoint only once every file is written and fsynced, so it was damaged "
        f"after it was written. Move it out of {path.parent} to resume from {before}; the "
        "batches acked since then are then not trained again."
    )


def _control_timeout(cfg: CommonConfig) -> float:
    """How long a rank may wait on rank 0 (for a batch, or while it retries the services)."""
    return float(getattr(cfg, "wait_timeout", 0.0)) + 2 * float(
        getattr(cfg, "reconnect_timeout", 0.0)
    )


def release_freed_memory() -> None:
    """Give the memory the step freed back to the OS (glibc ``malloc_trim``).

    A training step allocates and frees tensors of a different size every step (packed rows
    differ in length), and glibc keeps the freed chunks in its heaps rather than unmapping them:
    measured on SmolLM2's GRPO trainer, resident memory grew from 5.6 to 9.6 GB over 16 steps
    and fell to 2.8 GB on one ``malloc_trim(0)``. Called after every step; a few milliseconds.
    Elsewhere than glibc (musl, macOS) it does nothing."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass
