"""A run's config, ``launch.run_config.RunConfig``, from layers, lowest first (docs/RECIPES.md):
field defaults < YAML run files (``base:`` chains, ``${VAR}``) < environment < command line.
Imports no service package: what is particular to a service's fields its config model
declares, and :func:`resolve` reads it from the model it validates (:class:`Rules`): old keys
(``old_keys``, ``fold_old_keys``), the run-level shortcuts that fill its fields
(``shortcuts``: ``model`` fills ``trainer.grpo.model_name`` and ``env.tokenizer``; a shortcut
fills inside its own layer, where that layer does not set the field itself), keys of which a
layer gives one (``one_of``) and mappings a layer replaces whole (``whole``)."""

from __future__ import annotations

import copy
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, TypeVar, get_args

import yaml
from pydantic import BaseModel, ValidationError
from pydantic_settings import EnvSettingsSource

from settings import paths

M = TypeVar("M", bound=BaseModel)
Layer = tuple[str, Mapping[str, Any]]
RUN_KEYS = {"name", "description", "preset", "recipe", "env_args", "trainer_args"}
RUN_KEYS |= {"model", "seed", "weight_bridge_mode", "single_copy", "training_steps", "sft_steps"}
RUN_KEYS |= {"num_sessions", "episode", "keep_constant_groups", "reproducible"}
RUN_KEYS |= {"base", "launch", "api", "env", "trainer", "vllm", "verifiers"}
"""A run file's top-level keys (``RunConfig``'s fields and ``base``): what a service checks a
file against without importing the other services."""
Path_ = tuple[str, ...]


@dataclass(frozen=True)
class Negated:
    """A shortcut that fills a boolean field with its negation (``shortcuts``:
    ``{"keep_constant_groups": Negated("drop_constant_groups")}``)."""

    field: str


@dataclass(frozen=True)
class Rules:
    """What a config model and the models in its fields declare about combining layers,
    each at its path from the root of the run (:func:`rules`)."""

    fills: tuple[tuple[str, Path_, bool], ...] = ()
    """(run-level shortcut, the field it fills, negated)."""
    one_of: tuple[tuple[Path_, frozenset[str]], ...] = ()
    """(path, keys there of which a layer gives one: giving one drops the lower layers'
    others; ``env``'s three ways to give the reward)."""
    whole: frozenset[Path_] = frozenset()
    """Mappings a layer replaces whole rather than key by key (``env.rewards``)."""


@cache
def rules(cls: type[BaseModel], at: Path_ = ()) -> Rules:
    """The :class:`Rules` that ``cls`` (placed at ``at``) and the models in its fields
    declare as ``shortcuts``, ``one_of`` and ``whole`` (ClassVars)."""
    fills = []
    for key, fill in getattr(cls, "shortcuts", {}).items():
        name = fill.field if isinstance(fill, Negated) else fill
        fills.append((key, (*at, *name.split(".")), isinstance(fill, Negated)))
    one_of = [(at, frozenset(group)) for group in getattr(cls, "one_of", ())]
    whole = {(*at, key) for key in getattr(cls, "whole", ())}
    for name, field in cls.model_fields.items():
        for sub in (field.annotation, *get_args(field.annotation)):
            if isinstance(sub, type) and issubclass(sub, BaseModel):
                inner = rules(sub, (*at, name))
                fills += inner.fills
                one_of += inner.one_of
                whole |= inner.whole
    return Rules(tuple(fills), tuple(one_of), frozenset(whole))


_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


class RecipeError(SystemExit):
    """A recipe, a config file or a value is wrong; the message names the file and the key."""

    def __init__(self, message: str) -> None:
        super().__init__(f"error: {message}")


def env_default(name: str, default: Any = None) -> Callable[[], Any]:
    """A field's ``default_factory``: environment variable ``name`` when set, else ``default``."""
    return lambda: os.environ.get(name) or default


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


def expand_vars(value: Any, path: Path, where: str = "") -> Any:
    """``${NAME}`` / ``${NAME:-default}`` in every string of ``value``: the project's
    locations (``REPO_ROOT``, ``ARTIFACTS``, ``RUNS_DIR``), else the environment; keys
    ``kebab-case`` -> ``snake_case`` (reward entries kept as written)."""
    if isinstance(value, dict):
        snake = "rewards." not in f".{where}"
        value = {str(k).replace("-", "_") if snake else k: v for k, v in value.items()}
        return {k: expand_vars(v, path, f"{where}{k}.") for k, v in value.items()}
    if isinstance(value, list):
        return [expand_vars(v, path, where) for v in value]

    def sub(m: re.Match[str]) -> str:
        name, default = m.group(1), m.group(2)
        if name in ("REPO_ROOT", "ARTIFACTS", "RUNS_DIR"):
            return str(getattr(paths, name))
        if (found := os.environ.get(name, default)) is None:
            raise RecipeError(
                f"{path}: {where[:-1]} uses ${{{name}}}, which is not set "
                f"(set it, or write ${{{name}:-default}})"
            )
        return found

    return _VAR.sub(sub, value) if isinstance(value, str) else value


