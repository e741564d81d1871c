"""Resumable checkpoints, written atomically.

Layout of ``<save_path>/checkpoints/step_000042/``:
- ``model/``: ``save_pretrained`` output (safetensors; under LoRA the adapter) + tokenizer, so
  the directory loads in transformers and vLLM as is;
- ``optimizer.pt``, ``scheduler.pt``, ``rng.pt``: the exact training state;
- ``trainer_state.json``: step, policy version, data position, consumed batch/group ids;
- ``<name>.pt``: the ``state_dict()`` of each extra stateful part (e.g. ``gail.pt``, the GAIL
  discriminator of trainer/gail/), see ``save_checkpoint(extra_state=...)``.

A checkpoint is built in a temporary sibling directory, fsynced (files and directories) and
renamed into place, so a ``step_*`` directory is always complete: a kill at any moment leaves
either the previous checkpoint or the new one, never a half-written one the resume would
trust. Pruning renames an old checkpoint aside before deleting it, so a kill mid-delete leaves
no half-deleted ``step_*`` either; ``clean_partial`` removes what a killed write or prune left
behind (``.tmp-*``, ``.trash-*``) and puts back a checkpoint a kill caught mid-replacement.
A write that fails (a full disk) removes its partial files and raises ``CheckpointWriteError``
naming the free space, the size the last checkpoint took and the checkpoint that is still
intact (docs/FAULT_TOLERANCE.md, "A full disk at the trainer").
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from trainer.checkpoint_files import PREFIX as PREFIX
from trainer.checkpoint_files import checkpoints_dir as checkpoints_dir
from trainer.checkpoint_files import latest_checkpoint as latest_checkpoint
from trainer.checkpoint_files import list_checkpoints as list_checkpoints
from trainer.checkpoint_files import missing_parts as missing_parts

PARTIAL = (".tmp-", ".trash-", ".old-")
"""Name prefixes of what a write or prune in progress holds (never a checkpoint to resume)."""
log = logging.getLogger(__name__)


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (a full disk, a file-size limit, an I/O error).
    The partial write was removed; the previous checkpoint is untouched."""


@dataclass
class TrainerState:
    """Everything besides tensors that a resume needs to continue exactly."""

    step: int = 0
    """Optimizer steps completed."""
    policy_version: int = 0
    """Version of the weights last synced to inference (GRPO)."""
    data_epoch: int = 0
    """SFT: epoch of the next example."""
    data_index: int = 0
    """SFT: position of the next example within the epoch's shuffled order."""
    recent_batches: list[dict[str, Any]] = field(default_factory=list)
    """GRPO: the last batches trained into this lineage, ``{"batch_id", "group_ids"}``, so a
    batch re-leased after a crash (trained and checkpointed, ack lost) is acked, not retrained."""
    skipped_updates: int = 0
    """GRPO: leased batches whose update was skipped (non-finite gradient), never trained."""


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fsync_tree(path: Path) -> None:
    """fsync every file under ``path``, then every directory (deepest first), ``path`` too."""
    for p in path.rglob("*"):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    dirs = sorted((p for p in path.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts))
    for d in [*dirs, path]:
        _fsync_dir(d)


