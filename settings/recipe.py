"""Recipes: one YAML file per run, a ``launch.run_config.RunConfig`` written as YAML, with
``base:`` chains and ``${VAR}`` expansion (docs/RECIPES.md). Imports no service package."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import yaml

from settings import paths

_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


class RecipeError(SystemExit):
    """A recipe, a config file or a value is wrong; the message names the file and the key."""

    def __init__(self, message: str) -> None:
        super().__init__(f"error: {message}")


def read_recipe(path: Path) -> dict[str, Any]:
    """One YAML mapping (an empty file is ``{}``), ``${VAR}`` expanded, ``base:`` kept."""
    try:
        loaded = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise RecipeError(f"cannot read {path}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise RecipeError(f"{path} is not valid YAML: {e}") from None
    if not isinstance(loaded, dict | None):
        raise RecipeError(f"{path} must hold a mapping of option: value")
    return expand_vars(loaded or {}, Path(path))


def recipe_chain(path: Path, _seen: tuple[Path, ...] = ()) -> list[tuple[Path, dict[str, Any]]]:
    """A recipe and the files of its ``base:`` chain, base first, one layer each."""
    path = Path(path)
    if path.resolve() in _seen:
        raise RecipeError(f"{path}: 'base' loops back to itself ({' -> '.join(map(str, _seen))})")
    recipe = read_recipe(path)
    base = recipe.pop("base", None)
    if base is not None and not isinstance(base, str):
        raise RecipeError(f"{path}: 'base' must be the path of another recipe")
    lower = recipe_chain(path.parent / base, (*_seen, path.resolve())) if base else []
    return [*lower, (path, recipe)]


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
        found = names.get(m.group(1), os.environ.get(m.group(1)))
        if found is None and m.group(2) is None:
            raise RecipeError(
                f"{path}: {where.rstrip('.')} uses ${{{m.group(1)}}}, which is not set "
                f"(set it, or write ${{{m.group(1)}:-default}})"
            )
        return found if found is not None else m.group(2)

    return _VAR.sub(sub, value)
