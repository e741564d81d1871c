"""Sharded checkpoints of an FSDP2 trainer (``torch.distributed.checkpoint``), and resume at
any world size.

A checkpoint written under torchrun, ``<save_path>/checkpoints/step_NNNNNN/``:
- ``dcp/``: model and AdamW state, each rank writing its own shards (DCP's ``.distcp`` files
  plus ``.metadata``), keyed by parameter name, so any world size -- one process without
  ``torch.distributed`` included -- can load it (DCP reshards on load);
- ``model/``: the whole model as a normal Hugging Face directory (safetensors; the adapter
  under LoRA) + tokenizer, gathered to rank 0: transformers and vLLM load it as is;
- ``scheduler.pt``, ``trainer_state.json``, ``rng.pt`` (rank 0's RNG) and ``rng_rank<R>.pt``.

Every rank must see the same ``save_path`` (one machine, or a shared filesystem across
nodes). As for one process, the checkpoint is built in a temporary sibling and renamed by
rank 0 once every rank has written its part, so a ``step_*`` directory is always complete.

``load_any`` resumes from either kind of checkpoint in either kind of run: DCP into one
process or N ranks, and a single-process checkpoint (``optimizer.pt``) into N ranks (its
weights are loaded before sharding, its optimizer state re-keyed by parameter name).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

from trainer.checkpoint import (
    PREFIX,
    CheckpointWriteError,
    TrainerState,
    _fsync_tree,
    _rng_state,
    _set_rng_state,
    checkpoints_dir,
    load_checkpoint,
    publish,
    write_failed,
    write_or_clean,
)
from trainer.distributed import Dist
from trainer.model import LoadedModel, load_model

DCP_DIR = "dcp"


def is_sharded(path: Path) -> bool:
    """Was checkpoint ``path`` written by a sharded (torchrun) trainer?"""
    return (Path(path) / DCP_DIR).is_dir()


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Model + optimizer state keyed by parameter name (DTensor shards under FSDP)."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def full_model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded weights on rank 0's CPU (empty on the other ranks); a collective."""
    return get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )


def export_hf(model: torch.nn.Module, tokenizer: Any, out: Path, d: Dist) -> None:
    """``save_pretrained`` of the whole (gathered) model into ``out`` by rank 0; a collective.

    A peft model writes its adapter only, as in a single-process checkpoint."""
    state = full_model_state(model)
    if d.is_main:
        tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
        if tied:  # the gather returns the tied head as its own copy: checkpoints omit it
            state = {k: v for k, v in state.items() if not k.endswith("lm_head.weight")}
        model.save_pretrained(out, state_dict=state, safe_serialization=True)
        tokenizer.save_pretrained(out)


def unsharded_copy(cfg: Any, model: torch.nn.Module, d: Dist) -> LoadedModel | None:
    """Rank 0: a fresh one-process model holding the sharded model's weights (for the final
    ``save_final_model``, which merges LoRA, and for evaluation); None on the other ranks.
    A collective."""
    state = full_model_state(model)
    if not d.is_main:
        return None
    lm = load_model(cfg)
    missing, unexpected = lm.model.load_state_dict(state, strict=False)
    tied = getattr(lm.model.config, "tie_word_embeddings", False)
    missing = [k for k in missing if not (tied and k.endswith("lm_head.weight"))]
    if missing or unexpected:
        raise RuntimeError(
            f"gathered weights do not fit: missing={missing} unexpected={unexpected}"
        )
    return lm


