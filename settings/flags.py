"""A pydantic config as ``--kebab-case`` flags (pydantic-settings' ``CliSettingsSource``) and
environment variables (docs/RECIPES.md). Imports neither torch nor any service package."""

from __future__ import annotations

import argparse
import os
import typing
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel
from pydantic_settings import CliSettingsSource

from settings.recipe import model_type, unwrap

NONE_WORDS = ("none", "null")
_SOURCES = "_settings_cli_sources"
"""Namespace attribute holding, per config class, the CLI source and the dests it added."""


def from_env(name: str, **extra: Any) -> dict[str, Any]:
    """``json_schema_extra`` of a field that reads environment variable ``name``."""
    return {"env": name, **extra}


def flag_const(value: str) -> dict[str, Any]:
    """``json_schema_extra`` of an optional-value flag: ``--resume`` alone is ``--resume latest``."""
    return {"flag_const": value}


def _extra(info: Any) -> dict[str, Any]:
    return info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}


def models(cls: type[BaseModel], prefix: str = "") -> Iterator[tuple[str, type[BaseModel]]]:
    """``(dotted prefix, model)`` of ``cls`` and every section nested in it."""
    yield prefix, cls
    for name, info in cls.model_fields.items():
        if (sub := model_type(info.annotation)) is not None:
            yield from models(sub, f"{prefix}{name}.")


def leaves(cls: type[BaseModel]) -> dict[str, tuple[Any, type[BaseModel]]]:
    """``{dotted field: (FieldInfo, the model holding it)}`` of every non-section field."""
    return {
        prefix + name: (info, model)
        for prefix, model in models(cls)
        for name, info in model.model_fields.items()
        if model_type(info.annotation) is None
    }


def setter_paths(cls: type[BaseModel]) -> dict[str, tuple[str, ...]]:
    """``{dotted name: fields it sets}`` of every ``setter_aliases`` entry (``clip_eps``)."""
    return {
        prefix + name: targets
        for prefix, model in models(cls)
        for name, targets in getattr(model, "setter_aliases", {}).items()
    }


def add_config_flags(
    parser: argparse.ArgumentParser, cls: type[BaseModel], *, files: bool = True
) -> None:
    """``--config`` (alias ``--recipe``), ``--print-config`` and one flag per field of ``cls``:
    argparse ``choices`` for a ``Literal`` (``none``/``null`` too where optional), an optional
    value where declared with :func:`flag_const`, a flag per setter alias."""
    if files:
        parser.add_argument(
            "--config",
            "--recipe",
            dest="config",
            type=Path,
            action="append",
            metavar="FILE",
            help="YAML file: a run file (recipes/<model>/<task>/*.yaml, a preset; its shared "
            "keys and this service's section apply) or a flat file of this service's options "
            "(what launch/run_all.sh writes to <run>/config/). Several apply in order; the "
            "environment and flags override them.",
        )
        parser.add_argument(
            "--print-config",
            action="store_true",
            help="Print the resolved config (secrets masked) with where each value came "
            "from, then exit.",
        )
    before = {a.dest for a in parser._actions}
    source = CliSettingsSource(
        cls,
        root_parser=parser,
        cli_kebab_case=True,
        cli_implicit_flags=True,
        cli_avoid_json=True,
        cli_hide_none_type=True,
        cli_parse_none_str="null",
    )
    for path, targets in setter_paths(cls).items():
        parser.add_argument(
            "--" + path.replace("_", "-"),
            dest=path,
            metavar="VALUE",
            default=argparse.SUPPRESS,
            help=f"Sets {' and '.join(targets)} both (a declared alias, not a field).",
        )
    dests = {a.dest for a in parser._actions} - before
    fields = leaves(cls)
    for action in (a for a in parser._actions if a.dest in dests and a.dest in fields):
        info = fields[action.dest][0]
        if "flag_const" in _extra(info):
            action.nargs, action.const = "?", _extra(info)["flag_const"]
        inner, optional = unwrap(info.annotation)
        if typing.get_origin(inner) is Literal:
            action.choices = [str(c) for c in typing.get_args(inner)]
            action.metavar = "{" + ",".join(action.choices) + "}"
            action.choices += list(NONE_WORDS) if optional else []
    parser.set_defaults(
        **{_SOURCES: {**(parser.get_default(_SOURCES) or {}), cls: (source, dests)}}
    )


def flag_values(cls: type[BaseModel], ns: argparse.Namespace) -> dict[str, Any]:
    """The flags actually given, as a nested dict of field values (``none`` -> None)."""
    source, dests = getattr(ns, _SOURCES)[cls]
    given = argparse.Namespace(**{d: v for d, v in vars(ns).items() if d in dests})
    values = none_words(cls, source(parsed_args=given)())
    for path in (p for p in setter_paths(cls) if hasattr(ns, p)):
        set_dotted(values, path, getattr(ns, path))
    return values


def none_words(cls: type[BaseModel], values: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in values.items():
        info = cls.model_fields.get(key)
        sub = model_type(info.annotation) if info is not None else None
        if sub is not None and isinstance(value, dict):
            value = none_words(sub, value)
        elif info is not None and unwrap(info.annotation)[1] and str(value).lower() in NONE_WORDS:
            value = None
        out[key] = value
    return out


def set_dotted(d: dict[str, Any], dotted: str, value: Any, *, first: bool = False) -> None:
    """``d[a][b] = value`` for ``dotted`` ``a.b``, making the mappings on the way; ``first``:
    only where unset, placed first (a shortcut's vLLM argument goes before the section's)."""
    *parents, last = dotted.split(".")
    for p in parents:
        d = d.setdefault(p, {})
    if not first:
        d[last] = value
    elif last not in d:
        rest = dict(d)
        d.clear()
        d.update({last: value, **rest})


def env_values(
    cls: type[BaseModel],
    environ: Mapping[str, str] | None = None,
    out: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``out`` (default: a new mapping) with the values of the environment variables the
    fields of ``cls`` declare (:func:`from_env`, or a nested ``BaseSettings``' ``env_prefix``)."""
    environ = os.environ if environ is None else environ
    out = {} if out is None else out
    for dotted, (info, model) in leaves(cls).items():
        prefix = model.model_config.get("env_prefix") if model is not cls else ""
        name = _extra(info).get("env") or prefix and (prefix + dotted.rsplit(".", 1)[-1]).upper()
        if name and environ.get(name):
            set_dotted(out, dotted, environ[name])
    return out
