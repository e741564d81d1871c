"""SFT on the embedded tiny model: the loss falls, and a run killed with SIGKILL and resumed
ends with exactly the weights of an uninterrupted run (same data order, optimizer, schedule).
The run to kill stops itself once its first checkpoint is written (the test-only fault point
``checkpointed``, procutil/faults.py), so the kill lands mid-run whatever the box's speed."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from launch.lifeline import is_stopped
from launch.procs import ManagedProcess
from procutil.faults import FAULT_ENV
from trainer.config import SftConfig
from trainer.sft import train

pytestmark = pytest.mark.integration
STEPS = 4


def _cfg(model_dir: Path, data_dir: Path, save: Path, **kw: object) -> SftConfig:
    # fp32 on every CPU (`auto` would pick bf16 on CPUs with native bf16 only)
    base = dict(
        model_name=str(model_dir),
        data_dir=str(data_dir),
        save_path=str(save),
        num_sessions=12,
        training_steps=STEPS,
        batch_size=2,
        micro_batch_size=1,
        max_seq_len=640,
        latest_only=True,
        lr=3e-3,
        warmup_steps=1,
        save_every=1,
        eval_every=STEPS,
        eval_examples=2,
        eval_generate=0,
        tensorboard=False,
        precision="fp32",
    )
    return SftConfig(**(base | kw))


def _argv(cfg: SftConfig) -> list[str]:
    argv = [sys.executable, "-m", "trainer", "sft"]
    for k, v in cfg.model_dump().items():
        if isinstance(v, bool):
            argv.append(f"--{'' if v else 'no-'}{k.replace('_', '-')}")
        elif v is not None:
            argv += [f"--{k.replace('_', '-')}", str(v)]
    return argv


def test_sft_loss_falls_and_kill_resume_is_exact(tiny_model_dir: Path, tmp_path: Path) -> None:
    data = tmp_path / "data"
    straight = _cfg(tiny_model_dir, data, tmp_path / "straight", eval_generate=2, max_new_tokens=8)
    train(straight)
    rows = [json.loads(x) for x in (tmp_path / "straight/metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == STEPS and losses[-1] < losses[0]
    assert "val_loss" in rows[STEPS - 1] and "eval/format_valid" in rows[-1]

    killed = _cfg(tiny_model_dir, data, tmp_path / "killed")
    env = {**os.environ, FAULT_ENV: "checkpointed:self"}  # it stops after checkpoint 1
    log = tmp_path / "killed.log"
    proc = ManagedProcess("sft", _argv(killed), log, env=env, forked=True).start()
    deadline = time.monotonic() + 600
    while not is_stopped(proc.pid):
        assert proc.alive() and time.monotonic() < deadline, log.read_text()[-2000:]
        time.sleep(0.05)
    proc.kill9()  # SIGKILL while stopped between step 1 and step 2
    ckpts = sorted(p.name for p in (tmp_path / "killed" / "checkpoints").glob("step_*"))
    assert ckpts == ["step_000001"], ckpts
    # the kill landed before the run's end (a finished run resumed would compare nothing)
    assert not (tmp_path / "killed" / "model.safetensors").exists()
    train(killed.model_copy(update={"resume": "latest"}))  # as --resume validates to
    a = load_file(tmp_path / "straight" / "model.safetensors")
    b = load_file(tmp_path / "killed" / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert (a[k] == b[k]).all(), k
