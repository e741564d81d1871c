"""Checkpoints under faults, on the micro Qwen2 (trainer/checkpoint.py; seconds):

- a write that fails for lack of space (a real full filesystem: a small tmpfs, or where this
  process may not mount one, its own ``RLIMIT_FSIZE`` lowered for the write) raises
  ``CheckpointWriteError`` naming the free space, the last checkpoint's size and the intact
  previous checkpoint; it leaves no partial directory, and the previous checkpoint still loads;
- ``clean_partial`` removes what a killed write or prune left and restores a checkpoint a
  kill caught mid-replacement; ``--resume`` refuses an incomplete newest checkpoint with the
  way out instead of loading it.

The trainer's whole run against a full disk and SIGKILLs inside checkpoint writes:
tests/integration/trainer/test_checkpoint_faults.py.
"""

from __future__ import annotations

import resource
import shutil
from pathlib import Path

import pytest
import torch

from bench.faults.small_disk import SmallDisk
from tests.unit.trainer.test_trainer_core import _grpo_cfg, build_micro_model
from trainer.checkpoint import (
    CheckpointWriteError,
    TrainerState,
    clean_partial,
    list_checkpoints,
    load_checkpoint,
    missing_parts,
    save_checkpoint,
    tree_bytes,
)
from trainer.model import load_model
from trainer.optim import build_optimizer, build_scheduler
from trainer.run import _decide_resume

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def micro_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_micro_model(tmp_path_factory.mktemp("micro"))


def test_a_checkpoint_that_cannot_be_written_fails_loudly_and_keeps_the_last_one(
    micro_model_dir: Path, tmp_path: Path
) -> None:
    cfg = _grpo_cfg(micro_model_dir, tmp_path)
    lm = load_model(cfg)
    opt = build_optimizer(lm.model, cfg)
    sched = build_scheduler(opt, cfg)
    root = tmp_path / "checkpoints"
    real = SmallDisk.can_mount()
    disk = SmallDisk(root, 8 << 20) if real else None
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    try:
        if disk:
            disk.__enter__()
        save_checkpoint(tmp_path, lm.model, lm.tokenizer, opt, sched, TrainerState(step=1))
        step1 = root / "step_000001"
        weights = {k: v.clone() for k, v in lm.model.state_dict().items()}
        with torch.no_grad():
            for p in lm.model.parameters():
                p.add_(1.0)  # step 2's weights differ
        if disk:
            disk.fill(leave=0)
        else:  # a file-size limit below the weights file: the write fails with EFBIG
            resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 10, limits[1]))
        with pytest.raises(CheckpointWriteError) as err:
            save_checkpoint(tmp_path, lm.model, lm.tokenizer, opt, sched, TrainerState(step=2))
        if not disk:
            resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        message = str(err.value)
        assert "checkpoint step_000002 could not be written" in message
        assert ("No space left" if disk else "File too large") in message
        assert "step_000001, is intact" in message and "--resume" in message
        assert f"{tree_bytes(step1) / 2**20:.1f} MB" in message  # what the last one took
        assert [p.name for p in root.iterdir() if p.name != ".filler"] == ["step_000001"]
        assert missing_parts(step1) == []
        state = load_checkpoint(step1, lm.model, opt, sched)  # the previous one still loads
        assert state.step == 1
        for k, v in lm.model.state_dict().items():
            assert torch.equal(v, weights[k]), k

        if disk:
            disk.release()  # the space is back: the next write works
        save_checkpoint(tmp_path, lm.model, lm.tokenizer, opt, sched, TrainerState(step=2))
        assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000001", "step_000002"]
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        if disk:
            disk.unmount()


def test_clean_partial_and_an_incomplete_checkpoint_is_refused(
    micro_model_dir: Path, tmp_path: Path
) -> None:
    cfg = _grpo_cfg(micro_model_dir, tmp_path, keep_checkpoints=5)
    lm = load_model(cfg)
    opt = build_optimizer(lm.model, cfg)
    sched = build_scheduler(opt, cfg)
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, lm.model, lm.tokenizer, opt, sched, TrainerState(step=step), 5)
    root = tmp_path / "checkpoints"
    (root / ".tmp-step_000004-123").mkdir()  # a write killed half-way
    (root / ".trash-step_000000-9").mkdir()  # a prune killed half-way
    (root / "step_000002").rename(root / ".old-step_000002-7")  # killed mid-replacement
    shutil.copytree(root / "step_000003", root / ".old-step_000003-8")  # replaced, not deleted
    done = clean_partial(tmp_path)
    assert len(done) == 4 and any("restored step_000002" in line for line in done)
    assert sorted(p.name for p in root.iterdir()) == ["step_000001", "step_000002", "step_000003"]

    (root / "step_000003" / "optimizer.pt").unlink()  # damaged after it was published
    assert missing_parts(root / "step_000003") == ["optimizer.pt (or dcp/.metadata)"]
    with pytest.raises(SystemExit) as refused:
        _decide_resume(cfg.model_copy(update={"resume": True}))
    message = str(refused.value)
    assert "step_000003 is incomplete (missing optimizer.pt" in message
    assert "resume from the one before it, step_000002" in message
