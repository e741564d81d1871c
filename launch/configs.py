"""What launch/run_all.sh hands each service: the run's ``RunConfig`` resolved with the
launcher's decisions, each service's section written as a run file to
``<run>/config/<service>.yaml`` (secrets never written; docs/RECIPES.md)."""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from functools import reduce
from pathlib import Path
from typing import Any

import yaml

from launch.run_config import RunConfig, run_layers
from settings.cli import is_secret
from settings.layers import Layer, has_path, nest, read_recipe, resolve
from settings.paths import PRESETS_DIR

SERVICE_FILES = {
    "api": "api",
    "env": "env",
    "trainer_sft": "trainer.sft",
    "trainer_grpo": "trainer.grpo",
}
"""``<run>/config/<name>.yaml`` -> the section of the run it holds (``trainer_sft`` also where
the SFT model is reused: what the run would have trained it with)."""
LAUNCHER_VLLM_KEYS = {"model", "host", "port", "weight_bridge_mode", "single_copy"}
LAUNCHER_VLLM_KEYS |= {"bridge_config", "served_model_name"}
"""vLLM options the launcher sets for every server itself (the run file's are not used)."""


SAME_SETTING = {
    ("trainer", "grpo", key): ("trainer", "grpo", "weights", "type")
    for key in ("weight_bridge_mode", "single_copy")
}
"""Keys the launcher owns in their old spelling -> the one setting they make (the weight
transport, trainer/weights_config.py): a flag or variable that gives it either way and does
not get it is told so, once."""


def preset_model(cfg: RunConfig) -> str:
    """The model the preset names: what its SFT cold start writes (``build_embedded``)."""
    return str(read_recipe(PRESETS_DIR / f"{cfg.preset}.yaml")["model"])


def launcher_values(
    cfg: RunConfig, api_url: str, vllm_urls: Sequence[str], run_dir: Path, device: str = "cpu"
) -> tuple[dict[str, Any], dict[str, Any]]:
    """What the launcher decides for the run, by section: ``(defaults, owned)``, the run's
    defaults (under its file) and the fields that wire the run (over every layer)."""
    urls, sft_dir, base = ",".join(vllm_urls), Path(preset_model(cfg)), cfg.launch.base_model
    # the launcher measures the SFT model itself, with vLLM: no generation in the SFT's eval
    sft = dict(model_name=base, tensorboard=False, eval_generate=0)
    lora = {"lora_r": 8} if cfg.weight_bridge_mode == "lora_only" else {}
    defaults = {"trainer": {"sft": sft, "grpo": lora}}
    api = dict(port=int(api_url.rsplit(":", 1)[1]), db_path=str(run_dir / "api.sqlite"))
    env = dict(api_url=api_url, inference_url=urls, tokenizer=cfg.model)
    env["metrics_path"] = str(run_dir / "env_metrics.jsonl")
    if cfg.reproducible:  # the trainer's batch, in the env's groups (RunConfig checks it)
        env["lockstep_groups"] = cfg.trainer.grpo.batch_size // cfg.env.group_size
    grpo = dict(model_name=cfg.model, save_path=str(run_dir / "trainer"), api_url=api_url)
    grpo |= dict(weight_bridge_mode=cfg.weight_bridge_mode, single_copy=cfg.single_copy)
    grpo |= {"inference_url": list(vllm_urls), "device": device}
    grpo["resume" if cfg.launch.resume else "overwrite"] = True
    sft_resume = (sft_dir / "checkpoints").is_dir()  # an interrupted SFT continues
    own_sft = {"save_path": str(sft_dir), "resume" if sft_resume else "overwrite": True}
    owned = {"api": api, "env": env, "trainer": {"grpo": grpo, "sft": own_sft}}
    if cfg.verifiers is not None:  # verifiers' renderer samples from the first server
        owned["verifiers"] = dict(api_url=api_url, inference_url=vllm_urls[0])
        owned["verifiers"]["metrics_path"] = str(run_dir / "verifiers_metrics.jsonl")
    return defaults, owned


