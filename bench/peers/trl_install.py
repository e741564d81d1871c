"""TRL for the peer benches: ``trl==TRL_VERSION`` alone in a folder of its own
(``ensure_trl``), which the TRL side puts on its ``PYTHONPATH``, so the project's venv stays
as it is and TRL runs on its torch/transformers/accelerate/datasets."""

from __future__ import annotations

import fcntl
import importlib.metadata
import os
import shutil
import subprocess
import sys
from pathlib import Path

TRL_VERSION = "1.16.0"


def trl_dir() -> Path:
    """Where TRL is installed for the bench (``$SHOP_R1_ARTIFACTS/venvs/trl-<version>``)."""
    from settings.paths import ARTIFACTS

    return ARTIFACTS / "venvs" / f"trl-{TRL_VERSION}"


def requirement_problems(metadata: str) -> list[str]:
    """The unconditional ``Requires-Dist`` lines of a METADATA text that the running
    interpreter does not satisfy (name missing or version outside the specifier)."""
    from packaging.requirements import Requirement

    problems = []
    for line in metadata.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue  # an extra (vllm, peft, ...) or another platform
        try:
            have = importlib.metadata.version(req.name)
        except importlib.metadata.PackageNotFoundError:
            problems.append(f"{req} (not installed)")
            continue
        if req.specifier and not req.specifier.contains(have, prereleases=True):
            problems.append(f"{req} (installed {have})")
    return problems


def ensure_trl() -> Path:
    """A folder holding ``trl==TRL_VERSION`` alone (``pip install --no-deps --target``), put
    on the TRL child's ``PYTHONPATH``: the project's venv stays as it is, and TRL runs on its
    torch/transformers/accelerate/datasets. Built on first use under a file lock; refused
    with the list when the venv does not satisfy TRL's own requirements."""
    target = trl_dir()
    target.parent.mkdir(parents=True, exist_ok=True)
    meta = target / f"trl-{TRL_VERSION}.dist-info" / "METADATA"
    with open(target.parent / f"trl-{TRL_VERSION}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not meta.exists():
            tmp = target.with_name(target.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            subprocess.run(
                [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(tmp)]
                + [f"trl=={TRL_VERSION}"],
                check=True,
            )
            shutil.rmtree(target, ignore_errors=True)
            os.replace(tmp, target)
    problems = requirement_problems(meta.read_text())
    if problems:
        raise SystemExit(
            f"TRL {TRL_VERSION} needs what this venv lacks: {'; '.join(problems)}. "
            "Install them into the venv, or point --trl-path at a folder with a TRL that fits."
        )
    return target
