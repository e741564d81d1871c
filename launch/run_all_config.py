"""The options of ``launch/run_all.sh`` (one flag per field, settings/cli.py) and how they
layer over the preset and the recipe (``layers``; precedence in launch/configs.py)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, FilePath, ValidationError

from launch.configs import (
    Layers,
)
from launch.placement import (
    PlacementError,
    num_servers_from_env,
)
from launch.presets import Preset, PresetName
from launch.run_all_help import HELP_EPILOG
from settings.flags import add_config_flags, flag_values


class RunAllConfig(BaseModel):
    """Options of launch/run_all.sh."""

    preset: PresetName = Field(
        "cpu-tiny",
        description="Model/device preset (recipes/presets/<name>.yaml; the lowest layer: "
        "--recipe and flags override it).",
    )
    model: str | None = Field(None, description="Override the preset's model (dir or hub id).")
    weight_bridge_mode: Literal["shared_vllm", "lora_only", "none"] = Field(
        "shared_vllm", description="How trainer weights reach vLLM (docs/BRIDGE.md)."
    )
    single_copy: bool = Field(False, description="shared_vllm: one weight copy in shared memory.")
    training_steps: int = Field(
        120, ge=1, description="GRPO training steps (default: the preset's, else 120)."
    )
    sft_steps: int | None = Field(
        None, ge=1, description="SFT steps if SFT must run (default: trainer's)."
    )
    num_sessions: int | None = Field(
        None,
        ge=10,
        description="Sessions of the dataset, built if missing (default: the recipe's, "
        "else the dataset on disk, else 3000); a dataset of another size is an error.",
    )
    keep_constant_groups: bool = Field(
        False, description="Keep groups whose rewards are all equal (zero advantage)."
    )
    eval_samples: int | None = Field(
        None,
        ge=0,
        description="Test-split steps to evaluate (0: skip; default: the preset's "
        "launch.eval_samples, 512 where it names none: ~±3 points).",
    )
    run_dir: Path | None = Field(None, description="Run directory (default runs/<timestamp>).")
    resume: bool = Field(
        False,
        description="Continue the run in --run-dir (after a crash, an OOM kill, a full disk "
        "or Ctrl-C): the same API database, the trainer from its last checkpoint; the model, "
        "dataset and SFT checkpoint are reused (an unfinished SFT continues from its own "
        "checkpoint), and so is a finished SFT evaluation. Give the run's other flags again.",
    )
    api_port: int | None = Field(None, description="API port (default: a free one).")
    vllm_port: int | None = Field(
        None, description="Port of the first vLLM server (default: a free one; others: free)."
    )
    num_inference_servers: int = Field(
        default_factory=num_servers_from_env,
        ge=1,
        description="vLLM servers to start, all synced by the trainer and sampled by the env "
        "(default: $NUM_INFERENCE_NODES as in Atropos, unset or 0 = 1).",
    )
    tensor_parallel_size: int = Field(
        1, ge=1, description="vLLM --tensor-parallel-size of each server (GPUs per server)."
    )
    trainer_procs: int = Field(
        1,
        ge=1,
        description="Trainer processes on this node: >1 runs the trainer under torchrun, "
        "sharded with FSDP2 (one GPU each on CUDA). Several nodes: set NNODES, NODE_RANK, "
        "MASTER_ADDR, MASTER_PORT (docs/MULTINODE.md).",
    )
    vllm_args: str | None = Field(
        None,
        description="More vLLM flags for every server, one quoted string after '=' (e.g. "
        "--vllm-args='--gpu-memory-utilization 0.3'); they win over the preset's and the "
        "recipe's.",
    )
    env_args: str | None = Field(
        None,
        description="More `python -m env_server` flags, one quoted string after '=' (e.g. "
        "--env-args='--group-size 8'); they win over the preset's and the recipe's.",
    )
    trainer_args: str | None = Field(
        None,
        description="More `python -m trainer grpo` flags, one quoted string after '=' (e.g. "
        "--trainer-args='--lr 1e-4 --kl-beta 0.05'); they win over the preset's and the recipe's.",
    )
    gpus: str | None = Field(
        None,
        description="GPU presets: comma-separated GPU ids to place the servers and the trainer "
        "on (default: $CUDA_VISIBLE_DEVICES, else every GPU nvidia-smi lists).",
    )
    prepare_only: bool = Field(
        False, description="Build the tiny model, dataset and SFT checkpoint if missing, then exit."
    )
    health_timeout: float = Field(600.0, description="Seconds to wait for each health check.")
    recipe: FilePath | None = Field(
        None,
        description="Recipe over the preset for every service (recipes/<model>/<task>/*.yaml, "
        "docs/RECIPES.md); the launcher's flags, ports and paths win over it.",
    )


def layers(cfg: RunAllConfig, preset: Preset) -> Layers:
    """The preset, the recipe and the launcher's own settings of every service (their
    precedence: launch/configs.py). A launcher flag left at its default counts under the
    recipe; given on the command line, over it."""
    given = cfg.model_fields_set
    defaults: dict[str, dict] = {"trainer.grpo": {}}
    flags: dict[str, dict] = {"trainer.grpo": {}, "trainer.sft": {}, "env": {}}
    preset_steps = ((preset.recipe.get("trainer") or {}).get("grpo") or {}).get("training_steps")
    if "training_steps" in given:
        flags["trainer.grpo"]["training_steps"] = cfg.training_steps
    elif preset_steps is None:  # the launcher's default only where the preset names none
        defaults["trainer.grpo"]["training_steps"] = cfg.training_steps
    if cfg.weight_bridge_mode == "lora_only":
        defaults["trainer.grpo"]["lora_r"] = 8
    if cfg.keep_constant_groups:
        flags["env"]["drop_constant_groups"] = False
    if cfg.num_sessions:
        flags["env"]["num_sessions"] = flags["trainer.sft"]["num_sessions"] = cfg.num_sessions
    if cfg.sft_steps:
        flags["trainer.sft"]["training_steps"] = cfg.sft_steps
    recipe = cfg.recipe.resolve() if cfg.recipe else None
    return Layers(preset, recipe, defaults, flags)


def parse_args(argv: list[str] | None = None) -> RunAllConfig:
    """One flag per :class:`RunAllConfig` field (settings/cli.py: choices and defaults in
    ``--help``); the fields given are ``model_fields_set`` (they count over the recipe)."""
    p = argparse.ArgumentParser(
        prog="launch/run_all.sh",
        description=__doc__.split("\n\n")[0],
        epilog=HELP_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_flags(p, RunAllConfig, files=False)
    ns = p.parse_args(argv)
    try:  # a bad value or a bad NUM_INFERENCE_NODES
        return RunAllConfig.model_validate(flag_values(RunAllConfig, ns))
    except (ValidationError, PlacementError) as e:
        p.error(str(e))
