"""One command line for every service: a pydantic config becomes flags (``settings.flags``),
a recipe and environment variables fill it, and the result is validated and reported.

Precedence, lowest first (docs/RECIPES.md):

    field defaults < recipe (``--recipe``: shared keys, then the service's section)
                   < flat config file (``--config``: this service's options only; what
                     launch/run_all.sh writes for each service)
                   < environment variables declared on fields < command-line flags

This module imports neither torch nor any service package, so every ``--help`` stays instant
and every package can import it. Recipe reading lives in ``settings.recipe``, the flags and
environment variables in ``settings.flags``.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from settings.flags import add_config_flags, env_values, flag_values
from settings.recipe import (
    RecipeError,
    check_keys,
    load_recipe,
    model_type,
    read_yaml,
    section_values,
    snake_keys,
)

M = TypeVar("M", bound=BaseModel)


# ----------------------------------------------------------------------------- resolution


@dataclass
class Resolved:
    """A validated config plus, per dotted field, the layer that set it."""

    config: Any
    sources: dict[str, str] = field(default_factory=dict)


def _merge(base: dict[str, Any], over: Mapping[str, Any], cls: type[BaseModel] | None) -> None:
    """Layer ``over`` onto ``base``: nested model fields merge key by key, the rest replace."""
    for key, value in over.items():
        info = cls.model_fields.get(key) if cls is not None else None
        sub = model_type(info.annotation) if info is not None else None
        if sub is not None and isinstance(value, dict) and isinstance(base.get(key), dict):
            merged = dict(base[key])
            _merge(merged, snake_keys(value), sub)
            base[key] = merged
        else:
            base[key] = value


def _drop_replaced_alternatives(
    cls: type[BaseModel], values: dict[str, Any], sources: dict[str, str], layer: Mapping[str, Any]
) -> None:
    """A layer that sets one field of an ``exclusive_fields`` group (a ``ClassVar`` of the
    config: tuples of alternative ways to give the same setting) replaces the whole group: what
    an earlier layer set through another member is dropped, so a recipe's ``rewards:``
    overrides a preset's ``reward_variant`` and ``--reward-variant no_dars`` on the command
    line overrides a recipe's ``rewards:`` instead of clashing with it."""
    for group in getattr(cls, "exclusive_fields", ()):
        if any(key in layer for key in group):
            for key in group:
                if key not in layer:
                    values.pop(key, None)
                    sources.pop(key, None)


def _record(sources: dict[str, str], values: Mapping[str, Any], label: str) -> None:
    for key, value in values.items():
        if isinstance(value, dict):  # one level down: says which nested option came from where
            sources |= {f"{key}.{k}": label for k in value}
        else:
            sources[key] = label


def resolve_layers(cls: type[M], layers: Sequence[tuple[str, Mapping[str, Any]]]) -> Resolved:
    """Merge ``(label, values)`` layers, lowest first, and validate (clear errors)."""
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for label, layer in layers:
        _drop_replaced_alternatives(cls, values, sources, layer)
        _merge(values, layer, cls)
        _record(sources, layer, label)
    try:
        cfg = cls.model_validate(values)
    except ValidationError as e:
        origin = ", ".join(label for label, layer in layers if layer) or "defaults"
        raise RecipeError(f"invalid {cls.__name__} (from {origin}):\n{e}") from None
    return Resolved(cfg, sources)


def recipe_layer(
    cls: type[BaseModel] | None, section: str, recipe: Path, label: str = "recipe"
) -> tuple[str, dict[str, Any]]:
    """``(label, values)``: what ``section`` reads from the recipe at ``recipe``."""
    return f"{label} {recipe}", section_values(load_recipe(recipe), section, cls, recipe)


def config_layer(cls: type[BaseModel], config: Path) -> tuple[str, dict[str, Any]]:
    """``(label, values)`` of a flat config file (every key a field of ``cls``)."""
    flat = snake_keys(read_yaml(config))
    check_keys(cls, flat, str(config))
    return f"config {config}", flat


def resolve(
    cls: type[M],
    *,
    section: str,
    recipe: Path | None = None,
    config: Path | None = None,
    flags: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Resolved:
    """Merge the layers (defaults < recipe < config < env < flags) and validate."""
    layers: list[tuple[str, Mapping[str, Any]]] = []
    if recipe is not None:
        layers.append(recipe_layer(cls, section, recipe))
    if config is not None:
        layers.append(config_layer(cls, config))
    layers.append(("environment", env_values(cls, environ)))
    layers.append(("flag", dict(flags or {})))
    return resolve_layers(cls, layers)


def resolve_args(cls: type[M], ns: argparse.Namespace, section: str) -> Resolved:
    """:func:`resolve` from a namespace built by a parser with :func:`add_config_flags`."""
    return resolve(
        cls,
        section=section,
        recipe=getattr(ns, "recipe", None),
        config=getattr(ns, "config", None),
        flags=flag_values(cls, ns),
    )


def parse(
    cls: type[M],
    argv: Sequence[str] | None,
    *,
    prog: str,
    section: str,
) -> Resolved:
    """Parser + resolution for a single-command service; ``--print-config`` prints and exits."""
    parser = argparse.ArgumentParser(prog=prog, description=cls.__doc__)
    add_config_flags(parser, cls)
    ns = parser.parse_args(argv)
    resolved = resolve_args(cls, ns, section)
    if getattr(ns, "print_config", False):
        print(report(resolved))
        raise SystemExit(0)
    return resolved


def parse_config(
    cls: type[M],
    argv: Sequence[str] | None,
    *,
    prog: str,
    section: str,
) -> M:
    """:func:`parse`, config only."""
    return parse(cls, argv, prog=prog, section=section).config


# ----------------------------------------------------------------------------- reporting

SECRET_WORDS = ("password", "secret", "api_key")


def is_secret(key: str) -> bool:
    """``token``/``*_token`` fields and names with a secret word (not ``tokenizer`` or
    ``max_tokens``)."""
    key = key.lower()
    return key == "token" or key.endswith("_token") or any(w in key for w in SECRET_WORDS)


def _mask(key: str, value: Any) -> Any:
    return "***" if is_secret(key) and value is not None else value


def config_file_data(config: BaseModel) -> dict[str, Any]:
    """A resolved config as the flat mapping ``--config`` reads back, secrets left out (they
    travel by environment variable, never in a file)."""
    data = config.model_dump(mode="json")
    return {k: v for k, v in data.items() if not is_secret(k)}


def report(resolved: Resolved) -> str:
    """The resolved config as YAML (secrets masked), then where the non-default values came
    from; services log it at start so a run's log says exactly what it ran with."""
    data = resolved.config.model_dump(mode="json")
    data = {k: _mask(k, v) for k, v in data.items()}
    text = yaml.safe_dump(data, sort_keys=False, default_flow_style=False, width=100)
    set_by = [f"  {k}: {v}" for k, v in sorted(resolved.sources.items())]
    return text + ("# set by:\n" + "\n".join("#" + s for s in set_by) if set_by else "")
