"""``RunConfig``: every setting of a run in one nested model, sections ``launch``, ``api``,
``env``, ``trainer.sft``, ``trainer.grpo``, ``vllm`` and optionally ``verifiers`` (docs/RECIPES.md): one YAML file per
run over its preset, ``SHOP_R1_<SECTION>__<FIELD>`` variables, dotted flags, in that order."""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, FilePath, model_validator
from pydantic_settings import SettingsConfigDict

from api.config import ApiConfig
from env_server.config import EnvConfig
from env_server.verifiers.config import VerifiersConfig
from launch.launch_config import LaunchConfig
from settings.cli import add_config_flags, cli_shortcuts, flag_values
from settings.layers import Layer, RecipeError, env_layer, expand, file_layers, read_recipe, resolve
from settings.paths import PRESETS_DIR
from trainer.config import GrpoConfig, SftConfig
from vllm_patching.config import VllmConfig
from vllm_patching.protocol import BridgeMode


class _Keys(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class TrainerSection(_Keys):
    """``trainer:``: the two commands (keys given beside ``sft:``/``grpo:`` apply to both)."""

    sft: SftConfig = Field(default_factory=SftConfig)
    """``python -m trainer sft``."""
    grpo: GrpoConfig = Field(default_factory=GrpoConfig)
    """``python -m trainer grpo``."""


class RunConfig(_Keys):
    """launch/run_all.sh: every setting of a run (docs/RECIPES.md)."""

    model_config = SettingsConfigDict(  # the launcher's options also without launch.: --run-dir
        cli_shortcuts={
            **{f"launch.{n}": n for n in (f.replace("_", "-") for f in LaunchConfig.model_fields)},
            **cli_shortcuts(GrpoConfig.old_keys, "trainer.grpo."),  # --trainer-args='--clip-low 1'
        }
    )

    name: str | None = None
    """For humans."""
    description: str | None = None
    """For humans."""
    preset: Literal["cpu-tiny", "cpu-smol", "gpu-0.5b", "gpu-3b"] = "cpu-tiny"
    """The file recipes/presets/<name>.yaml, the lowest file of the run (command line)."""
    recipe: FilePath | None = Field(None, validation_alias=AliasChoices("recipe", "config"))
    """This run's file, over the preset (recipes/<model>/<task>/*.yaml; command line; alias
    ``--config``, the services' name of their one file)."""
    model: str | None = None
    """What vLLM serves and GRPO starts from (also the env's tokenizer)."""
    seed: int | None = None
    """Every service's seed."""
    weight_bridge_mode: BridgeMode = "shared_vllm"
    """How trainer weights reach vLLM (docs/BRIDGE.md)."""
    single_copy: bool = False
    """shared_vllm: one weight copy in shared memory."""
    training_steps: int | None = Field(None, ge=1)
    """GRPO training steps (``trainer.grpo.training_steps``)."""
    sft_steps: int | None = Field(None, ge=1)
    """SFT steps if SFT must run (``trainer.sft.training_steps``)."""
    num_sessions: int | None = Field(None, ge=10)
    """Sessions of the dataset, built if missing (``env.num_sessions``, ``trainer.sft.``)."""
    episode: Literal["step", "session"] | None = None
    """Shop-R1 prompts: each step its own prompt, or the session as one conversation
    (``env.episode``, ``trainer.sft.episode``; env_server/sessions.py)."""
    keep_constant_groups: bool = False
    """Keep groups whose rewards are all equal (``env.drop_constant_groups`` false)."""
    reproducible: bool = False
    """One seed, one run: every rollout seeded, each batch sampled on-policy once its weights
    are live, groups pushed in the order drawn (``env.lockstep_groups``; docs/RUNNING.md)."""
    env_args: str | None = None
    """Overrides of ``env.``: `--env-args='--group-size 8'` is `--env.group-size 8`."""
    trainer_args: str | None = None
    """Overrides of ``trainer.grpo.``: `--trainer-args='--lr 1e-4'` is `--trainer.grpo.lr 1e-4`."""
    launch: LaunchConfig = Field(default_factory=LaunchConfig)
    """launch/run_all.sh's own options (also taken without ``launch.``: ``--run-dir``)."""
    api: ApiConfig = Field(default_factory=ApiConfig)
    """``python -m api``."""
    env: EnvConfig = Field(default_factory=EnvConfig)
    """``python -m env_server``."""
    trainer: TrainerSection = Field(default_factory=TrainerSection)
    """``python -m trainer sft|grpo``."""
    vllm: VllmConfig = Field(default_factory=VllmConfig)
    """``python -m vllm_patching.serve``."""
    verifiers: VerifiersConfig | None = None
    """``python -m env_server.verifiers``: a verifiers environment trained beside Shop-R1's
    (or instead of it: ``launch.shop_r1_env`` false); none by default."""

    @model_validator(mode="after")
    def _reproducible_batches(self) -> RunConfig:
        if not self.reproducible:
            return self
        if self.verifiers is not None or not self.launch.shop_r1_env:
            raise ValueError("reproducible: the lockstep is the Shop-R1 env's; not with verifiers")
        batch, group = self.trainer.grpo.batch_size, self.env.group_size
        if batch % group:
            raise ValueError(
                f"reproducible: trainer.grpo.batch_size {batch} is not a whole number of groups "
                f"of env.group_size {group}"
            )
        return self


def without_options(
    argv: Sequence[str], valued: Sequence[str], flags: Sequence[str] = ()
) -> list[str]:
    """``argv`` less the options ``valued`` (with their value: ``--x v`` or ``--x=v``) and the
    bare ``flags``: what a command derived from the run's (the tiny preset's, the resume
    hint's) gives again its own way."""
    rest, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in valued:
            skip = True
        elif a not in flags and a.split("=", 1)[0] not in valued:
            rest.append(a)
    return rest


def _dotted(args: str | None, section: str) -> list[str]:
    """``--env-args='--group-size 8'`` -> ``--env.group-size 8``."""
    return [f"--{section}.{a[2:]}" if a.startswith("--") else a for a in shlex.split(args or "")]


def _flags(argv: Sequence[str]) -> dict[str, Any]:
    from launch.run_all_help import HELP_EPILOG

    parser = argparse.ArgumentParser(
        prog="launch/run_all.sh",
        description=__doc__.split("\n\n")[0],
        epilog=HELP_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_flags(parser, RunConfig, files=False)
    return flag_values(parser.parse_args(argv))


def cli_layer(argv: Sequence[str]) -> dict[str, Any]:
    """The values the command line gives (``--env-args``/``--trainer-args`` expanded last)."""
    first = _flags(argv)
    more = _dotted(first.get("env_args"), "env")
    more += _dotted(first.get("trainer_args"), "trainer.grpo")
    return _flags([*argv, *more]) if more else first


def run_layers(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> list[Layer]:
    """The run's layers, lowest first: preset < recipe < environment < command line."""
    cli = cli_layer([] if argv is None else argv)
    preset = PRESETS_DIR / f"{cli.get('preset', 'cpu-tiny')}.yaml"
    if "model" not in read_recipe(preset):
        raise RecipeError(f"{preset}: a preset names its `model`")
    files = [preset, *([Path(cli["recipe"])] if cli.get("recipe") else [])]
    env = ("environment", expand(env_layer(RunConfig, "", environ)))
    return [*(layer for f in files for layer in file_layers(f)), env, ("command line", expand(cli))]


def resolve_run(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> RunConfig:
    """The run's layers validated once (the launcher's decisions: ``launch.configs``)."""
    return resolve(RunConfig, run_layers(argv, environ))


def parse_run(argv: Sequence[str] | None = None) -> tuple[list[Layer], RunConfig]:
    """launch/run_all.sh's command line: the run's layers and the run they resolve to; a bad
    ``NUM_INFERENCE_NODES`` exits 2."""
    from launch.placement import PlacementError

    try:
        layers = run_layers(sys.argv[1:] if argv is None else argv)
        return layers, resolve(RunConfig, layers)
    except PlacementError as e:
        print(f"launch/run_all.sh: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def parse_args(argv: Sequence[str] | None = None) -> RunConfig:
    """launch/run_all.sh's command line resolved (:func:`parse_run`)."""
    return parse_run(argv)[1]
