"""What SFT and GRPO share: seeding, model + optimizer + schedule, resume, metrics."""

from __future__ import annotations

import logging
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from trainer.checkpoint import (
    TrainerState,
    checkpoints_dir,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from trainer.config import CommonConfig
from trainer.hub import push_checkpoint
from trainer.metrics import MetricsLogger
from trainer.model import LoadedModel, load_model
from trainer.optim import build_optimizer, build_scheduler
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

    def checkpoint(self) -> Path:
        path = save_checkpoint(self.cfg.save_path, self.loaded.model, self.loaded.tokenizer,
                               self.optimizer, self.scheduler, self.state,
                               keep=self.cfg.keep_checkpoints,
                               extra_state=self.extra_state)  # fmt: skip
        push_checkpoint(self.cfg, path)  # only with --hub-repo-id
        return path


def setup_logging() -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True
    )


def start_run(cfg: CommonConfig, before_resume=None) -> Run:
    """Seed, load the model and optimizer, and (``--resume``) restore the latest checkpoint.

    ``before_resume(loaded)`` runs after the start model is loaded and before checkpointed
    weights replace it (GRPO builds its KL reference there: the reference is the start model).
    """
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    save_path = Path(cfg.save_path)
    save_path.mkdir(parents=True, exist_ok=True)
    loaded = load_model(cfg)
    loaded.model.train()  # from_pretrained returns eval mode
    if before_resume is not None:
        before_resume(loaded)
    optimizer = build_optimizer(loaded.model, cfg)
    scheduler = build_scheduler(optimizer, cfg)
    state, resumed_from = TrainerState(), None
    if cfg.resume:  # --resume / --resume-from-checkpoint latest|PATH (trainer/resume.py)
        resumed_from = resume_checkpoint(cfg)
        if resumed_from is None:
            log.warning("--resume: no checkpoint under %s yet; starting fresh", save_path)
        else:
            state = load_checkpoint(resumed_from, loaded.model, optimizer, scheduler)
            log.info("resumed from %s at step %d", resumed_from, state.step)
    elif cfg.overwrite:
        shutil.rmtree(checkpoints_dir(save_path), ignore_errors=True)
    elif latest_checkpoint(save_path) is not None:
        raise SystemExit(
            f"error: {save_path} already holds checkpoints; pass --resume to continue them "
            "--overwrite to start over, or another --save-path (refusing to mix two runs in one lineage)"
        )
    metrics = MetricsLogger(
        save_path / "metrics.jsonl",
        tb_dir=save_path / "tb" if cfg.tensorboard else None,
        wandb_project=cfg.wandb_project,
        run_config=cfg.model_dump(),
    )
    (save_path / "trainer_config.json").write_text(cfg.model_dump_json(indent=1))
    return Run(cfg, loaded, optimizer, scheduler, state, metrics, resumed_from)
