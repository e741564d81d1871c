"""Recipes: one YAML file that configures every service of a run (docs/RECIPES.md).

A recipe holds shared top-level keys (``model``, ``seed``, ``output_dir``, ``data``, ...),
mapped onto each service's fields by :data:`SHARED`, and one section per service (``api``,
``env``, ``trainer`` with ``sft:``/``grpo:`` subsections, ``vllm``); a preset of
``launch/run_all.sh`` is a recipe with a ``launch:`` section too. ``base: other.yaml`` starts
from another recipe; ``${VAR}`` / ``${VAR:-default}`` expand in every string.

This module imports neither torch nor any service package.
"""

from __future__ import annotations

import os
import re
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

SECTIONS = ("api", "env", "trainer", "vllm")
"""Per-service sections of a recipe. ``trainer`` holds options of both commands plus the
``sft:`` and ``grpo:`` subsections; ``vllm`` holds vLLM arguments and the bridge options."""
LAUNCH_KEY = "launch"
"""A preset's launcher-only settings (``launch.presets.LaunchSettings``); read by no service."""
TRAINER_COMMANDS = ("sft", "grpo")
DOC_KEYS = ("name", "description")
"""Top-level keys for humans; read by no service."""
BASE_KEY = "base"
"""``base: other.yaml`` (relative to the recipe): start from that recipe, then apply this one
(mappings merge key by key; ``rewards`` is replaced whole, so an ablation lists what it keeps)."""

SHARED: dict[str, dict[str, str]] = {
    "model": {"trainer": "model_name", "env": "tokenizer", "vllm": "model"},
    "seed": {"trainer": "seed", "env": "seed", "vllm": "seed"},
    "output_dir": {
        "trainer": "save_path",
        "api": "db_path={}/api.sqlite",
        "env": "metrics_path={}/env_metrics.jsonl",
        "vllm": "bridge_config={}/vllm_bridge_config.json",
    },
    "data.dir": {"trainer": "data_dir", "env": "data_dir"},
    "data.num_sessions": {"trainer": "num_sessions", "env": "num_sessions"},
    "rewards": {"env": "rewards"},
    "weight_bridge_mode": {"trainer": "weight_bridge_mode", "vllm": "weight_bridge_mode"},
    "single_copy": {"trainer": "single_copy", "vllm": "single_copy"},
    "logging.wandb_project": {"trainer": "wandb_project"},
    "logging.tensorboard": {"trainer": "tensorboard"},
    "logging.log_level": {"api": "log_level"},
}
"""Top-level recipe keys and the field each service reads them into (``field={}/file``: the
value is a directory and the field gets a file inside it). A key goes into every service
config that has the field; the service's own section wins over it."""
SHARED_GROUPS = ("data", "logging")
"""Top-level keys that are mappings of shared keys (``data: {dir: ..., num_sessions: ...}``)."""


class RecipeError(SystemExit):
    """A recipe, a config file or a value is wrong; the message names the file and the key."""

    def __init__(self, message: str) -> None:
        super().__init__(f"error: {message}")


def unwrap(annotation: Any) -> tuple[Any, bool]:
    """(annotation without ``None``, optional?)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        optional = len(args) < len(typing.get_args(annotation))
        return (args[0] if len(args) == 1 else annotation), optional
    return annotation, False


def model_type(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model of a (possibly optional) nested-model field, else None."""
    inner, _ = unwrap(annotation)
    return inner if isinstance(inner, type) and issubclass(inner, BaseModel) else None


