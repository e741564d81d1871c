"""One command line for every service: a pydantic config becomes flags (pydantic-settings'
CLI source), a recipe and environment variables fill it, and the result is validated and
reported.

Precedence, lowest first (docs/RECIPES.md):

    field defaults < recipe (``--recipe``: shared keys, then the service's section)
                   < flat config file (``--config``: this service's options only; what
                     launch/run_all.sh writes for each service)
                   < environment variables declared on fields < command-line flags

Flags (``pydantic_settings.CliSettingsSource``): one ``--kebab-case`` flag per field, its help
= the field's docstring and default; ``bool`` -> ``--x/--no-x``; ``list`` -> ``--x A,B`` (or
``--x A --x B``); ``Literal`` -> choices; an optional field takes ``none``/``null`` for None; a
nested model gets dotted flags (``--gail.use``, ``--gail.beta 0.1``). ``dict`` fields and
fields marked :func:`recipe_only` are set in recipes and config files only. A field reads an
environment variable when declared with :func:`from_env` (or when it belongs to a nested
``pydantic_settings.BaseSettings`` with an ``env_prefix``). Extra spellings of a flag
(``aliases``, e.g. Atropos' ``--kl-coef``) are listed in ``--help`` beside it.

This module imports neither torch nor any service package, so every ``--help`` stays instant
and every package can import it. Recipe reading lives in ``settings.recipe``.
"""

from __future__ import annotations

import argparse
import os
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml
from pydantic import AliasChoices, BaseModel, Field, ValidationError, create_model
from pydantic_settings import CliSettingsSource

from settings.recipe import (
    RecipeError,
    check_keys,
    load_recipe,
    model_type,
    read_yaml,
    section_values,
    snake_keys,
    unwrap,
)

M = TypeVar("M", bound=BaseModel)
NONE_WORDS = ("none", "null")
COMPUTED = "computed"
_SOURCES = "_settings_cli_sources"
"""Namespace attribute holding, per config class, the CLI source and the dests it added."""


# ----------------------------------------------------------------------------- field helpers


def from_env(name: str, **extra: Any) -> dict[str, Any]:
    """``json_schema_extra`` of a field that reads environment variable ``name``."""
    return {"env": name, **extra}


def recipe_only(**extra: Any) -> dict[str, Any]:
    """``json_schema_extra`` of a field that gets no flag (set it in a recipe)."""
    return {"cli": False, **extra}


def _extra(info: Any) -> dict[str, Any]:
    extra = info.json_schema_extra
    return extra if isinstance(extra, dict) else {}


def _flaggable(info: Any) -> bool:
    inner, _ = unwrap(info.annotation)
    is_dict = inner is dict or getattr(inner, "__origin__", None) is dict
    return _extra(info).get("cli") is not False and not is_dict


def _flag_model(
    cls: type[BaseModel], aliases: Mapping[str, Sequence[str]], prefix: str = ""
) -> type[BaseModel]:
    """``cls`` reduced to the fields that get a flag (nested models recursively), each with
    its description, default and extra spellings; only its shape is used (no validation)."""
    fields: dict[str, Any] = {}
    for name, info in cls.model_fields.items():
        if not _flaggable(info):
            continue
        dotted = prefix + name
        annotation = info.annotation
        sub = model_type(annotation)
        if sub is not None:
            annotation = _flag_model(sub, aliases, dotted + ".")
        names = [a.lstrip("-").replace("-", "_") for a in aliases.get(dotted, ())]
        default: dict[str, Any] = {"default": info.default}
        if info.default_factory is not None:  # help says "computed" (a secret stays unread)
            default = {"default_factory": info.default_factory} if sub else {"default": COMPUTED}
        fields[name] = (
            annotation,
            Field(
                **default,
                description=info.description,
                validation_alias=AliasChoices(name, *names) if names else None,
            ),
        )
    return create_model(f"{cls.__name__}Flags", __doc__=cls.__doc__, **fields)


# ----------------------------------------------------------------------------- flags


