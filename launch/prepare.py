"""What ``launch/run_all.sh`` prepares before it starts the services, each only if missing:
the preset's base model (the tiny model, or SmolLM2 for cpu-smol), the dataset and the SFT
cold start (``python -m trainer sft``); the check that the rollouts stay within the
sequence length the SFT model was trained on; and what a ``--resume`` of a stopped run will
do (``resume_plan``, from the same decisions; ``resume_hint``: the command, and that).
docs/TRAINER.md describes SFT.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable
from pathlib import Path

from launch.configs import preset_model, resolve_for_run, write_service_config
from launch.evaluation import served_as
from launch.follow import sft_source
from launch.run_config import RunConfig, without_options
from launch.run_plan import RUN_DTYPE, eval_dtype
from launch.supervisor import PY, run_step
from trainer.checkpoint_files import checkpoint_step, missing_parts
from trainer.config import CommonConfig
from trainer.resume import resume_checkpoint


def prepares_embedded(cfg: RunConfig) -> bool:
    """Whether the run builds the preset's model itself (base model, dataset, SFT): a preset
    that does, serving the model the preset names (not another ``--model``); without Shop-R1's
    env (``launch.shop_r1_env`` false), serving the preset's base model, which it builds."""
    lc = cfg.launch
    serves = preset_model(cfg) if lc.shop_r1_env else lc.base_model
    return lc.build_embedded and str(cfg.model) == str(serves)


def has_base_model(cfg: RunConfig) -> bool:
    return (Path(cfg.launch.base_model) / "config.json").exists()


def has_dataset(cfg: RunConfig) -> bool:
    return (Path(cfg.env.data_dir) / "test.jsonl").exists()


def sft_done(cfg: RunConfig) -> bool:
    """The SFT cold start wrote its final model (the preset's model): it is not run again."""
    return (Path(cfg.trainer.sft.save_path) / "model.safetensors").exists()


def sft_eval_file(run_dir: Path) -> Path:
    """Where a run's SFT evaluation writes its metrics."""
    return run_dir / "eval_sft" / "metrics.json"


def reused_sft_eval(cfg: RunConfig, run_dir: Path, dtype: str | None) -> Path | None:
    """The SFT evaluation a ``--resume`` reads back instead of running it again, if any: one
    of the same split, served in the same dtype (``dtype``: the run's ``eval_dtype``, None for
    the run's servers'), so that the RL evaluation pairs with it."""
    done = sft_eval_file(run_dir)
    if not (cfg.launch.eval_samples and cfg.launch.resume and done.exists()):
        return None
    same = served_as(json.loads(done.read_text())) == (cfg.launch.eval_split, dtype or RUN_DTYPE)
    return done if same else None  # else it runs again


def prepare_embedded(
    cfg: RunConfig, run_dir: Path, before_sft: Callable[[], object] | None = None
) -> None:
    """The preset's base model (the tiny model, or SmolLM2 for cpu-smol), the dataset (with
    the env's ``num_sessions``) and the SFT cold start (``trainer.sft``, whose ``save_path``
    the launcher set to the preset's model), each only if missing; ``before_sft`` runs just
    before the SFT starts (the launcher's cost probe, launch/cost_probe.py)."""
    launch_cfg, sft = cfg.launch, cfg.trainer.sft
    base, sft_dir = Path(launch_cfg.base_model), Path(sft.save_path)
    if not has_base_model(cfg):
        name = launch_cfg.build_module.rsplit(".", 1)[-1]
        argv = [PY, "-m", launch_cfg.build_module, "--out", str(base)]
        run_step(name, argv, run_dir / f"{name}.log", title=f"build {name.replace('_', ' ')}")
    if not launch_cfg.shop_r1_env:  # no Shop-R1 env: no dataset, no SFT cold start
        return
    if not has_dataset(cfg):
        argv = [PY, "-m", "env_server.data", "build", "--out", str(cfg.env.data_dir)]
        if cfg.env.num_sessions:
            argv += ["--num-sessions", str(cfg.env.num_sessions)]
        run_step("dataset", argv, run_dir / "dataset.log", title="build dataset")
    if not sft_done(cfg):
        if before_sft is not None:
            before_sft()
        path = write_service_config(run_dir, "trainer_sft", cfg, "trainer.sft")
        argv = [PY, "-m", "trainer", "sft", "--config", str(path)]
        source = sft_source(sft_dir, sft.training_steps)
        run_step("sft", argv, run_dir / "sft.log", title="SFT", source=source)