def recipe_chain(path: Path, _seen: tuple[Path, ...] = ()) -> list[tuple[Path, dict[str, Any]]]:
    """A recipe and the files of its ``base:`` chain, base first, one layer each."""
    path = Path(path)
    if path.resolve() in _seen:
        raise RecipeError(f"{path}: 'base' loops back to itself ({' -> '.join(map(str, _seen))})")
    recipe = read_recipe(path)
    if not isinstance(base := recipe.pop("base", None), str | None):
        raise RecipeError(f"{path}: 'base' must be the path of another recipe")
    lower = recipe_chain(path.parent / base, (*_seen, path.resolve())) if base else []
    return [*lower, (path, recipe)]


def file_layers(path: Path) -> list[Layer]:
    """A run file, one layer per file of its ``base:`` chain."""
    layers: list[Layer] = []
    for file, data in recipe_chain(path):
        if unknown := sorted(data.keys() - RUN_KEYS):
            raise RecipeError(f"{file}: unknown top-level key {unknown[0]!r} of {sorted(RUN_KEYS)}")
        layers.append((f"file {file}", expand(data)))
    return layers


def expand(layer: Mapping[str, Any]) -> dict[str, Any]:
    """``layer`` with its ``trainer:`` keys beside ``sft:``/``grpo:`` moved into both."""
    out = copy.deepcopy(dict(layer))
    if isinstance(trainer := out.get("trainer"), dict):
        common = {k: v for k, v in trainer.items() if k not in ("sft", "grpo")}
        sub = {c: trainer.get(c) or {} for c in ("sft", "grpo")}
        out["trainer"] = {c: {**common, **v} if isinstance(v, dict) else v for c, v in sub.items()}
    return out


def filled(layer: Mapping[str, Any], fills: Sequence[tuple[str, Path_, bool]]) -> dict[str, Any]:
    """``layer`` over what its run-level shortcuts fill (``Rules.fills``)."""
    fill: dict[str, Any] = {}
    for key, path, negate in fills:
        if key in layer:
            merge(fill, nest(".".join(path), not layer[key] if negate else layer[key]))
    return merge(fill, layer)


def nest(section: str, values: Any) -> Any:
    """``values`` placed at dotted ``section`` of a run (``trainer.grpo``)."""
    for part in reversed(section.split(".") if section else []):
        values = {part: values}
    return values


def merge(
    base: dict[str, Any], over: Mapping[str, Any], how: Rules | None = None, at: Path_ = ()
) -> dict[str, Any]:
    """``over`` onto ``base``, mappings key by key, save what ``how`` says (``one_of``,
    ``whole``); ``at``: where ``base`` lies in the run."""
    for path, group in how.one_of if how else ():
        if path == at and group & over.keys():
            for key in group - over.keys():
                base.pop(key, None)
    for key, value in over.items():
        whole = how is not None and (*at, key) in how.whole
        if isinstance(value, Mapping) and isinstance(base.get(key), dict) and not whole:
            merge(base[key], value, how, (*at, key))
        else:
            base[key] = copy.deepcopy(value)
    return base


Moves = dict[tuple[str, ...], tuple[str, ...]]


@cache
def moved_keys(cls: type[BaseModel]) -> Moves:
    """The old key paths of ``cls`` and of the models in its fields -> their new paths. A
    model declares its own as ``old_keys: ClassVar[dict[str, str]]`` (old key -> new dotted
    path, relative to it): a file, a variable or a flag may still use the old key."""
    out = {(old,): tuple(new.split(".")) for old, new in getattr(cls, "old_keys", {}).items()}
    for name, field in cls.model_fields.items():
        for sub in (field.annotation, *get_args(field.annotation)):
            if isinstance(sub, type) and issubclass(sub, BaseModel):
                out |= {(name, *o): (name, *n) for o, n in moved_keys(sub).items()}
    return out


Fold = Callable[[Sequence[Layer], Sequence[str]], list[Layer]]


