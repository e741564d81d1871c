"""What launch/run_all.sh hands each service: its config, resolved once from the preset, the
recipe and the launcher's flags, written to ``<run>/config/<service>.yaml`` and read back by the
service with ``--config`` (docs/RECIPES.md).

Precedence, lowest first: field defaults < preset (recipes/presets/<name>.yaml) < the
launcher's defaults (``--training-steps 120``, ...) < ``--recipe`` < what the launcher decides
for the run (ports, URLs, paths, devices) < the launcher's flags given on its command line
(``--training-steps``, ``--keep-constant-groups``, ...) < ``--env-args`` / ``--trainer-args``.
Secrets (tokens) are never written: they travel by environment variable or flag.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from launch.presets import Preset
from settings.cli import Resolved, config_file_data, recipe_layer, resolve_layers
from settings.flags import flags_of
from settings.paths import DATA_DIR
from settings.recipe import deep_merge, load_recipe, section_values


@dataclass(frozen=True)
class Layers:
    """The layers every service config of a run is built from."""

    preset: Preset
    recipe: Path | None = None
    defaults: Mapping[str, Mapping[str, Any]] | None = None
    """``{section: values}`` the launcher's own defaults set (under the recipe)."""
    flags: Mapping[str, Mapping[str, Any]] | None = None
    """``{section: values}`` the launcher's flags set (over the recipe)."""


def service_config(
    cls: type[Any],
    section: str,
    layers: Layers,
    run: Mapping[str, Any],
    extra_argv: Sequence[str] = (),
    aliases: Mapping[str, Sequence[str]] | None = None,
) -> Resolved:
    """One service's config: preset < launcher defaults < recipe < ``run`` (what the launcher
    decided) < the launcher's flags < ``extra_argv`` (that service's own flags)."""
    p = layers.preset
    stack: list[tuple[str, Mapping[str, Any]]] = [
        (f"preset {p.name}", section_values(p.recipe, section, cls, p.path)),
        ("launcher default", (layers.defaults or {}).get(section, {})),
    ]
    if layers.recipe is not None:
        stack.append(recipe_layer(cls, section, layers.recipe))
    stack.append(("launcher", run))
    stack.append(("launcher flag", (layers.flags or {}).get(section, {})))
    if extra_argv:
        stack.append(("flag", flags_of(cls, extra_argv, prog=section, aliases=aliases)))
    return resolve_layers(cls, stack)


def vllm_config(layers: Layers) -> dict[str, Any]:
    """The ``vllm:`` options (and shared keys vLLM reads) of preset < recipe, as the flat
    mapping ``python -m vllm_patching.serve --config`` reads."""
    values = section_values(layers.preset.recipe, "vllm", None, layers.preset.path)
    if layers.recipe is not None:
        values = deep_merge(
            values, section_values(load_recipe(layers.recipe), "vllm", None, layers.recipe)
        )
    return values


def write_config(run_dir: Path, name: str, data: Mapping[str, Any], sources: Any = None) -> Path:
    """``<run>/config/<name>.yaml``: the flat config a service reads with ``--config``, then
    (as comments) where each non-default value came from."""
    path = run_dir / "config" / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    text = yaml.safe_dump(dict(data), sort_keys=False, default_flow_style=False, width=100)
    if sources:
        text += "# set by:\n" + "".join(f"#   {k}: {v}\n" for k, v in sorted(sources.items()))
    path.write_text(text)
    return path


def write_service_config(run_dir: Path, name: str, resolved: Resolved) -> Path:
    """:func:`write_config` of a resolved service config (secrets left out)."""
    return write_config(run_dir, name, config_file_data(resolved.config), resolved.sources)


LAUNCHER_VLLM_KEYS = (
    "model",
    "host",
    "port",
    "weight_bridge_mode",
    "single_copy",
    "bridge_config",
    "served_model_name",
)
"""vLLM options the launcher sets for every server itself (a recipe's are not used)."""


def run_model(lay: Layers, model: str | None = None) -> str:
    """The model of the run: ``model`` (``--model``), else the recipe's, else the preset's."""
    return model or str(vllm_config(lay).get("model") or lay.preset.model)


def write_vllm_config(lay: Layers, run_dir: Path) -> Path:
    """``<run>/config/vllm.yaml``: the preset's and the recipe's vLLM options."""
    values = {k: v for k, v in vllm_config(lay).items() if k not in LAUNCHER_VLLM_KEYS}
    return write_config(run_dir, "vllm", values)


def sft_config(lay: Layers, sft_dir: Path, resume: bool):
    """The SFT cold start's config: preset < recipe < the launcher's paths and flags."""
    from trainer.config import ALIASES, SftConfig

    run = {
        "model_name": lay.preset.launch.base_model,
        "save_path": str(sft_dir),
        "data_dir": str(DATA_DIR),
        "tensorboard": False,
        # the launcher measures the SFT model itself, with vLLM (much faster)
        "eval_generate": 0,
        "resume" if resume else "overwrite": True,
    }
    return service_config(SftConfig, "trainer.sft", lay, run, aliases=ALIASES)


def service_configs(
    lay: Layers,
    model: str,
    api_url: str,
    vllm_urls: list[str],
    save: Path,
    run_dir: Path,
    device: str = "cpu",
    *,
    weight_bridge_mode: str = "shared_vllm",
    single_copy: bool = False,
    env_args: str | None = None,
    trainer_args: str | None = None,
    resume: bool = False,
) -> dict[str, Resolved]:
    """The API's, the env's and the GRPO trainer's resolved configs (launch/configs.py);
    ``resume``: the trainer continues its checkpoints instead of starting over."""
    from api.config import ApiConfig
    from env_server.config import ALIASES as ENV_ALIASES
    from env_server.config import EnvConfig
    from trainer.config import ALIASES, GrpoConfig

    urls = ",".join(vllm_urls)
    api = {"port": int(api_url.rsplit(":", 1)[1]), "db_path": str(run_dir / "api.sqlite")}
    env = {
        "api_url": api_url,
        "inference_url": urls,
        "tokenizer": model,
        "data_dir": str(DATA_DIR),
        "metrics_path": str(run_dir / "env_metrics.jsonl"),
    }
    grpo = {
        "model_name": model,
        "save_path": str(save),
        "api_url": api_url,
        "weight_bridge_mode": weight_bridge_mode,
        "single_copy": single_copy,
        "inference_url": urls,
        "device": device,
        "resume" if resume else "overwrite": True,
    }
    return {
        "api": service_config(ApiConfig, "api", lay, api),
        "env": service_config(EnvConfig, "env", lay, env, shlex.split(env_args or ""), ENV_ALIASES),
        "trainer_grpo": service_config(
            GrpoConfig, "trainer.grpo", lay, grpo, shlex.split(trainer_args or ""), ALIASES
        ),
    }