def read_yaml(path: Path) -> dict[str, Any]:
    """A YAML mapping (an empty file is ``{}``); anything else is a clear error."""
    path = Path(path)
    try:
        loaded = yaml.safe_load(path.read_text())
    except OSError as e:
        raise RecipeError(f"cannot read {path}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise RecipeError(f"{path} is not valid YAML: {e}") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise RecipeError(f"{path} must hold a mapping of option: value")
    return loaded


def load_recipe(path: Path, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Read a recipe (following ``base:``), expand ``${VAR}`` in its strings, check its
    top-level keys (shared keys, sections, doc keys, ``launch``)."""
    path = Path(path)
    if path.resolve() in _seen:
        raise RecipeError(f"{path}: 'base' loops back to itself ({' -> '.join(map(str, _seen))})")
    recipe = read_yaml(path)
    allowed = {k.split(".")[0] for k in SHARED} | set(SECTIONS) | set(DOC_KEYS)
    allowed |= {BASE_KEY, LAUNCH_KEY}
    for key, value in recipe.items():
        if key not in allowed:
            raise RecipeError(
                f"{path}: unknown top-level key {key!r} (expected one of {sorted(allowed)})"
            )
        if key in SHARED_GROUPS:
            _check_group(path, key, value)
        if key in (*SECTIONS, LAUNCH_KEY) and value is not None and not isinstance(value, dict):
            raise RecipeError(f"{path}: section {key!r} must be a mapping")
    recipe = expand_vars(recipe, path)
    base = recipe.pop(BASE_KEY, None)
    if base is None:
        return recipe
    if not isinstance(base, str):
        raise RecipeError(f"{path}: 'base' must be the path of another recipe")
    parent = load_recipe(path.parent / base, (*_seen, path.resolve()))
    return deep_merge(parent, recipe)


def deep_merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """``over`` onto ``base``: mappings merge key by key, ``rewards`` and the rest replace."""
    out = dict(base)
    for key, value in over.items():
        if key != "rewards" and isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def recipe_variables() -> dict[str, str]:
    """Variables a recipe may use besides the environment (they win over it): the project's
    default locations, which already honour ``$SHOP_R1_ARTIFACTS``."""
    from settings import paths

    return {
        "REPO_ROOT": str(paths.REPO_ROOT),
        "ARTIFACTS": str(paths.ARTIFACTS),
        "RUNS_DIR": str(paths.RUNS_DIR),
    }


def expand_vars(value: Any, path: Path, where: str = "") -> Any:
    """``${NAME}`` / ``${NAME:-default}`` in every string of ``value``; an unset variable
    without a default is an error naming the key and the file."""
    if isinstance(value, dict):
        return {k: expand_vars(v, path, f"{where}{k}.") for k, v in value.items()}
    if isinstance(value, list):
        return [expand_vars(v, path, where) for v in value]
    if not isinstance(value, str) or "${" not in value:
        return value
    names = recipe_variables()

    def sub(m: re.Match[str]) -> str:
        name, default = m.group(1), m.group(2)
        found = names.get(name, os.environ.get(name))
        if found is None and default is None:
            raise RecipeError(
                f"{path}: {where.rstrip('.')} uses ${{{name}}}, which is not set "
                f"(set it, or write ${{{name}:-default}})"
            )
        return found if found is not None else default

    return _VAR.sub(sub, value)


def _check_group(path: Path, key: str, value: Any) -> None:
    if not isinstance(value, dict):
        raise RecipeError(f"{path}: {key!r} must be a mapping")
    known = sorted(k.split(".", 1)[1] for k in SHARED if k.startswith(key + "."))
    for sub in value:
        if sub not in known:
            raise RecipeError(f"{path}: unknown key '{key}.{sub}' (expected one of {known})")


def _shared_items(recipe: Mapping[str, Any]) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in recipe.items():
        if key in SHARED_GROUPS:
            flat |= {f"{key}.{k}": v for k, v in value.items()}
        elif key in SHARED:
            flat[key] = value
    return flat


def section_values(
    recipe: Mapping[str, Any], section: str, cls: type[BaseModel] | None, path: Path
) -> dict[str, Any]:
    """What service ``section`` (``api``, ``env``, ``trainer.sft``, ``trainer.grpo``,
    ``vllm``) reads from a recipe: the shared keys mapped onto its fields, then its section.

    With ``cls`` the keys are checked against its fields (unknown key: error naming the key
    and the file); without (``vllm``) they are returned as written.
    """
    top, _, command = section.partition(".")
    fields = set(cls.model_fields) if cls is not None else None
    values: dict[str, Any] = {}
    for key, value in _shared_items(recipe).items():
        target = SHARED[key].get(top)
        if target is None:
            continue
        name, _, template = target.partition("=")
        if fields is not None and name not in fields:
            continue
        values[name] = template.format(value) if template and value is not None else value
    body = dict(recipe.get(top) or {})
    if top == "trainer":
        subs = {c: body.pop(c, None) or {} for c in TRAINER_COMMANDS}
        for c, sub in subs.items():
            if not isinstance(sub, dict):
                raise RecipeError(f"{path}: section 'trainer.{c}' must be a mapping")
        layers = [("trainer", body), (section, subs.get(command, {}))]
    else:
        layers = [(top, body)]
    for where, layer in layers:
        layer = snake_keys(layer)
        if cls is not None:
            check_keys(cls, layer, f"{path}: {where}")
        values |= layer
    return values


def snake_keys(d: Mapping[str, Any]) -> dict[str, Any]:
    """``{"max-tokens": 1}`` -> ``{"max_tokens": 1}``."""
    return {str(k).replace("-", "_"): v for k, v in d.items()}


def check_keys(cls: type[BaseModel], values: Mapping[str, Any], where: str) -> None:
    """Every key must be a field of ``cls`` (nested models recursively)."""
    for key, value in values.items():
        info = cls.model_fields.get(key)
        if info is None:
            raise RecipeError(
                f"{where}: unknown key {key!r} for {cls.__name__} "
                f"(valid keys: {', '.join(sorted(cls.model_fields))})"
            )
        sub = model_type(info.annotation)
        if sub is not None and isinstance(value, dict):
            check_keys(sub, snake_keys(value), f"{where}.{key}")
