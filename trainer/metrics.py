"""Step metrics: one JSON line per step (always), TensorBoard and W&B when available; texts
(TensorBoard) and tables (W&B) for the rollout samples of trainer/rollout_log.py."""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class MetricsLogger:
    """Appends ``{"step": N, "time": unix, ...}`` lines to ``path`` (flushed every line, so a
    killed run keeps every step it logged); mirrors scalars to TensorBoard / W&B if set up.
    ``path=None`` logs nothing (the ranks other than 0 of a sharded trainer)."""

    def __init__(
        self,
        path: Path | None,
        tb_dir: Path | None = None,
        wandb_project: str | None = None,
        run_config: dict[str, Any] | None = None,
    ) -> None:
        self._file = None
        self._tb = None
        self._wandb = None
        if path is None:  # a logger that logs nothing (the other ranks of a sharded trainer)
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 - closed in close()
        if tb_dir is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(tb_dir))
            except ImportError:
                log.info("tensorboard is not installed; metrics go to %s only", path)
        if wandb_project:
            try:
                import wandb

                self._wandb = wandb.init(project=wandb_project, config=run_config or {})
            except ImportError:
                log.warning("wandb_project is set but wandb is not installed; not logging there")

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if self._file is None:
            return
        row = {"step": step, "time": round(time.time(), 3), **metrics}
        self._file.write(json.dumps(_finite(row), default=str) + "\n")
        scalars = {
            k: float(v)
            for k, v in metrics.items()
            if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
        }
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def log_text(self, tag: str, text: str, step: int) -> None:
        """Markdown ``text`` as TensorBoard text under ``tag`` (the TEXT tab); not in W&B,
        which gets :meth:`log_table` instead."""
        if self._tb is not None:
            self._tb.add_text(tag, text, step)

    def log_table(self, key: str, columns: list[str], rows: list[list[Any]], step: int) -> None:
        """A W&B table (``wandb.Table``) under ``key`` at ``step``, when W&B is on."""
        if self._wandb is not None:
            import wandb

            self._wandb.log({key: wandb.Table(columns=columns, data=rows)}, step=step)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _finite(row: dict[str, Any]) -> dict[str, Any]:
    """NaN/inf become null: json.dumps would write NaN, which is not JSON."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()}
