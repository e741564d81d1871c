"""Recipes: one YAML file that configures every service of a run (docs/RECIPES.md).

A recipe is a ``launch.run_config.RunConfig`` written as YAML: shortcut top-level keys
(``model``, ``seed``, ``output_dir``, ``data``, ...; ``settings.layers.SHORTCUTS``) and one
section per service (``api``, ``env``, ``trainer`` with ``sft:``/``grpo:``, ``vllm``); a
preset of ``launch/run_all.sh`` is a recipe with a ``launch:`` section too. ``base: other.yaml`` starts
from another recipe, one layer under it; ``${VAR}`` / ``${VAR:-default}`` expand in every string.

This module imports neither torch nor any service package.
"""

from __future__ import annotations

import os
import re
import types
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

SECTIONS = ("api", "env", "trainer", "vllm")
"""Per-service sections of a recipe (``trainer`` holds ``sft:`` and ``grpo:``)."""
TOP_KEYS = (
    "name",
    "description",
    "base",
    "launch",
    "model",
    "seed",
    "output_dir",
    "data",
    "logging",
    "rewards",
    "weight_bridge_mode",
    "single_copy",
)
"""Top-level keys a recipe may hold besides the sections (``launch.run_config.RunConfig``)."""
GROUPS = {"data": ("dir", "num_sessions"), "logging": ("wandb_project", "tensorboard", "log_level")}
"""Top-level keys that are mappings of shortcuts (``data: {dir: ..., num_sessions: ...}``)."""


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


def read_recipe(path: Path) -> dict[str, Any]:
    """One recipe file, its top-level keys checked (shared keys, sections, doc keys,
    ``launch``, ``base``) and ``${VAR}`` expanded in its strings; ``base:`` is not followed."""
    path = Path(path)
    recipe = read_yaml(path)
    allowed = set(TOP_KEYS) | set(SECTIONS)
    for key, value in recipe.items():
        if key not in allowed:
            raise RecipeError(
                f"{path}: unknown top-level key {key!r} (expected one of {sorted(allowed)})"
            )
        if key in GROUPS:
            _check_group(path, key, value)
        if key in (*SECTIONS, "launch") and value is not None and not isinstance(value, dict):
            raise RecipeError(f"{path}: section {key!r} must be a mapping")
    return expand_vars(recipe, path)


def recipe_chain(path: Path, _seen: tuple[Path, ...] = ()) -> list[tuple[Path, dict[str, Any]]]:
    """A recipe and the files its ``base:`` chain names, base first, each read by
    :func:`read_recipe` (without its ``base`` key): one layer each (``settings.layers``)."""
    path = Path(path)
    if path.resolve() in _seen:
        raise RecipeError(f"{path}: 'base' loops back to itself ({' -> '.join(map(str, _seen))})")
    recipe = read_recipe(path)
    base = recipe.pop("base", None)
    if base is None:
        return [(path, recipe)]
    if not isinstance(base, str):
        raise RecipeError(f"{path}: 'base' must be the path of another recipe")
    return [*recipe_chain(path.parent / base, (*_seen, path.resolve())), (path, recipe)]


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
    for sub in value:
        if sub not in GROUPS[key]:
            raise RecipeError(
                f"{path}: unknown key '{key}.{sub}' (expected one of {sorted(GROUPS[key])})"
            )
