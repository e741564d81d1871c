"""Which checkpoint a run continues from (``--resume`` / ``--resume-from-checkpoint``).

``latest``: the newest checkpoint under ``<save_path>/checkpoints`` (none yet: start fresh).
A path: a checkpoint directory (``.../checkpoints/step_000042``) or a run directory (its newest
checkpoint), possibly of another run; training then continues into ``save_path``. So that two
lineages never mix in one ``checkpoints/`` folder (a later ``latest`` would pick the wrong one),
a path is refused when ``save_path`` already holds newer or foreign checkpoints, unless
``--overwrite`` is given and the path lies outside ``save_path`` (its checkpoints are then
deleted, as ``--overwrite`` always does).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from trainer.checkpoint_files import STATE_FILE, list_checkpoints
from trainer.config import CommonConfig


def _as_checkpoint(path: Path) -> Path:
    if (path / STATE_FILE).is_file() and (path / "model").is_dir():
        return path
    found = list_checkpoints(path)
    if found:  # a run directory: its newest checkpoint
        return found[-1]
    raise SystemExit(
        f"error: --resume {path}: not a checkpoint directory (no {STATE_FILE} "
        "and model/) and no checkpoints/step_* under it"
    )


def resume_checkpoint(cfg: CommonConfig) -> Path | None:
    """The checkpoint to load (checked as described above), or None to start fresh."""
    save_path = Path(cfg.save_path)
    own = list_checkpoints(save_path)
    # True means latest (a config built with model_copy is not validated)
    spec = "latest" if cfg.resume is True else cfg.resume or None
    if spec is None:
        return None
    if spec == "latest":
        return own[-1] if own else None
    path = Path(spec).expanduser()
    if not path.exists():
        raise SystemExit(f"error: --resume {path}: no such directory")
    ckpt = _as_checkpoint(path).resolve()
    own_resolved = [p.resolve() for p in own]
    if not own or ckpt == own_resolved[-1]:
        return ckpt
    if ckpt in own_resolved:
        raise SystemExit(
            f"error: {ckpt.name} is not the newest checkpoint in {save_path} (newer: "
            f"{[p.name for p in own[own_resolved.index(ckpt) + 1 :]]}); resuming from it would "
            "mix two "
            "lineages. Resume the newest, or copy this one to another --save-path."
        )
    if not cfg.overwrite:
        raise SystemExit(
            f"error: {save_path} already holds checkpoints of another run; resuming from "
            f"{ckpt} there would mix two lineages. Pass --overwrite to delete them, or "
            "choose another --save-path."
        )
    shutil.rmtree(save_path / "checkpoints")
    return ckpt