@cache
def layer_folds(cls: type[BaseModel]) -> tuple[tuple[tuple[str, ...], Fold], ...]:
    """Where ``cls`` and the models in its fields declare ``fold_old_keys`` (``(layers,
    path) -> layers``): old keys that together become one new setting, rewritten layer by
    layer in order, each completed by the layers below (``trainer.weights_config``)."""
    out: list[tuple[tuple[str, ...], Fold]] = []
    if (fold := getattr(cls, "fold_old_keys", None)) is not None:
        out.append(((), fold))
    for name, field in cls.model_fields.items():
        for sub in (field.annotation, *get_args(field.annotation)):
            if isinstance(sub, type) and issubclass(sub, BaseModel):
                out += [((name, *path), f) for path, f in layer_folds(sub)]
    return tuple(out)


def renamed(layer: Mapping[str, Any], moves: Moves, label: str) -> dict[str, Any]:
    """One layer with its old keys (``moves``) at their new paths; one setting given both
    ways in one layer is refused, naming both keys."""
    out = copy.deepcopy(dict(layer))
    for old, new in moves.items():
        parent: Any = out
        for part in old[:-1]:
            parent = parent.get(part) if isinstance(parent, Mapping) else None
        if not isinstance(parent, dict) or old[-1] not in parent:
            continue
        value = parent.pop(old[-1])
        if has_path(out, new):
            names = f"{'.'.join(old)} and {'.'.join(new)}"
            raise RecipeError(f"{label}: {names} are one setting: give it once ({'.'.join(new)})")
        merge(out, nest(".".join(new), value))
    return out


def env_layer(
    cls: type[BaseModel], section: str = "", environ: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """The ``SHOP_R1_<SECTION>__<FIELD>`` variables (pydantic-settings' convention) of ``cls``,
    the run's ``section``."""
    prefix = "SHOP_R1_" + "".join(f"{p.upper()}__" for p in section.split(".") if p)
    source = EnvSettingsSource(cls, env_prefix=prefix, env_nested_delimiter="__")
    if environ is not None:
        source.env_vars = {k.lower(): v for k, v in environ.items()}
    values = source()
    for old in moved_keys(cls):  # a variable of an old key still sets it (``renamed``)
        raw = source.env_vars.get(f"{prefix}{'__'.join(old)}".lower())
        if raw is not None and not has_path(values, old):
            merge(values, nest(".".join(old), raw))
    return nest(section, values) if values else {}


def has_path(layer: Any, path: Sequence[Any]) -> bool:
    """Whether ``layer`` sets a value at ``path`` (``("env", "seed")``)."""
    for part in path:
        if not isinstance(layer, Mapping) or part not in layer:
            return False
        layer = layer[part]
    return layer != {}


def _untagged(loc: tuple[Any, ...], layers: Sequence[Layer]) -> tuple[Any, ...]:
    """An error's location without the union member names pydantic adds to it
    (``trainer.grpo.loss.ppo.x`` -> ``trainer.grpo.loss.x``), where a layer sets the key."""
    for i in range(len(loc) - 1):
        here, skip = loc[: i + 1], (*loc[:i], *loc[i + 1 :])
        if not any(has_path(layer, here) for _, layer in layers):
            if any(has_path(layer, skip) for _, layer in layers):
                return skip
    return loc


def resolve(cls: type[M], layers: Sequence[Layer], section: str = "") -> M:
    """``(label, values)`` run layers merged, lowest first, and their ``section`` (all: ``""``)
    validated as ``cls``; an error names each wrong key and the highest layer setting it."""
    parts = tuple(section.split(".")) if section else ()
    how = rules(cls, parts)
    moves = {(*parts, *o): (*parts, *n) for o, n in moved_keys(cls).items()}
    layers = [(label, renamed(filled(layer, how.fills), moves, label)) for label, layer in layers]
    for path, fold in layer_folds(cls):
        layers = fold(layers, (*parts, *path))
    values: Any = {}
    for _, layer in layers:
        merge(values, layer, how)
    for part in section.split(".") if section else []:
        values = values.get(part, {}) if isinstance(values, Mapping) else values
    try:
        return cls.model_validate({} if values is None else values)
    except ValidationError as e:
        lines = []
        for err in e.errors():  # the key a layer sets (a union adds its member's name)
            loc, origin = _untagged((*parts, *err["loc"]), layers), []
            while loc and not (origin := [n for n, layer in layers if has_path(layer, loc)]):
                loc = loc[:-1]
            where = ".".join(map(str, loc or err["loc"]))
            lines.append(f"{where} (set by {(origin or ['defaults'])[-1]})\n  {err['msg']}")
            if origin and not isinstance(err["input"], Mapping):  # no section, no secret
                lines[-1] += f" [input: {str(err['input'])[:80]!r}]"
        raise RecipeError(f"invalid {e.title}:\n" + "\n".join(lines)) from None
