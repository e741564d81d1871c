"""One command line for every service (docs/RECIPES.md): ``--config FILE`` (alias
``--recipe``: run files, in order), ``--print-config``, and one ``--kebab-case`` flag per field
(pydantic-settings' ``CliSettingsSource``). Imports no service package: ``--help`` is instant."""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, get_args, get_origin

import yaml
from pydantic import BaseModel
from pydantic_settings import CliSettingsSource

from settings.layers import env_layer, file_layers, nest, resolve

M = TypeVar("M", bound=BaseModel)

SECRET_WORDS = ("password", "secret", "api_key")
NOT_SECRET = frozenset({"insecure_no_token"})
"""Names that look like a secret's and are not (settings/bind.py's opt-out switch)."""
OPTIONAL_VALUE = {"resume": "latest"}
"""Flags whose value may be left out: ``--resume`` alone is ``--resume latest``."""
CLI = {"cli_kebab_case": True, "cli_implicit_flags": True, "cli_avoid_json": True}
CLI |= {"cli_hide_none_type": True, "cli_parse_none_str": "null"}
"""pydantic-settings' ``CliSettingsSource`` options: ``--kebab-case``, ``--flag``/``--no-flag``."""
FILES = "YAML run files (recipes/, presets, <run>/config/*.yaml), in order; env and flags win"


def cli_shortcuts(old_keys: Mapping[str, str], prefix: str = "") -> dict[str, str | list[str]]:
    """The flags of a model's old keys (``old_keys``: old key -> new dotted path) as
    pydantic-settings' ``cli_shortcuts``: ``{"loss.clip-low": "clip-low"}`` (several old keys of
    one field: a list)."""
    out: dict[str, list[str]] = {}
    for old, new in old_keys.items():
        kebab = f"{prefix}{new.replace('_', '-')}"
        out.setdefault(kebab, []).append(f"{prefix}{old.replace('_', '-')}")
    return {new: olds[0] if len(olds) == 1 else olds for new, olds in out.items()}


def add_config_flags(
    parser: argparse.ArgumentParser, cls: type[BaseModel], *, files: bool = True
) -> None:
    """``--config`` (alias ``--recipe``), ``--print-config`` and one flag per field of ``cls``."""
    if files:
        parser.add_argument(
            "--config", "--recipe", type=Path, action="append", metavar="FILE", help=FILES
        )
        parser.add_argument("--print-config", action="store_true", help="print it, then exit")
    before = {a.dest for a in parser._actions}
    source = CliSettingsSource(cls, root_parser=parser, **CLI)
    dests = {a.dest for a in parser._actions} - before
    tags = union_tags(cls)
    for action in parser._actions:
        if action.dest in dests and (choices := tags.get(action.dest)):  # {ppo,gspo,cispo}
            action.metavar = "{" + ",".join(choices) + "}"
        const = OPTIONAL_VALUE.get(action.dest.rsplit(".", 1)[-1])
        if action.dest in dests and const and action.nargs is None:
            action.nargs, action.const = "?", const
    parser.set_defaults(_settings_cli=(source, dests))


def union_tags(cls: type[BaseModel], prefix: str = "") -> dict[str, list[str]]:
    """The tag field's values of every union of models in ``cls`` (``loss.type``: ``ppo``,
    ``gspo``, ``cispo``), by flag destination: pydantic-settings shows the first member's."""
    out: dict[str, list[str]] = {}
    for name, field in cls.model_fields.items():
        members = [m for m in _flat_args(field.annotation) if _is_model(m)]
        if len(members) == 1:
            out |= union_tags(members[0], f"{prefix}{name}.")
        elif len(members) > 1:
            for key in set.intersection(*(set(m.model_fields) for m in members)):
                values = [get_args(m.model_fields[key].annotation) for m in members]
                if all(
                    len(v) == 1 and get_origin(m.model_fields[key].annotation) is Literal
                    for v, m in zip(values, members, strict=True)
                ):
                    out[f"{prefix}{name}.{key}"] = [v[0] for v in values]
    return out


def _flat_args(annotation: Any) -> list[Any]:
    """``annotation`` and its arguments, through ``Annotated`` and unions."""
    args = get_args(annotation)
    if not args:
        return [annotation]
    if get_origin(annotation) is Annotated:
        return _flat_args(args[0])
    return [a for arg in args for a in _flat_args(arg)]


def _is_model(value: Any) -> bool:
    return isinstance(value, type) and issubclass(value, BaseModel)


def flag_values(ns: argparse.Namespace) -> dict[str, Any]:
    """The flags given (only those), as a nested mapping of field values."""
    source, dests = ns._settings_cli
    return source(parsed_args={d: v for d, v in vars(ns).items() if d in dests})()


def resolve_section(
    cls: type[M],
    section: str,
    files: Sequence[Path] = (),
    flags: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> M:
    """A service's config ``cls``, the run's ``section`` (``trainer.grpo``): defaults < its
    ``files`` (run files, in order) < ``environ`` (default ``os.environ``) < its ``flags``."""
    layers = [layer for path in files for layer in file_layers(path)]
    layers += [("environment", env_layer(cls, section, environ))]
    layers += [("command line", nest(section, dict(flags)))] if flags else []
    return resolve(cls, layers, section)


def resolve_args(
    cls: type[M], ns: argparse.Namespace, section: str, environ: Mapping[str, str] | None = None
) -> M:
    """:func:`resolve_section` of the namespace of a parser with :func:`add_config_flags`."""
    return resolve_section(cls, section, ns.config or (), flag_values(ns), environ)


def parse(cls: type[M], argv: Sequence[str] | None, *, prog: str, section: str) -> M:
    """Parser + resolution of a single-command service; ``--print-config`` prints and exits."""
    parser = argparse.ArgumentParser(prog=prog, description=cls.__doc__)
    add_config_flags(parser, cls)
    ns = parser.parse_args(argv)
    config = resolve_args(cls, ns, section)
    if ns.print_config:
        print(report(config))
        raise SystemExit(0)
    return config


def is_secret(key: str) -> bool:
    """``token``/``*_token`` and names with a secret word (not ``tokenizer``, ``max_tokens``,
    nor the ``insecure_no_token`` switch: a run file carries it, a report shows it)."""
    key = key.lower()
    if key in NOT_SECRET:
        return False
    return key == "token" or key.endswith("_token") or any(w in key for w in SECRET_WORDS)


def report(config: BaseModel) -> str:
    """``config`` as YAML, secrets masked (``--print-config``, the services' logs)."""
    data = config.model_dump(mode="json")
    data = {k: "***" if is_secret(k) and v is not None else v for k, v in data.items()}
    return yaml.safe_dump(data, sort_keys=False, width=100)