def add_config_flags(
    parser: argparse.ArgumentParser,
    cls: type[BaseModel],
    *,
    aliases: Mapping[str, Sequence[str]] | None = None,
    files: bool = True,
) -> None:
    """``--recipe``, ``--config``, ``--print-config`` and one flag per field of ``cls``.

    ``aliases`` maps a dotted field name to extra flag spellings (``{"kl_beta": ["--kl-coef"]}``).
    """
    if files:
        parser.add_argument(
            "--recipe",
            type=Path,
            default=None,
            help="YAML recipe (recipes/<model>/<task>/*.yaml); its shared keys and this "
            "service's section set options, flags override them.",
        )
        parser.add_argument(
            "--config",
            type=Path,
            default=None,
            help="Flat YAML of this service's options (applied over --recipe, under flags); "
            "launch/run_all.sh writes one per service into <run>/config/.",
        )
        parser.add_argument(
            "--print-config",
            action="store_true",
            help="Print the resolved config (secrets masked) with where each value came "
            "from, then exit.",
        )
    before = {a.dest for a in parser._actions}
    source = CliSettingsSource(
        _flag_model(cls, aliases or {}),
        root_parser=parser,
        cli_kebab_case=True,
        cli_implicit_flags=True,
        cli_avoid_json=True,
        cli_hide_none_type=True,
        cli_parse_none_str="null",
    )
    dests = {a.dest for a in parser._actions} - before
    _literal_choices(parser, cls, dests)
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


def _literal_choices(
    parser: argparse.ArgumentParser, cls: type[BaseModel], dests: set[str]
) -> None:
    """argparse ``choices`` for ``Literal`` fields, so a wrong value is refused at once with
    argparse's "invalid choice" (``none``/``null`` too where the field is optional)."""
    leaves = _leaf_fields(cls)
    for action in parser._actions:
        info = leaves.get(action.dest) if action.dest in dests else None
        inner, optional = unwrap(info.annotation) if info is not None else (None, False)
        if typing.get_origin(inner) is Literal:
            action.choices = [str(c) for c in typing.get_args(inner)]
            action.choices += list(NONE_WORDS) if optional else []
            action.metavar = "{" + ",".join(str(c) for c in typing.get_args(inner)) + "}"


def flag_values(cls: type[BaseModel], ns: argparse.Namespace) -> dict[str, Any]:
    """The flags actually given, as a nested dict of field values (``none`` -> None)."""
    source, dests = getattr(ns, _SOURCES)[cls]
    given = argparse.Namespace(**{d: v for d, v in vars(ns).items() if d in dests})
    return _none_words(cls, source(parsed_args=given)())


def _none_words(cls: type[BaseModel], values: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in values.items():
        info = cls.model_fields.get(key)
        sub = model_type(info.annotation) if info is not None else None
        if sub is not None and isinstance(value, dict):
            value = _none_words(sub, value)
        elif info is not None and unwrap(info.annotation)[1] and str(value).lower() in NONE_WORDS:
            value = None
        out[key] = value
    return out


def flags_of(
    cls: type[BaseModel],
    argv: Sequence[str],
    *,
    prog: str = "flags",
    aliases: Mapping[str, Sequence[str]] | None = None,
) -> dict[str, Any]:
    """The field values a list of ``cls``'s flags sets (``--env-args`` of the launcher)."""
    parser = argparse.ArgumentParser(prog=prog, add_help=False)
    add_config_flags(parser, cls, aliases=aliases, files=False)
    return flag_values(cls, parser.parse_args(list(argv)))


# ----------------------------------------------------------------------------- env vars


def _set_dotted(d: dict[str, Any], dotted: str, value: Any) -> None:
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
            _set_dotted(out, dotted, environ[name])
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
    aliases: Mapping[str, Sequence[str]] | None = None,
) -> Resolved:
    """Parser + resolution for a single-command service; ``--print-config`` prints and exits."""
    parser = argparse.ArgumentParser(prog=prog, description=cls.__doc__)
    add_config_flags(parser, cls, aliases=aliases)
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
    aliases: Mapping[str, Sequence[str]] | None = None,
) -> M:
    """:func:`parse`, config only."""
    return parse(cls, argv, prog=prog, section=section, aliases=aliases).config


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