def resolve_for_run(
    argv: Sequence[str],
    api_url: str,
    vllm_urls: Sequence[str],
    run_dir: Path,
    device: str = "cpu",
    environ: Mapping[str, str] | None = None,
    warn: bool = True,
) -> RunConfig:
    """The run's config: the launcher's defaults < the run's layers < the fields it owns; a
    flag or variable that the launcher overrides gets a WARNING (``warn``: the run's own
    resolution, not the one its resume hint makes)."""
    layers = run_layers(argv, environ)
    asked = resolve(RunConfig, layers)  # what the launcher's decisions depend on
    return launcher_config(layers, asked, api_url, vllm_urls, run_dir, device, warn)


def launcher_config(
    layers: Sequence[Layer],
    first: RunConfig,
    api_url: str,
    vllm_urls: Sequence[str],
    run_dir: Path,
    device: str = "cpu",
    warn: bool = True,
) -> RunConfig:
    """:func:`resolve_for_run` of the run's ``layers``, which resolve to ``first`` (the run the
    user asked for)."""
    defaults, owned = launcher_values(first, api_url, vllm_urls, run_dir, device)
    cfg = resolve(RunConfig, [("launcher", defaults), *layers, ("launcher", owned)])
    said: set[tuple[str, ...]] = set()
    for path in _paths(owned) if warn else []:
        shown = SAME_SETTING.get(path, path)  # the key the check compares and names
        spellings = {path, shown} | {old for old, new in SAME_SETTING.items() if new == shown}
        given = [n for n, layer in layers[-2:] if any(has_path(layer, p) for p in spellings)]
        asked, value = (reduce(getattr, shown, c) for c in (first, cfg))
        if given and asked != value and shown not in said:
            said.add(shown)
            why = "it wires the run; set it with the launcher's own options (--api-port, ...)"
            warn = f"{'.'.join(shown)} = {asked!r} ({given[-1]}) is replaced by {value!r}: {why}"
            print(f"[run_all] WARNING: {warn}", file=sys.stderr, flush=True)
    return cfg


def _paths(values: Mapping[str, Any], prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """The paths of every value in nested ``values``: ``[("api", "port"), ...]``."""
    return [
        p
        for k, v in values.items()
        for p in (_paths(v, (*prefix, k)) if isinstance(v, Mapping) else [(*prefix, k)])
    ]


def write_config(run_dir: Path, name: str, data: Mapping[str, Any]) -> Path:
    """``<run>/config/<name>.yaml``: a run file holding ``data``."""
    path = run_dir / "config" / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(dict(data), sort_keys=False, width=100))
    return path


def write_service_config(run_dir: Path, name: str, cfg: RunConfig, section: str) -> Path:
    """:func:`write_config` of the run's ``section`` (secrets left out)."""
    data = reduce(getattr, section.split("."), cfg).model_dump(mode="json")
    data = {k: v for k, v in data.items() if not is_secret(k)}
    return write_config(run_dir, name, nest(section, data))


def vllm_values(cfg: RunConfig) -> dict[str, Any]:
    """The run's ``vllm:`` options the servers read from their file (not the launcher's)."""
    return cfg.vllm.model_dump(mode="json", exclude_none=True, exclude=LAUNCHER_VLLM_KEYS)


def write_service_configs(run_dir: Path, cfg: RunConfig) -> dict[str, Path]:
    """Every service's file: ``api``, ``env``, ``trainer_sft``, ``trainer_grpo`` and ``vllm`` (and
    ``verifiers`` when the run has that env)."""
    files = {n: write_service_config(run_dir, n, cfg, s) for n, s in SERVICE_FILES.items()}
    if cfg.verifiers is not None:
        files["verifiers"] = write_service_config(run_dir, "verifiers", cfg, "verifiers")
    return files | {"vllm": write_config(run_dir, "vllm", {"vllm": vllm_values(cfg)})}
