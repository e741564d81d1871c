"""Presets of launch/run_all.sh: recipes in recipes/presets/<name>.yaml with a ``launch:``
section (what the launcher itself needs: build the embedded model? which device?).

A preset is the lowest layer of a run's configuration (docs/RECIPES.md): field defaults <
preset < ``--recipe`` < the launcher's flags. ``cpu-tiny`` is the default (tiny model, SFT cold
start built on the spot); the GPU presets name hub models, need CUDA vLLM and a GPU machine and
are not exercised in CI.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from settings.paths import PRESETS_DIR, TINY_MODEL_DIR
from settings.recipe import LAUNCH_KEY, RecipeError, load_recipe

PresetName = Literal["cpu-tiny", "cpu-smol", "gpu-0.5b", "gpu-3b"]


class LaunchSettings(BaseModel):
    """A preset's ``launch:`` section."""

    model_config = ConfigDict(extra="forbid")

    build_embedded: bool = Field(
        False, description="Build the base model, the dataset and the SFT cold start if missing."
    )
    base_model: str = Field(
        str(TINY_MODEL_DIR), description="build_embedded: the model SFT starts from."
    )
    build_module: str = Field(
        "trainer.tiny_model",
        description="build_embedded: `python -m` module that builds base_model if missing.",
    )
    trainer_device: Literal["cpu", "cuda"] = Field(
        "cpu", description="Where the trainer runs (launch/placement.py picks the GPUs)."
    )
    eval_samples: int = Field(
        512,
        ge=0,
        description="Test-split steps of the SFT-vs-RL evaluation (run_all's --eval-samples "
        "default); 512 gives ~±3 points.",
    )


@dataclass(frozen=True)
class Preset:
    """A preset: its recipe (read like any other) and its launcher settings."""

    name: str
    path: Path
    recipe: dict[str, Any]
    launch: LaunchSettings

    @property
    def model(self) -> str:
        """What vLLM serves and GRPO starts from (the recipe's shared ``model``)."""
        return str(self.recipe["model"])


def preset_path(name: str) -> Path:
    """recipes/presets/<name>.yaml."""
    return PRESETS_DIR / f"{name}.yaml"


def load_preset(name: str) -> Preset:
    """Read and check a preset (clear errors naming the file)."""
    path = preset_path(name)
    recipe = load_recipe(path)
    if "model" not in recipe:
        raise RecipeError(f"{path}: a preset names its `model`")
    try:
        launch = LaunchSettings.model_validate(recipe.get(LAUNCH_KEY) or {})
    except ValidationError as e:
        raise RecipeError(f"{path}: section 'launch':\n{e}") from None
    return Preset(name, path, recipe, launch)
