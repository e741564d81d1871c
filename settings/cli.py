"""One command line for every service (docs/RECIPES.md): a service's section resolved from
field defaults < files (``--config``/``--recipe``: a run file or a flat file, in order) <
environment < flags. Imports neither torch nor any service package, so ``--help`` is instant."""

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

M = TypeVar("M", bound=BaseModel)
SECRET_WORDS = ("password", "secret", "api_key")


def is_run_file(data: Mapping[str, Any]) -> bool:
    """A run file (sections, ``base``, or only top-level run keys), not a flat file."""
    keys = set(data)
    return bool(keys & {*SECTIONS, "launch", "base"}) or bool(keys) and keys <= {*TOP_KEYS}


def file_layers(path: Path, section: str) -> list[Layer]:
    """Service ``section``'s values in ``path``: a run file's (shortcuts filled in), one layer
    per file of its ``base:`` chain, or a flat file as it is."""
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
    """Service ``section`` (``api``, ``trainer.sft``, ...): defaults < ``config`` files <
    ``environ`` (default ``os.environ``) < ``flags``."""
    layers = [layer for path in config for layer in file_layers(path, section)]
    layers += [("environment", env_layer(cls, section, environ)), ("flag", dict(flags or {}))]
    return resolve_layers(cls, layers)


def resolve_args(cls: type[M], ns: argparse.Namespace, section: str) -> Resolved:
    """:func:`resolve` from a namespace built by a parser with ``add_config_flags``."""
    config = getattr(ns, "config", None) or ()
    return resolve(cls, section=section, config=config, flags=flag_values(cls, ns))


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


def is_secret(key: str) -> bool:
    """``token``/``*_token`` and names with a secret word (not ``tokenizer``, ``max_tokens``)."""
    key = key.lower()
    return key == "token" or key.endswith("_token") or any(w in key for w in SECRET_WORDS)


def config_file_data(config: BaseModel) -> dict[str, Any]:
    """A resolved config as the flat mapping ``--config`` reads back, secrets left out."""
    return {k: v for k, v in config.model_dump(mode="json").items() if not is_secret(k)}


def report(resolved: Resolved) -> str:
    """The resolved config as YAML (secrets masked), then where non-default values came from."""
    data = resolved.config.model_dump(mode="json")
    data = {k: "***" if is_secret(k) and v is not None else v for k, v in data.items()}
    text = yaml.safe_dump(data, sort_keys=False, default_flow_style=False, width=100)
    set_by = [f"#  {k}: {v}" for k, v in sorted(resolved.sources.items())]
    return text + ("# set by:\n" + "\n".join(set_by) if set_by else "")
