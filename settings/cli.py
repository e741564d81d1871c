"""One command line for every service (docs/RECIPES.md): a service's config class gets one
``--kebab-case`` flag per field (``settings.flags``), and one file and the environment fill it
(``settings.layers``). Precedence, lowest first:

    field defaults < file (``--config FILE``, alias ``--recipe``: a run file, whose shortcuts
                     and this service's section apply, or a flat file of this service's
                     options, as launch/run_all.sh writes; several apply in order)
                   < environment (``SHOP_R1_<SECTION>__<FIELD>``, declared names) < flags

This module imports neither torch nor any service package, so every ``--help`` stays instant
and every package can import it.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel

from settings.flags import add_config_flags, flag_values
from settings.layers import SHORTCUTS, Layer, Resolved, env_layer, expand, snake
from settings.layers import resolve as resolve_layers
from settings.recipe import SECTIONS, TOP_KEYS, read_yaml, recipe_chain

__all__ = ["Resolved", "config_file_data", "parse", "report", "resolve"]
M = TypeVar("M", bound=BaseModel)


def is_run_file(data: Mapping[str, Any]) -> bool:
    """A run file (``RunConfig`` as YAML: shortcuts and sections) rather than one service's
    flat options: it has a section (or ``base``), or every top-level key is a run file's. The
    keys both kinds may hold (``seed``, ``model``, ``rewards``, ``weight_bridge_mode``,
    ``single_copy``) set the same field of a service either way."""
    keys = set(data)
    return bool(keys & {*SECTIONS, "launch", "base"}) or bool(keys) and keys <= {*TOP_KEYS}


def file_layers(path: Path, section: str) -> list[Layer]:
    """Service ``section``'s values in ``path``, one layer per file: a run file's shortcuts and
    section (each file of its ``base:`` chain a layer of its own, ``${VAR}`` expanded) or a
    flat file as it is."""
    data = read_yaml(path)
    if not is_run_file(data):
        return [(f"file {path}", snake(data))]
    layers: list[Layer] = []
    for file, recipe in recipe_chain(path):
        values: Any = expand(recipe, SHORTCUTS)
        for part in section.split("."):
            values = values.get(part) or {} if isinstance(values, dict) else {}
        layers.append((f"file {file}", values))
    return layers


def resolve(
    cls: type[M],
    *,
    section: str,
    config: Sequence[Path] = (),
    flags: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Resolved:
    """Service ``section`` (``api``, ``env``, ``trainer.sft``, ...) validated from its layers:
    defaults < ``config`` files in order < the environment (``environ``, default
    ``os.environ``) < ``flags``."""
    layers = [layer for path in config for layer in file_layers(path, section)]
    layers.append(("environment", env_layer(cls, section, environ)))
    layers.append(("flag", dict(flags or {})))
    return resolve_layers(cls, layers)


def resolve_args(cls: type[M], ns: argparse.Namespace, section: str) -> Resolved:
    """:func:`resolve` from a namespace built by a parser with ``add_config_flags``."""
    return resolve(
        cls,
        section=section,
        config=getattr(ns, "config", None) or (),
        flags=flag_values(cls, ns),
    )


def parse(cls: type[M], argv: Sequence[str] | None, *, prog: str, section: str) -> Resolved:
    """Parser + resolution for a single-command service; ``--print-config`` prints and exits."""
    parser = argparse.ArgumentParser(prog=prog, description=cls.__doc__)
    add_config_flags(parser, cls)
    ns = parser.parse_args(argv)
    resolved = resolve_args(cls, ns, section)
    if getattr(ns, "print_config", False):
        print(report(resolved))
        raise SystemExit(0)
    return resolved


SECRET_WORDS = ("password", "secret", "api_key")


def is_secret(key: str) -> bool:
    """``token``/``*_token`` fields and names with a secret word (not ``tokenizer`` or
    ``max_tokens``)."""
    key = key.lower()
    return key == "token" or key.endswith("_token") or any(w in key for w in SECRET_WORDS)


def config_file_data(config: BaseModel) -> dict[str, Any]:
    """A resolved config as the flat mapping ``--config`` reads back, secrets left out (they
    travel by environment variable, never in a file)."""
    return {k: v for k, v in config.model_dump(mode="json").items() if not is_secret(k)}


def report(resolved: Resolved) -> str:
    """The resolved config as YAML (secrets masked), then where the non-default values came
    from; services log it at start so a run's log says exactly what it ran with."""
    data = resolved.config.model_dump(mode="json")
    data = {k: "***" if is_secret(k) and v is not None else v for k, v in data.items()}
    text = yaml.safe_dump(data, sort_keys=False, default_flow_style=False, width=100)
    set_by = [f"#  {k}: {v}" for k, v in sorted(resolved.sources.items())]
    return text + ("# set by:\n" + "\n".join(set_by) if set_by else "")
