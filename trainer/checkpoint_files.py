"""Where a run's checkpoints are and whether one can be resumed, from the files alone (no
torch): what ``--resume`` decides with (trainer/resume.py, trainer/run.py) and what the
launcher reads to say what a ``--resume`` will do (launch/prepare.py ``resume_plan``).
The checkpoints themselves are written and read by trainer/checkpoint.py."""

from __future__ import annotations

import json
from pathlib import Path

PREFIX = "step_"
STATE_FILE = "trainer_state.json"


def checkpoints_dir(save_path: str | Path) -> Path:
    return Path(save_path) / "checkpoints"


def list_checkpoints(save_path: str | Path) -> list[Path]:
    root = checkpoints_dir(save_path)
    if not root.is_dir():
        return []
    done = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX)]
    return sorted(done, key=lambda p: int(p.name[len(PREFIX) :]))


def latest_checkpoint(save_path: str | Path) -> Path | None:
    found = list_checkpoints(save_path)
    return found[-1] if found else None


def missing_parts(path: Path) -> list[str]:
    """What checkpoint ``path`` lacks to be resumed ([]: complete): the trainer state, the
    weights, the optimizer (``optimizer.pt`` or DCP's ``dcp/.metadata``), scheduler, RNG."""
    missing = []
    try:
        json.loads((path / STATE_FILE).read_text())
    except (OSError, ValueError):
        missing.append(STATE_FILE)
    if not any((path / "model").glob("*.safetensors")):
        missing.append("model/*.safetensors")
    if not ((path / "optimizer.pt").is_file() or (path / "dcp" / ".metadata").is_file()):
        missing.append("optimizer.pt (or dcp/.metadata)")
    missing += [f for f in ("scheduler.pt", "rng.pt") if not (path / f).is_file()]
    return missing


def checkpoint_step(path: Path) -> int:
    """The optimizer steps a (complete) checkpoint has done: its trainer state's ``step``."""
    return int(json.loads((path / STATE_FILE).read_text())["step"])