def save_sharded(
    save_path: str | Path,
    model: torch.nn.Module,
    tokenizer: Any,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    state: TrainerState,
    d: Dist,
    keep: int = 2,
) -> Path:
    """Write checkpoint ``step_<state.step>`` from every rank (a collective); returns it.

    A write that fails on any rank (a full disk) fails on every rank: DCP's own save gathers
    every rank's outcome, and the ranks agree on the rest over the control group before rank
    0 publishes. Rank 0 then removes the partial directory and every rank raises
    ``CheckpointWriteError``; the previous checkpoint is untouched."""
    root = checkpoints_dir(save_path)
    final = root / f"{PREFIX}{state.step:06d}"
    tmp = root / f".tmp-{final.name}-sharded"
    if d.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    d.barrier()
    error: BaseException | None = None
    try:
        dcp.save(_state(model, optimizer), checkpoint_id=str(tmp / DCP_DIR))
        export_hf(model, tokenizer, tmp / "model", d)
        torch.save(_rng_state(), tmp / f"rng_rank{d.rank}.pt")
        if d.is_main:
            torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
            torch.save(_rng_state(), tmp / "rng.pt")
            meta = {**asdict(state), "world_size": d.world_size}
            (tmp / "trainer_state.json").write_text(json.dumps(meta, indent=1))
    except Exception as e:  # noqa: BLE001 - OSError, DCP's CheckpointException, ...
        error = e
    failed = [
        f for f in d.gather_objects(None if error is None else f"rank {d.rank}: {error}") if f
    ]
    if failed:  # every rank knows: rank 0 removes the partial write and says why, for all
        cause = error or RuntimeError("; ".join(failed))
        why = str(write_failed(root, final, tmp, cause)) if d.is_main else None
        raise CheckpointWriteError(d.broadcast(why)) from error
    if d.is_main:  # every rank's files are there: make them durable, then publish
        write_or_clean(root, final, tmp, lambda: _fsync_tree(tmp))
        publish(tmp, final, save_path, keep)
    d.barrier()  # nobody goes on (e.g. acks) before the checkpoint exists
    return final


def _trainer_state(path: Path) -> TrainerState:
    meta = json.loads((path / "trainer_state.json").read_text())
    meta.pop("world_size", None)
    return TrainerState(**meta)


def load_sharded(
    path: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    rank: int = 0,
) -> TrainerState:
    """Restore a DCP checkpoint into this run (sharded or one process; any world size)."""
    state = _state(model, optimizer)  # initialises AdamW's state: DCP loads into it in place
    dcp.load(state, checkpoint_id=str(path / DCP_DIR))
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
    rng = path / f"rng_rank{rank}.pt"
    _set_rng_state(torch.load(rng if rng.exists() else path / "rng.pt", weights_only=False))
    return _trainer_state(path)


def optimizer_by_name(model: torch.nn.Module, legacy: dict[str, Any]) -> dict[str, Any]:
    """A single-process ``optimizer.pt`` (keyed by position) keyed by parameter name.

    Positions follow ``trainer.optim.build_optimizer``: its groups list the trainable
    parameters in ``named_parameters`` order, matrices first, then the 1-d ones."""
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    names = [n for n, p in trainable if p.dim() >= 2] + [n for n, p in trainable if p.dim() < 2]
    groups = [{**g, "params": [names[i] for i in g["params"]]} for g in legacy["param_groups"]]
    return {"state": {names[i]: s for i, s in legacy["state"].items()}, "param_groups": groups}


def load_any(
    path: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    d: Dist | None,
) -> TrainerState:
    """Resume from ``path`` whichever trainer wrote it. A single-process checkpoint into a
    sharded run expects its weights already loaded (``trainer.checkpoint.load_weights``
    before sharding); this loads its optimizer, scheduler and RNG."""
    if is_sharded(path):
        return load_sharded(path, model, optimizer, scheduler, 0 if d is None else d.rank)
    if d is None:
        return load_checkpoint(path, model, optimizer, scheduler)
    legacy = torch.load(path / "optimizer.pt", weights_only=True, map_location="cpu")
    set_optimizer_state_dict(
        model,
        optimizer,
        optimizer_by_name(model, legacy),
        options=StateDictOptions(full_state_dict=True),
    )
    scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
    _set_rng_state(torch.load(path / "rng.pt", weights_only=False))
    return _trainer_state(path)