def context_warning(model: str, max_prompt_tokens: int, max_tokens: int) -> str | None:
    """A warning when rollouts and evaluation would reach past the sequences ``model`` was
    fine-tuned on (its ``trainer_config.json``, written by ``python -m trainer sft``).

    A tiny model trained from scratch has never seen the positions beyond them: at a
    1536-token budget the embedded SFT model scored a mean reward of 6.5 against 45.7 at
    928 (env_server.config.DEFAULT_MAX_PROMPT_TOKENS).
    """
    path = Path(model) / "trainer_config.json"
    try:
        trained = int(json.loads(path.read_text())["max_seq_len"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # a hub model or no SFT record: nothing to compare with
    need = max_prompt_tokens + max_tokens
    if need <= trained:
        return None
    return (
        f"{model} was fine-tuned on sequences of {trained} tokens, but prompts of up to "
        f"{max_prompt_tokens} + completions of {max_tokens} tokens reach "
        f"position {need}: the model has never seen those positions. Lower the env's "
        f"max_prompt_tokens or fine-tune with a larger --max-seq-len."
    )


def _steps(n: int) -> str:
    return f"{n} step{'' if n == 1 else 's'}"


def _trainer_plan(name: str, cfg: CommonConfig) -> tuple[str, bool]:
    """What the trainer ``name`` (SFT, GRPO) does when started with ``cfg`` (its resolved
    ``resume``): the checkpoint trainer/resume.py picks and the check trainer/run.py makes
    of it, and whether it then has steps left to train."""
    total = cfg.training_steps
    ckpt = resume_checkpoint(cfg) if cfg.resume in (True, "latest") else None
    if ckpt is None:
        return f"{name} starts from step 0 ({_steps(total)}; no checkpoint yet)", True
    if missing := missing_parts(ckpt):
        return (
            f"{name} stops at once: its newest checkpoint, {ckpt.name}, is incomplete "
            f"(missing {', '.join(missing)}; move it aside to resume from the one before)",
            True,
        )
    step = checkpoint_step(ckpt)
    if step >= total:
        return f"{name} has done its {_steps(total)} ({ckpt.name})", False
    return f"{name} resumes from its step-{step} checkpoint ({_steps(total - step)} left)", True


def resume_plan(cfg: RunConfig, run_dir: Path) -> str:
    """What ``launch/run_all.sh`` with ``cfg`` (the command line of a ``--resume``, resolved
    against the files as they are now) will do, e.g. "the base model and the dataset are
    reused; SFT resumes from its step-10 checkpoint (20 steps left); GRPO has not started".

    Decided by what the run itself decides with: what :func:`prepare_embedded` builds, the
    SFT's own ``resume`` (launch/configs.py: its checkpoints, if any, are continued), the
    checkpoint trainer/resume.py picks for SFT and for GRPO (and trainer/run.py's check that
    it is complete), and the reuse of the SFT evaluation."""
    parts, sft_pending = [], False
    shop_r1 = cfg.launch.shop_r1_env  # without it: no dataset, no SFT, no Shop-R1 evaluation
    if prepares_embedded(cfg):
        have = {"the base model": has_base_model(cfg)}
        if shop_r1:
            have["the dataset"] = has_dataset(cfg)
        for done, verb in ((True, "reused"), (False, "built")):
            names = [n for n, h in have.items() if h is done]
            if names:
                parts.append(f"{' and '.join(names)} {'is' if len(names) == 1 else 'are'} {verb}")
        if shop_r1 and sft_done(cfg):
            parts.append("SFT is done (its model is reused)")
        elif shop_r1:
            text, sft_pending = _trainer_plan("SFT", cfg.trainer.sft)
            parts.append(text)
    grpo, left = _trainer_plan("GRPO", cfg.trainer.grpo)
    if sft_pending and grpo.startswith("GRPO starts from step 0"):
        grpo = "GRPO has not started"
    elif not left:
        grpo += ": only its final weights are synced to vLLM again"
    parts.append(grpo)
    evaluates = shop_r1 and cfg.launch.eval_samples
    # the dtype (a child process on a CPU run with `auto`) only where there is one to compare
    read_back = (
        evaluates
        and sft_eval_file(run_dir).exists()
        and reused_sft_eval(cfg, run_dir, eval_dtype(cfg, cfg.launch.trainer_device))
    )
    if read_back:
        parts.append("the SFT evaluation is read back, the RL evaluation runs")
    elif evaluates:
        parts.append("the SFT and RL evaluations run")
    if cfg.verifiers is not None and cfg.launch.verifiers_eval_env_args is not None:
        before = (run_dir / "eval_verifiers_before.jsonl").exists()
        runs = "is read back" if before else "runs"
        parts.append(f"the verifiers env's held-out evaluation before training {runs}")
    return "; ".join(parts)


def resume_hint(run_dir: Path, argv: list[str]) -> str:
    """How to continue this run: the same flags with ``--resume``, and what that will do from
    the state the run is in now (``launch.prepare.resume_plan``: the command resolved as its
    launch will resolve it, against the files the stopped run left)."""
    valued = ("--run-dir", "--launch.run-dir")  # either spelling: the hint gives its own
    flags = ("--resume", "--no-resume", "--launch.resume", "--no-launch.resume")
    args = ["--resume", "--run-dir", str(run_dir), *without_options(argv, valued, flags)]
    cmd = shlex.join(["launch/run_all.sh", *args])
    try:
        url = "http://127.0.0.1:0"  # the run's ports and URLs decide nothing of it
        what = resume_plan(resolve_for_run(args, url, [url], run_dir, warn=False), run_dir)
    except Exception as e:  # noqa: BLE001 -- the hint must never hide why the run stopped
        what = f"what it will redo could not be worked out: {type(e).__name__}: {e}"
    return f"[run_all] to continue this run: {cmd}\n[run_all]   --resume: {what}"
