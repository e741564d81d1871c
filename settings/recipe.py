"""Recipes: one YAML file per run, a ``launch.run_config.RunConfig`` written as YAML, with
``base:`` chains and ``${VAR}`` expansion (docs/RECIPES.md). Imports neither torch nor any
service package."""

from __future__ import annotations

import os
import re
import types
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from settings import paths

SECTIONS = ("api", "env", "trainer", "vllm")
TOP_KEYS = ("name", "description", "base", "launch", "model", "seed", "output_dir", "data")
TOP_KEYS += ("logging", "rewards", "weight_bridge_mode", "single_copy")
"""A recipe's top-level keys besides the sections."""
GROUPS = {"data": ("dir", "num_sessions"), "logging": ("wandb_project", "tensorboard", "log_level")}
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


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
    try:
        loaded = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise RecipeError(f"cannot read {path}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise RecipeError(f"{path} is not valid YAML: {e}") from None
    if not isinstance(loaded, dict | None):
        raise RecipeError(f"{path} must hold a mapping of option: value")
    return loaded or {}


def read_recipe(path: Path) -> dict[str, Any]:
    """One recipe file, its top-level keys checked and ``${VAR}`` expanded (``base:`` kept)."""
    recipe = read_yaml(path)
    allowed = sorted({*TOP_KEYS, *SECTIONS})
    for key, value in recipe.items():
        if key not in allowed:
            raise RecipeError(f"{path}: unknown top-level key {key!r} (expected one of {allowed})")
        must_map = key in GROUPS or key in (*SECTIONS, "launch") and value is not None
        if must_map and not isinstance(value, dict):
            raise RecipeError(f"{path}: section {key!r} must be a mapping")
        for sub in value if key in GROUPS else ():
            if sub not in GROUPS[key]:
                expected = sorted(GROUPS[key])
                raise RecipeError(f"{path}: unknown key '{key}.{sub}' (expected one of {expected})")
    return expand_vars(recipe, Path(path))


def recipe_chain(path: Path, _seen: tuple[Path, ...] = ()) -> list[tuple[Path, dict[str, Any]]]:
    """A recipe and the files of its ``base:`` chain, base first, one layer each."""
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


def expand_vars(value: Any, path: Path, where: str = "") -> Any:
    """``${NAME}`` / ``${NAME:-default}`` in every string of ``value``: the project's
    locations (``REPO_ROOT``, ``ARTIFACTS``, ``RUNS_DIR``), else the environment."""
    if isinstance(value, dict):
        return {k: expand_vars(v, path, f"{where}{k}.") for k, v in value.items()}
    if isinstance(value, list):
        return [expand_vars(v, path, where) for v in value]
    if not isinstance(value, str) or "${" not in value:
        return value
    names = {n: str(getattr(paths, n)) for n in ("REPO_ROOT", "ARTIFACTS", "RUNS_DIR")}

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
