"""What ``launch/run_all.sh`` prepares before it starts the services, each only if missing:
the preset's base model (the tiny model, or SmolLM2 for cpu-smol), the dataset and the SFT
cold start (``python -m trainer sft``); and the check that the rollouts stay within the
sequence length the SFT model was trained on. docs/TRAINER.md describes SFT.
"""

from __future__ import annotations

import json
from pathlib import Path

from launch.configs import write_service_config
from launch.follow import sft_source
from launch.run_config import RunConfig
from launch.supervisor import PY, run_step


def prepare_embedded(cfg: RunConfig, run_dir: Path) -> None:
    """The preset's base model (the tiny model, or SmolLM2 for cpu-smol), the dataset (with
    the env's ``num_sessions``) and the SFT cold start (``trainer.sft``, whose ``save_path``
    the launcher set to the preset's model), each only if missing."""
    launch_cfg, sft = cfg.launch, cfg.trainer.sft
    base, sft_dir = Path(launch_cfg.base_model), Path(sft.save_path)
    if not (base / "config.json").exists():
        name = launch_cfg.build_module.rsplit(".", 1)[-1]
        argv = [PY, "-m", launch_cfg.build_module, "--out", str(base)]
        run_step(name, argv, run_dir / f"{name}.log", title=f"build {name.replace('_', ' ')}")
    if not (Path(cfg.env.data_dir) / "test.jsonl").exists():
        argv = [PY, "-m", "env_server.data", "build", "--out", str(cfg.env.data_dir)]
        if cfg.env.num_sessions:
            argv += ["--num-sessions", str(cfg.env.num_sessions)]
        run_step("dataset", argv, run_dir / "dataset.log", title="build dataset")
    if not (sft_dir / "model.safetensors").exists():
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
