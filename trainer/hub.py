"""Optional push of checkpoints to the Hugging Face Hub (``--hub-repo-id``, ``$HF_TOKEN``).

Only when ``hub_repo_id`` is set. Each checkpoint's servable ``model/`` folder and its
``trainer_state.json`` go to ``checkpoints/step_NNNNNN`` in the repo; the optimizer, scheduler
and RNG state stay local (they are twice the model's size and only a local resume needs them).
A failed push is logged and training goes on: the checkpoint is safe on disk either way.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainer.config import CommonConfig

log = logging.getLogger(__name__)

LOCAL_ONLY = ["optimizer.pt", "scheduler.pt", "rng.pt", "rng_rank*.pt", "dcp/*"]
"""Checkpoint files that are not pushed (``dcp/``: a sharded trainer's weights + optimizer
shards, trainer/dist_checkpoint.py; ``model/`` holds the same weights, servable)."""
_created: set[str] = set()


def upload_kwargs(cfg: CommonConfig, checkpoint: Path) -> dict[str, Any] | None:
    """Arguments of ``huggingface_hub.upload_folder`` for ``checkpoint``; None: no push
    configured (no ``hub_repo_id``)."""
    if not cfg.hub_repo_id:
        return None
    checkpoint = Path(checkpoint)
    return {
        "repo_id": cfg.hub_repo_id,
        "repo_type": "model",
        "folder_path": str(checkpoint),
        "path_in_repo": f"checkpoints/{checkpoint.name}",
        "commit_message": f"{checkpoint.name} ({Path(cfg.save_path).name})",
        "ignore_patterns": list(LOCAL_ONLY),
        "token": cfg.hub_token,
    }


def push_checkpoint(
    cfg: CommonConfig, checkpoint: Path, upload: Callable[..., Any] | None = None
) -> Any | None:
    """Push ``checkpoint`` if configured. Returns the upload's result, None when skipped or
    failed. ``upload`` replaces ``huggingface_hub.upload_folder`` (the repo is then not
    created either)."""
    kwargs = upload_kwargs(cfg, checkpoint)
    if kwargs is None:
        return None
    try:
        if upload is None:
            from huggingface_hub import create_repo, upload_folder

            if cfg.hub_repo_id not in _created:
                create_repo(
                    cfg.hub_repo_id,
                    token=cfg.hub_token,
                    private=cfg.hub_private,
                    repo_type="model",
                    exist_ok=True,
                )
                _created.add(cfg.hub_repo_id)
            upload = upload_folder
        result = upload(**kwargs)
    except Exception as e:  # network, auth, offline mode: the local checkpoint is what matters
        log.warning(
            "push of %s to the hub repo %s failed (%s: %s); training goes on",
            checkpoint,
            cfg.hub_repo_id,
            type(e).__name__,
            e,
        )
        return None
    log.info("pushed %s to https://huggingface.co/%s", checkpoint.name, cfg.hub_repo_id)
    return result
