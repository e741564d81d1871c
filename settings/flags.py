"""A pydantic config as flags and environment variables (docs/RECIPES.md): pydantic-settings'
CLI source builds one ``--kebab-case`` flag per field, its help = the field's docstring and
default; ``bool`` -> ``--x/--no-x``; ``list`` -> ``--x A,B`` (or ``--x A --x B``); ``Literal``
-> choices; an optional field takes ``none``/``null`` for None; a nested model gets dotted
flags (``--gail.use``, ``--gail.beta 0.1``). A ``dict`` field takes JSON. A field reads an environment
variable when declared with :func:`from_env` (or when it belongs to a nested
``pydantic_settings.BaseSettings`` with an ``env_prefix``). A field's declared aliases
(``validation_alias=AliasChoices(...)``, e.g. Atropos' ``--kl-coef``) are extra spellings of
its flag, listed in ``--help`` beside it.

How the flags layer over recipes and config files: ``settings.cli``. Imports neither torch nor
any service package.
"""

from __future__ import annotations

import argparse
import os
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel
from pydantic_settings import CliSettingsSource

from settings.recipe import model_type, unwrap

NONE_WORDS = ("none", "null")
_SOURCES = "_settings_cli_sources"
"""Namespace attribute holding, per config class, the CLI source and the dests it added."""


# ----------------------------------------------------------------------------- field helpers


def from_env(name: str, **extra: Any) -> dict[str, Any]:
    """``json_schema_extra`` of a field that reads environment variable ``name``."""
    return {"env": name, **extra}


def flag_const(value: str) -> dict[str, Any]:
    """``json_schema_extra`` of an optional-value flag: ``--resume`` alone is ``--resume latest``."""
    return {"flag_const": value}


def setter_paths(cls: type[BaseModel], prefix: str = "") -> dict[str, tuple[str, ...]]:
    """``{dotted name: fields it sets}`` of every ``setter_aliases`` entry in ``cls`` and its
    sections (``clip_eps``), resolved while layers merge (``settings.layers.merge``)."""
    out = {prefix + n: t for n, t in getattr(cls, "setter_aliases", {}).items()}
    for name, info in cls.model_fields.items():
        sub = model_type(info.annotation)
        out |= setter_paths(sub, f"{prefix}{name}.") if sub is not None else {}
    return out


def _extra(info: Any) -> dict[str, Any]:
    extra = info.json_schema_extra
    return extra if isinstance(extra, dict) else {}


# ----------------------------------------------------------------------------- flags


def add_config_flags(
    parser: argparse.ArgumentParser,
    cls: type[BaseModel],
    *,
    files: bool = True,
) -> None:
    """``--config`` (alias ``--recipe``), ``--print-config`` and one flag per field of ``cls``."""
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
    _refine_actions(parser, cls, dests)
    sources = dict(parser.get_default(_SOURCES) or {})
    sources[cls] = (source, dests)
    parser.set_defaults(**{_SOURCES: sources})


def _leaf_fields(cls: type[BaseModel], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, info in cls.model_fields.items():
        sub = model_type(info.annotation)
        if sub is not None:
            out |= _leaf_fields(sub, prefix + name + ".")
        else:
            out[prefix + name] = info
    return out


def _refine_actions(parser: argparse.ArgumentParser, cls: type[BaseModel], dests: set[str]) -> None:
    """argparse ``choices`` for ``Literal`` fields, so a wrong value is refused at once with
    argparse's "invalid choice" (``none``/``null`` too where the field is optional); an
    optional value for fields declared with :func:`flag_const`."""
    leaves = _leaf_fields(cls)
    for action in parser._actions:
        info = leaves.get(action.dest) if action.dest in dests else None
        if info is not None and "flag_const" in _extra(info):
            action.nargs, action.const = "?", _extra(info)["flag_const"]
        inner, optional = unwrap(info.annotation) if info is not None else (None, False)
        if typing.get_origin(inner) is Literal:
            action.choices = [str(c) for c in typing.get_args(inner)]
            action.choices += list(NONE_WORDS) if optional else []
            action.metavar = "{" + ",".join(str(c) for c in typing.get_args(inner)) + "}"


def flag_values(cls: type[BaseModel], ns: argparse.Namespace) -> dict[str, Any]:
    """The flags actually given, as a nested dict of field values (``none`` -> None)."""
    source, dests = getattr(ns, _SOURCES)[cls]
    given = argparse.Namespace(**{d: v for d, v in vars(ns).items() if d in dests})
    values = none_words(cls, source(parsed_args=given)())
    for path in setter_paths(cls):
        if hasattr(ns, path):
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


# ----------------------------------------------------------------------------- env vars


def set_dotted(d: dict[str, Any], dotted: str, value: Any) -> None:
    """``d[a][b] = value`` for ``dotted`` ``a.b``, making the mappings on the way."""
    *parents, last = dotted.split(".")
    for p in parents:
        d = d.setdefault(p, {})
    d[last] = value


def env_values(cls: type[BaseModel], environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Field values from the environment variables declared on ``cls`` (recursively)."""
    environ = os.environ if environ is None else environ
    out: dict[str, Any] = {}
    for dotted, name in env_names(cls).items():
        if environ.get(name):
            set_dotted(out, dotted, environ[name])
    return out


def env_names(cls: type[BaseModel], prefix: str = "", env_prefix: str = "") -> dict[str, str]:
    """``{dotted field: ENV_VAR}`` of every field that reads one."""
    out: dict[str, str] = {}
    for name, info in cls.model_fields.items():
        dotted = prefix + name
        sub = model_type(info.annotation)
        if sub is not None:
            sub_prefix = str(sub.model_config.get("env_prefix", "") or "")
            out |= env_names(sub, dotted + ".", sub_prefix)
        elif _extra(info).get("env"):
            out[dotted] = str(_extra(info)["env"])
        elif env_prefix:  # a pydantic_settings.BaseSettings section: PREFIX + FIELD
            out[dotted] = (env_prefix + name).upper()
    return out
