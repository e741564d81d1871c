"""The launcher resolves ``--precision auto`` once where the evaluations' dtype follows the
trainer's precision, and writes that resolution into the trainers' configs: the trainers and
the evaluations' servers cannot each time the CPU and disagree (launch/run_plan.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from launch import run_plan
from launch.configs import resolve_for_run, write_service_config
from launch.run_config import RunConfig

pytestmark = pytest.mark.unit


def _run(argv: list[str], run_dir: Path) -> RunConfig:
    url = "http://127.0.0.1:1"
    return resolve_for_run(["--preset", "cpu-tiny", *argv], url, [url], run_dir, warn=False)


def test_one_resolution_reaches_the_trainers_and_the_evaluations(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """cpu-tiny: GRPO ``auto``, SFT ``fp32``. With the evaluations on their own servers the
    launcher asks ``python -m trainer.precision`` once (the real one); the evaluations' dtype
    and the GRPO trainer's file follow that answer, and SFT's explicit fp32 stays."""
    answers: list[str] = []
    real = run_plan.cpu_precision

    def counted() -> str:
        answers.append(real())
        return answers[-1]

    monkeypatch.setattr(run_plan, "cpu_precision", counted)
    cfg = _run(["--eval-server", "own"], tmp_path)
    assert (cfg.trainer.grpo.precision, cfg.trainer.sft.precision) == ("auto", "fp32")
    plan = run_plan.plan_run(cfg, tmp_path)
    assert len(answers) == 1 and plan.precision == answers[0] in ("bf16", "fp32")
    assert plan.eval_dtype == ("bfloat16" if plan.precision == "bf16" else None)
    written = run_plan.with_precision(cfg, plan.precision)
    assert written.trainer.grpo.precision == plan.precision
    assert written.trainer.sft.precision == "fp32"  # asked for: kept
    path = write_service_config(tmp_path, "trainer_grpo", written, "trainer.grpo")
    assert yaml.safe_load(path.read_text())["trainer"]["grpo"]["precision"] == plan.precision
    # an SFT that asked for auto gets the same answer
    both = run_plan.with_precision(_run(["--trainer.sft.precision", "auto"], tmp_path), "bf16")
    assert (both.trainer.sft.precision, both.trainer.grpo.precision) == ("bf16", "bf16")


@pytest.mark.parametrize(
    "flags",
    [
        ["--eval-server", "run"],  # the evaluations use the run's servers, in the run's dtype
        ["--eval-server", "own", "--eval-dtype", "float32"],  # a dtype asked for
        ["--eval-server", "own", "--weight-bridge-mode", "lora_only"],  # LoRA keeps the run's
        ["--eval-server", "own", "--trainer.grpo.precision", "bf16"],  # nothing to resolve
    ],
)
def test_where_the_evaluations_do_not_follow_auto_the_trainers_resolve_it(
    flags: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(run_plan, "cpu_precision", lambda: pytest.fail("resolved for nothing"))
    cfg = _run(flags, tmp_path)
    plan = run_plan.plan_run(cfg, tmp_path)
    assert plan.precision is None
    assert run_plan.with_precision(cfg, plan.precision) is cfg