def _fsync_dir(path: Path) -> None:
    """Make the entries of directory ``path`` durable (a rename in it survives power loss)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def tree_bytes(path: Path) -> int:
    """Bytes of the files under ``path`` (0 if it does not exist)."""
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def _mb(n: int) -> str:
    return f"{n / 2**20:.1f} MB"


def write_failed(root: Path, final: Path, tmp: Path, error: BaseException) -> CheckpointWriteError:
    """Remove the partial write ``tmp`` and say what failed, how much space there is and
    which checkpoint is still intact (the error to raise)."""
    shutil.rmtree(tmp, ignore_errors=True)
    previous = [p for p in list_checkpoints(root.parent) if p != final]
    try:
        free = shutil.disk_usage(root).free
    except OSError:
        free = -1
    last = previous[-1] if previous else None
    need = f"the last checkpoint took {_mb(tree_bytes(last))}; " if last else ""
    kept = (
        f"The previous checkpoint, {last.name}, is intact: restart with --resume once there is "
        f"space, and the run continues from it exactly."
        if last
        else "There is no earlier checkpoint: a restart starts from the beginning."
    )
    why = " ".join(f"{type(error).__name__}: {error}".split())[:500]
    return CheckpointWriteError(
        f"checkpoint {final.name} could not be written to {root} ({why}). "
        f"{_mb(free) if free >= 0 else 'unknown space'} free there now; {need}the partial write "
        f"was removed. {kept} Free space on that filesystem (or lower --keep-checkpoints, or "
        "choose another --save-path)."
    )


def write_or_clean(root: Path, final: Path, tmp: Path, write: Callable[[], None]) -> None:
    """``write()`` into ``tmp``; any failure removes ``tmp`` and raises
    ``CheckpointWriteError`` (see ``write_failed``)."""
    try:
        write()
    except Exception as e:  # noqa: BLE001 - OSError, torch's RuntimeError, SafetensorError
        raise write_failed(root, final, tmp, e) from e


def clean_partial(save_path: str | Path) -> list[str]:
    """Remove what a killed checkpoint write or prune left under ``<save_path>/checkpoints``
    (``.tmp-*``: half-written; ``.trash-*``: being deleted), and rename back a checkpoint a
    kill caught mid-replacement (``.old-step_N-*`` with no ``step_N``: it was complete).
    Returns what was done, one line each. Call it only while no trainer writes there."""
    root = checkpoints_dir(save_path)
    done: list[str] = []
    if not root.is_dir():
        return done
    for p in sorted(root.iterdir()):
        if not p.name.startswith(PARTIAL):
            continue
        if p.name.startswith(".old-"):
            name = p.name[len(".old-") :].rsplit("-", 1)[0]
            if not (root / name).exists():
                p.rename(root / name)
                done.append(f"restored {name} (a kill interrupted its replacement)")
                continue
        shutil.rmtree(p, ignore_errors=True)
        done.append(f"removed {p.name} (left by an interrupted checkpoint write or prune)")
    return done


def save_checkpoint(
    save_path: str | Path,
    model: torch.nn.Module,
    tokenizer: Any,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    state: TrainerState,
    keep: int = 2,
    extra_state: dict[str, Any] | None = None,
) -> Path:
    """Write checkpoint ``step_<state.step>`` atomically and prune to the newest ``keep``.

    ``extra_state``: name -> object with ``state_dict()``, saved as ``<name>.pt``."""
    root = checkpoints_dir(save_path)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{PREFIX}{state.step:06d}"
    tmp = root / f".tmp-{final.name}-{os.getpid()}"

    def write() -> None:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        model.save_pretrained(tmp / "model", safe_serialization=True)
        tokenizer.save_pretrained(tmp / "model")
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        torch.save(_rng_state(), tmp / "rng.pt")
        (tmp / "trainer_state.json").write_text(json.dumps(asdict(state), indent=1))
        for name, obj in (extra_state or {}).items():
            torch.save(obj.state_dict(), tmp / f"{name}.pt")
        _fsync_tree(tmp)  # an error here (EIO, ENOSPC on some filesystems) is a write error

    write_or_clean(root, final, tmp, write)
    return publish(tmp, final, save_path, keep)


def publish(tmp: Path, final: Path, save_path: str | Path, keep: int) -> Path:
    """Rename the complete, fsynced checkpoint ``tmp`` to ``final`` (replacing a checkpoint of
    the same step), make the rename durable, and prune ``save_path`` to the newest ``keep``
    (each one renamed aside first, so no half-deleted ``step_*`` is ever seen)."""
    root = final.parent
    if final.exists():  # same step saved again (e.g. end of run right after a periodic save)
        old = root / f".old-{final.name}-{os.getpid()}"
        final.rename(old)
        tmp.rename(final)
        _fsync_dir(root)
        shutil.rmtree(old)
    else:
        tmp.rename(final)
        _fsync_dir(root)
    for stale in list_checkpoints(save_path)[:-keep]:
        trash = root / f".trash-{stale.name}-{os.getpid()}"
        stale.rename(trash)
        shutil.rmtree(trash, ignore_errors=True)
    return final


def load_weights(model: torch.nn.Module, model_dir: Path) -> None:
    """Load checkpointed weights into ``model`` in place (full model or LoRA adapter)."""
    adapter = model_dir / "adapter_model.safetensors"
    if adapter.exists():
        from peft import set_peft_model_state_dict

        result = set_peft_model_state_dict(model, load_file(adapter))
        if result.unexpected_keys:
            raise RuntimeError(f"adapter checkpoint has unknown keys: {result.unexpected_keys}")
        return
    shards = sorted(model_dir.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"no safetensors weights in {model_dir}")
    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        state.update(load_file(shard))
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = getattr(model.config, "tie_word_embeddings", False)
    real_missing = [k for k in missing if not (tied and k.startswith("lm_head."))]
    if unexpected or real_missing:
        raise RuntimeError(f"checkpoint mismatch: missing={real_missing} unexpected={unexpected}")


def load_checkpoint(
    path: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> TrainerState:
    """Restore weights, optimizer, scheduler and RNG from ``path``; return the trainer state."""
    load_weights(model, path / "model")
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True))
    scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
    _set_rng_state(torch.load(path / "rng.pt", weights_only=False))
    return TrainerState(**json.loads((path / "trainer_state.json").read_text()))


def load_extra_state(path: Path, name: str) -> dict[str, Any] | None:
    """The ``<name>.pt`` state saved with checkpoint ``path``, or None if it has none."""
    f = Path(path) / f"{name}.pt"
    return torch.load(f, weights_only=True, map_location="cpu") if f.exists() else None


def save_final_model(save_path: str | Path, model: torch.nn.Module, tokenizer: Any) -> Path:
    """The servable model at ``<save_path>`` (written to a temporary directory first, then
    each file moved into place with ``os.replace``; checkpoints and logs are left alone).

    Under LoRA the adapter is merged into a copy of the base so vLLM can serve it directly.
    """
    out = Path(save_path)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".tmp-final-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    to_save = model
    if hasattr(model, "merge_and_unload"):
        import copy

        to_save = copy.deepcopy(model).merge_and_unload()

    def write() -> None:
        to_save.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        _fsync_tree(tmp)

    try:
        write()
    except Exception as e:  # noqa: BLE001 - a full disk: the checkpoints are intact
        shutil.rmtree(tmp, ignore_errors=True)
        why = " ".join(f"{type(e).__name__}: {e}".split())[:500]
        raise CheckpointWriteError(
            f"the final model could not be written to {out} ({why}); the partial write was "
            "removed and the checkpoints are intact: free space, then rerun with --resume "
            "(it only writes the final model)."
        ) from e
    for stale in out.iterdir():  # old weight shards the new save may not overwrite
        if stale.is_file() and (
            stale.suffix == ".safetensors" or stale.name.endswith(".safetensors.index.json")
        ):
            stale.unlink()
    for f in tmp.iterdir():
        os.replace(f, out / f.name)
    tmp.rmdir()
    return out
