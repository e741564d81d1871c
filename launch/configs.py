"""What launch/run_all.sh hands each service: the run's ``RunConfig`` resolved with the
launcher's decisions, each service's section written to ``<run>/config/<service>.yaml``
(secrets never written; docs/RECIPES.md)."""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from functools import reduce
from pathlib import Path
from typing import Any

import yaml

from launch.run_config import RunConfig, run_layers
from settings.cli import config_file_data
from settings.layers import Resolved, resolve
from settings.paths import PRESETS_DIR
from settings.recipe import read_recipe

SERVICE_FILES = {"api": "api", "env": "env", "trainer_grpo": "trainer.grpo"}
"""``<run>/config/<name>.yaml`` -> the section of the run it holds."""
LAUNCHER_VLLM_KEYS = {"model", "host", "port", "weight_bridge_mode", "single_copy"}
LAUNCHER_VLLM_KEYS |= {"bridge_config", "served_model_name"}
"""vLLM options the launcher sets for every server itself (the run file's are not used)."""


def preset_model(cfg: RunConfig) -> str:
    """The model the preset names: what its SFT cold start writes (``build_embedded``)."""
    return str(read_recipe(PRESETS_DIR / f"{cfg.preset}.yaml")["model"])


def launcher_values(
    cfg: RunConfig, api_url: str, vllm_urls: Sequence[str], run_dir: Path, device: str = "cpu"
) -> tuple[dict[str, Any], dict[str, Any]]:
    """What the launcher decides for the run, by section: ``(defaults, owned)``, the run's
    defaults (under its file) and the fields that wire the run (over every layer)."""
    urls = ",".join(vllm_urls)
    sft_dir = Path(preset_model(cfg))
    sft_resume = (sft_dir / "checkpoints").is_dir()  # an interrupted SFT continues
    defaults: dict[str, Any] = {
        "trainer": {
            "sft": {
                "model_name": cfg.launch.base_model,
                "tensorboard": False,
                "eval_generate": 0,  # the launcher measures the SFT model itself, with vLLM
            },
            "grpo": {"lora_r": 8} if cfg.weight_bridge_mode == "lora_only" else {},
        }
    }
    owned = {
        "api": {"port": int(api_url.rsplit(":", 1)[1]), "db_path": str(run_dir / "api.sqlite")},
        "env": {
            "api_url": api_url,
            "inference_url": urls,
            "tokenizer": cfg.model,
            "metrics_path": str(run_dir / "env_metrics.jsonl"),
        },
        "trainer": {
            "grpo": {
                "model_name": cfg.model,
                "save_path": str(run_dir / "trainer"),
                "api_url": api_url,
                "weight_bridge_mode": cfg.weight_bridge_mode,
                "single_copy": cfg.single_copy,
                "inference_url": urls,
                "device": device,
                "resume" if cfg.launch.resume else "overwrite": True,
            },
            "sft": {"save_path": str(sft_dir), "resume" if sft_resume else "overwrite": True},
        },
    }
    return defaults, owned


def resolve_for_run(
    argv: Sequence[str],
    api_url: str,
    vllm_urls: Sequence[str],
    run_dir: Path,
    device: str = "cpu",
    environ: Mapping[str, str] | None = None,
) -> Resolved:
    """The run's config: the launcher's defaults < the run's layers < the fields it owns; a
    flag or variable that the launcher overrides gets a WARNING."""
    layers = run_layers(argv, environ)
    first = resolve(RunConfig, layers)  # what the launcher's decisions depend on
    defaults, owned = launcher_values(first.config, api_url, vllm_urls, run_dir, device)
    resolved = resolve(RunConfig, [("launcher", defaults), *layers, ("launcher", owned)])
    for dotted, source in first.sources.items():
        if source not in ("flag", "environment") or resolved.sources.get(dotted) != "launcher":
            continue
        asked, value = (reduce(getattr, dotted.split("."), r.config) for r in (first, resolved))
        if asked != value:
            print(
                f"[run_all] WARNING: {dotted} = {asked!r} ({source}) is replaced by the "
                f"launcher's {value!r}: it wires the run (docs/RECIPES.md); set it with the "
                "launcher's own options (--api-port, --vllm-port, --run-dir, --model, ...)",
                file=sys.stderr,
                flush=True,
            )
    return resolved


def write_config(
    run_dir: Path, name: str, data: Mapping[str, Any], sources: Mapping[str, str] | None = None
) -> Path:
    """``<run>/config/<name>.yaml``, then (as comments) where each value came from."""
    path = run_dir / "config" / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    text = yaml.safe_dump(dict(data), sort_keys=False, default_flow_style=False, width=100)
    if sources:
        text += "# set by:\n" + "".join(f"#   {k}: {v}\n" for k, v in sorted(sources.items()))
    path.write_text(text)
    return path


def write_service_config(run_dir: Path, name: str, resolved: Resolved) -> Path:
    """:func:`write_config` of one resolved section (secrets left out)."""
    return write_config(run_dir, name, config_file_data(resolved.config), resolved.sources)


def vllm_values(cfg: RunConfig) -> dict[str, Any]:
    """The run's ``vllm:`` options the servers read from their file (not the launcher's)."""
    return cfg.vllm.model_dump(mode="json", exclude_none=True, exclude=LAUNCHER_VLLM_KEYS)


def write_service_configs(run_dir: Path, resolved: Resolved) -> dict[str, Path]:
    """Every service's file: ``api``, ``env``, ``trainer_grpo`` and ``vllm``."""
    files = {
        name: write_service_config(run_dir, name, resolved.section(section))
        for name, section in SERVICE_FILES.items()
    }
    files["vllm"] = write_config(run_dir, "vllm", vllm_values(resolved.config))
    return files
