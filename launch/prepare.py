"""What ``launch/run_all.sh`` prepares before it starts the services, each only if missing:
the preset's base model (the tiny model, or SmolLM2 for cpu-smol), the dataset and the SFT
cold start (``python -m trainer sft``); and the check that the rollouts stay within the
sequence length the SFT model was trained on. docs/TRAINER.md describes SFT.
"""

from __future__ import annotations

import json
from pathlib import Path

from launch.follow import sft_source
from launch.paths import DATA_DIR
from launch.presets import Preset
from launch.supervisor import PY, run_step


def prepare_embedded(
    preset: Preset,
    run_dir: Path,
    recipe: list[str],
    num_sessions: int | None = None,
    sft_steps: int | None = None,
) -> None:
    """Build the base model, the dataset and the SFT checkpoint of ``preset`` if missing.

    ``recipe``: ``--recipe PATH`` for the SFT command line (empty without a recipe);
    ``num_sessions``: sessions to simulate for the dataset (default: the builder's);
    ``sft_steps``: SFT steps (default: the trainer's)."""
    base, sft_dir = Path(preset.base_model), Path(preset.model)
    if not (base / "config.json").exists():
        name = preset.build_module.rsplit(".", 1)[-1]
        argv = [PY, "-m", preset.build_module, "--out", str(base)]
        run_step(name, argv, run_dir / f"{name}.log", title=f"build {name.replace('_', ' ')}")
    if not (DATA_DIR / "test.jsonl").exists():
        argv = [PY, "-m", "env_server.data", "build", "--out", str(DATA_DIR)]
        if num_sessions:
            argv += ["--num-sessions", str(num_sessions)]
        run_step("dataset", argv, run_dir / "dataset.log", title="build dataset")
    if not (sft_dir / "model.safetensors").exists():
        # An interrupted SFT left checkpoints: continue it rather than start over.
        resume = (sft_dir / "checkpoints").is_dir()
        # --eval-generate 0: the launcher measures the SFT model itself, with vLLM (much faster).
        argv = [PY, "-m", "trainer", "sft", *recipe, "--model-name", str(base),
                "--save-path", str(sft_dir), "--data-dir", str(DATA_DIR),
                "--no-tensorboard", "--eval-generate", "0", *preset.sft_extra,
                "--resume" if resume else "--overwrite"]  # fmt: skip
        if not recipe and "--precision" not in preset.sft_extra:
            # cpu-tiny: fp32 on every CPU: the SFT checkpoint docs/results/ start from was
            # trained in fp32 (`auto` would make it a bf16-trained, different model on CPUs
            # with bf16). A preset or recipe that names a precision decides its own.
            argv += ["--precision", "fp32"]
        if sft_steps:
            argv += ["--training-steps", str(sft_steps)]
        source = sft_source(sft_dir, sft_steps)
        run_step("sft", argv, run_dir / "sft.log", title="SFT", source=source)


def context_warning(model: str, preset: Preset) -> str | None:
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
    need = preset.max_prompt_tokens + preset.max_tokens
    if need <= trained:
        return None
    return (f"{model} was fine-tuned on sequences of {trained} tokens, but prompts of up to "
            f"{preset.max_prompt_tokens} + completions of {preset.max_tokens} tokens reach "
            f"position {need}: the model has never seen those positions. Lower the preset's "
            f"max_prompt_tokens or fine-tune with a larger --max-seq-len.")  # fmt: skip
