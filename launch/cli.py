"""One command line for every service: a pydantic config becomes argparse flags, a YAML recipe
and environment variables fill it, and the result is validated and reported.

Precedence, lowest first (docs/RECIPES.md):

    field defaults < recipe (``--recipe``: shared keys, then the service's section)
                   < flat config file (``--config``: this service's options only)
                   < environment variables declared on fields < command-line flags

Flag rules: one ``--kebab-case`` flag per field, its help = the field's docstring/description;
``bool`` -> ``--x/--no-x``; ``list`` -> ``--x A B``; ``Literal`` -> choices; an optional field
takes ``none``/``null`` for None; a nested pydantic model field gets dotted flags
(``--gail.use``, ``--gail.beta 0.1``); ``dict`` fields and fields marked ``cli=False``
(:func:`recipe_only`) are set in recipes only. A field reads an environment variable when it
is declared with :func:`from_env` (or belongs to a nested ``pydantic_settings.BaseSettings``
with an ``env_prefix``).

This module imports neither torch nor any service package, so every ``--help`` stays instant
and every package can import it.
"""

from __future__ import annotations

import argparse
import os
import re
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)

SECTIONS = ("api", "env", "trainer", "vllm")
"""Per-service sections of a recipe. ``trainer`` holds options of both commands plus the
``sft:`` and ``grpo:`` subsections; ``vllm`` holds vLLM arguments and the bridge options."""
TRAINER_COMMANDS = ("sft", "grpo")
DOC_KEYS = ("name", "description")
"""Top-level keys for humans; read by no service."""
BASE_KEY = "base"
"""``base: other.yaml`` (relative to the recipe): start from that recipe, then apply this one
(mappings merge key by key; ``rewards`` is replaced whole, so an ablation lists what it keeps)."""

SHARED: dict[str, dict[str, str]] = {
    "model": {"trainer": "model_name", "env": "tokenizer", "vllm": "model"},
    "seed": {"trainer": "seed", "env": "seed", "vllm": "seed"},
    "output_dir": {
        "trainer": "save_path",
        "api": "db_path={}/api.sqlite",
        "env": "metrics_path={}/env_metrics.jsonl",
        "vllm": "bridge_config={}/vllm_bridge_config.json",
    },
    "data.dir": {"trainer": "data_dir", "env": "data_dir"},
    "data.num_sessions": {"trainer": "num_sessions", "env": "num_sessions"},
    "rewards": {"env": "rewards"},
    "weight_bridge_mode": {"trainer": "weight_bridge_mode", "vllm": "bridge_mode"},
    "single_copy": {"trainer": "single_copy", "vllm": "single_copy"},
    "logging.wandb_project": {"trainer": "wandb_project"},
    "logging.tensorboard": {"trainer": "tensorboard"},
    "logging.log_level": {"api": "log_level"},
}
"""Top-level recipe keys and the field each service reads them into (``field={}/file``: the
value is a directory and the field gets a file inside it). A key goes into every service
config that has the field; the service's own section wins over it."""
SHARED_GROUPS = ("data", "logging")
"""Top-level keys that are mappings of shared keys (``data: {dir: ..., num_sessions: ...}``)."""


class RecipeError(SystemExit):
    """A recipe, a config file or a value is wrong; the message names the file and the key."""

    def __init__(self, message: str) -> None:
        super().__init__(f"error: {message}")


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


def _unwrap(annotation: Any) -> tuple[Any, bool]:
    """(annotation without ``None``, optional?)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        optional = len(args) < len(typing.get_args(annotation))
        return (args[0] if len(args) == 1 else annotation), optional
    return annotation, False


def _model_type(annotation: Any) -> type[BaseModel] | None:
    inner, _ = _unwrap(annotation)
    return inner if isinstance(inner, type) and issubclass(inner, BaseModel) else None


def _kind(annotation: Any) -> str:
    inner, _ = _unwrap(annotation)
    origin = typing.get_origin(inner)
    if inner is bool:
        return "bool"
    if _model_type(inner) is not None:
        return "model"
    if origin in (list, tuple, set, Sequence) or inner in (list, tuple):
        return "list"
    if origin in (dict, Mapping) or inner is dict:
        return "dict"
    if origin is Literal:
        return "literal"
    return "scalar"


def _help(info: Any) -> str:
    text = " ".join((info.description or "").split())
    default = info.default if info.default_factory is None else "computed"
    return f"{text} (default: {default!r})".replace("%", "%%")


# ----------------------------------------------------------------------------- flags


def add_config_flags(
    parser: argparse.ArgumentParser,
    cls: type[BaseModel],
    *,
    aliases: Mapping[str, Sequence[str]] | None = None,
    files: bool = True,
) -> None:
    """``--recipe``, ``--config``, ``--print-config`` and one flag per field of ``cls``.

    ``aliases`` maps a dotted field name to extra flag spellings (``{"resume": ["--r"]}``).
    """
    if files:
        parser.add_argument(
            "--recipe", type=Path, default=None,
            help="YAML recipe (recipes/<model>/<task>/*.yaml); its shared keys and this "
                 "service's section set options, flags override them.",
        )  # fmt: skip
        parser.add_argument(
            "--config", type=Path, default=None,
            help="Flat YAML of this service's options (applied over --recipe, under flags).",
        )  # fmt: skip
        parser.add_argument(
            "--print-config", action="store_true",
            help="Print the resolved config (secrets masked) with where each value came "
                 "from, then exit.",
        )  # fmt: skip
    _add_model_flags(parser, cls, "", aliases or {})


def _add_model_flags(
    parser: argparse.ArgumentParser, cls: type[BaseModel], prefix: str,
    aliases: Mapping[str, Sequence[str]],
) -> None:  # fmt: skip
    for name, info in cls.model_fields.items():
        dotted = prefix + name
        if _extra(info).get("cli") is False:
            continue
        kind = _kind(info.annotation)
        if kind == "model":
            _add_model_flags(parser, _model_type(info.annotation), dotted + ".", aliases)
            continue
        if kind == "dict":
            continue  # recipe only: a mapping has no natural flag form
        flags = ["--" + dotted.replace("_", "-"), *aliases.get(dotted, ())]
        kw: dict[str, Any] = {"dest": dotted, "default": argparse.SUPPRESS, "help": _help(info)}
        if kind == "bool":
            kw["action"] = argparse.BooleanOptionalAction
        elif kind == "list":
            kw["nargs"] = "*"
        elif kind == "literal":
            inner, optional = _unwrap(info.annotation)
            kw["choices"] = [str(c) for c in typing.get_args(inner)] + (
                ["none", "null"] if optional else []
            )
            kw["metavar"] = "{" + ",".join(str(c) for c in typing.get_args(inner)) + "}"
        parser.add_argument(*flags, **kw)


def flag_values(cls: type[BaseModel], ns: argparse.Namespace) -> dict[str, Any]:
    """The flags actually given, as a nested dict of field values (``none`` -> None)."""
    out: dict[str, Any] = {}
    for dotted, info in _leaf_fields(cls):
        if dotted not in ns:
            continue
        value = getattr(ns, dotted)
        _, optional = _unwrap(info.annotation)
        if optional and isinstance(value, str) and value.lower() in ("none", "null"):
            value = None
        _set_dotted(out, dotted, value)
    return out


def _leaf_fields(cls: type[BaseModel], prefix: str = "") -> list[tuple[str, Any]]:
    leaves = []
    for name, info in cls.model_fields.items():
        sub = _model_type(info.annotation)
        if sub is not None and _extra(info).get("cli") is not False:
            leaves += _leaf_fields(sub, prefix + name + ".")
        else:
            leaves.append((prefix + name, info))
    return leaves


def _set_dotted(d: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    for p in parents:
        d = d.setdefault(p, {})
    d[last] = value


# ----------------------------------------------------------------------------- env vars


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
        sub = _model_type(info.annotation)
        if sub is not None:
            sub_prefix = str(sub.model_config.get("env_prefix", "") or "")
            out |= env_names(sub, dotted + ".", sub_prefix)
        elif _extra(info).get("env"):
            out[dotted] = str(_extra(info)["env"])
        elif env_prefix:  # a pydantic_settings.BaseSettings section: PREFIX + FIELD
            out[dotted] = (env_prefix + name).upper()
    return out


# ----------------------------------------------------------------------------- recipes


def read_yaml(path: Path) -> dict[str, Any]:
    """A YAML mapping (an empty file is ``{}``); anything else is a clear error."""
    path = Path(path)
    try:
        loaded = yaml.safe_load(path.read_text())
    except OSError as e:
        raise RecipeError(f"cannot read {path}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise RecipeError(f"{path} is not valid YAML: {e}") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise RecipeError(f"{path} must hold a mapping of option: value")
    return loaded


def load_recipe(path: Path, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Read a recipe (following ``base:``), expand ``${VAR}`` in its strings, check its
    top-level keys (shared keys, sections, doc keys)."""
    path = Path(path)
    if path.resolve() in _seen:
        raise RecipeError(f"{path}: 'base' loops back to itself ({' -> '.join(map(str, _seen))})")
    recipe = read_yaml(path)
    allowed = {k.split(".")[0] for k in SHARED} | set(SECTIONS) | set(DOC_KEYS) | {BASE_KEY}
    for key, value in recipe.items():
        if key not in allowed:
            raise RecipeError(
                f"{path}: unknown top-level key {key!r} (expected one of {sorted(allowed)})"
            )
        if key in SHARED_GROUPS:
            _check_group(path, key, value)
        if key in SECTIONS and value is not None and not isinstance(value, dict):
            raise RecipeError(f"{path}: section {key!r} must be a mapping")
    recipe = expand_vars(recipe, path)
    base = recipe.pop(BASE_KEY, None)
    if base is None:
        return recipe
    if not isinstance(base, str):
        raise RecipeError(f"{path}: 'base' must be the path of another recipe")
    parent = load_recipe(path.parent / base, (*_seen, path.resolve()))
    return _deep_merge(parent, recipe)


def _deep_merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if key != "rewards" and isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def recipe_variables() -> dict[str, str]:
    """Variables a recipe may use besides the environment (they win over it): the project's
    default locations, which already honour ``$SHOP_R1_ARTIFACTS``."""
    from launch import paths

    return {"REPO_ROOT": str(paths.REPO_ROOT), "ARTIFACTS": str(paths.ARTIFACTS),
            "RUNS_DIR": str(paths.RUNS_DIR)}  # fmt: skip


def expand_vars(value: Any, path: Path, where: str = "") -> Any:
    """``${NAME}`` / ``${NAME:-default}`` in every string of ``value``; an unset variable
    without a default is an error naming the key and the file."""
    if isinstance(value, dict):
        return {k: expand_vars(v, path, f"{where}{k}.") for k, v in value.items()}
    if isinstance(value, list):
        return [expand_vars(v, path, where) for v in value]
    if not isinstance(value, str) or "${" not in value:
        return value
    names = recipe_variables()

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


def _check_group(path: Path, key: str, value: Any) -> None:
    if not isinstance(value, dict):
        raise RecipeError(f"{path}: {key!r} must be a mapping")
    known = sorted(k.split(".", 1)[1] for k in SHARED if k.startswith(key + "."))
    for sub in value:
        if sub not in known:
            raise RecipeError(f"{path}: unknown key '{key}.{sub}' (expected one of {known})")


def _shared_items(recipe: Mapping[str, Any]) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in recipe.items():
        if key in SHARED_GROUPS:
            flat |= {f"{key}.{k}": v for k, v in value.items()}
        elif key in SHARED:
            flat[key] = value
    return flat


def section_values(
    recipe: Mapping[str, Any], section: str, cls: type[BaseModel] | None, path: Path
) -> dict[str, Any]:
    """What service ``section`` (``api``, ``env``, ``trainer.sft``, ``trainer.grpo``,
    ``vllm``) reads from a recipe: the shared keys mapped onto its fields, then its section.

    With ``cls`` the keys are checked against its fields (unknown key: error naming the key
    and the file); without (``vllm``) they are returned as written.
    """
    top, _, command = section.partition(".")
    fields = set(cls.model_fields) if cls is not None else None
    values: dict[str, Any] = {}
    for key, value in _shared_items(recipe).items():
        target = SHARED[key].get(top)
        if target is None:
            continue
        name, _, template = target.partition("=")
        if fields is not None and name not in fields:
            continue
        values[name] = template.format(value) if template and value is not None else value
    body = dict(recipe.get(top) or {})
    if top == "trainer":
        subs = {c: body.pop(c, None) or {} for c in TRAINER_COMMANDS}
        for c, sub in subs.items():
            if not isinstance(sub, dict):
                raise RecipeError(f"{path}: section 'trainer.{c}' must be a mapping")
        layers = [("trainer", body), (section, subs.get(command, {}))]
    else:
        layers = [(top, body)]
    for where, layer in layers:
        layer = _snake_keys(layer)
        if cls is not None:
            check_keys(cls, layer, f"{path}: {where}")
        values |= layer
    return values


def _snake_keys(d: Mapping[str, Any]) -> dict[str, Any]:
    return {str(k).replace("-", "_"): v for k, v in d.items()}


def check_keys(cls: type[BaseModel], values: Mapping[str, Any], where: str) -> None:
    """Every key must be a field of ``cls`` (nested models recursively)."""
    for key, value in values.items():
        info = cls.model_fields.get(key)
        if info is None:
            raise RecipeError(
                f"{where}: unknown key {key!r} for {cls.__name__} "
                f"(valid keys: {', '.join(sorted(cls.model_fields))})"
            )
        sub = _model_type(info.annotation)
        if sub is not None and isinstance(value, dict):
            check_keys(sub, _snake_keys(value), f"{where}.{key}")


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
        sub = _model_type(info.annotation) if info is not None else None
        if sub is not None and isinstance(value, dict) and isinstance(base.get(key), dict):
            merged = dict(base[key])
            _merge(merged, _snake_keys(value), sub)
            base[key] = merged
        else:
            base[key] = value


def _drop_replaced_alternatives(
    cls: type[BaseModel], values: dict[str, Any], sources: dict[str, str], layer: Mapping[str, Any]
) -> None:
    """A layer that sets one field of an ``exclusive_fields`` group (a ``ClassVar`` of the
    config: tuples of alternative ways to give the same setting) replaces the whole group: what
    an earlier layer set through another member is dropped, so ``--reward-variant no_dars`` on
    the command line overrides a recipe's ``rewards:`` instead of clashing with it."""
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
    layers: list[tuple[str, dict[str, Any]]] = []
    if recipe is not None:
        layers.append(
            (f"recipe {recipe}", section_values(load_recipe(recipe), section, cls, recipe))
        )
    if config is not None:
        flat = _snake_keys(read_yaml(config))
        check_keys(cls, flat, str(config))
        layers.append((f"config {config}", flat))
    layers.append(("environment", env_values(cls, environ)))
    layers.append(("flag", dict(flags or {})))
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


def resolve_args(cls: type[M], ns: argparse.Namespace, section: str) -> Resolved:
    """:func:`resolve` from a namespace built by a parser with :func:`add_config_flags`."""
    return resolve(
        cls, section=section, recipe=getattr(ns, "recipe", None),
        config=getattr(ns, "config", None), flags=flag_values(cls, ns),
    )  # fmt: skip


def parse(
    cls: type[M], argv: Sequence[str] | None, *, prog: str, section: str,
    aliases: Mapping[str, Sequence[str]] | None = None,
) -> Resolved:  # fmt: skip
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
    cls: type[M], argv: Sequence[str] | None, *, prog: str, section: str,
    aliases: Mapping[str, Sequence[str]] | None = None,
) -> M:  # fmt: skip
    """:func:`parse`, config only."""
    return parse(cls, argv, prog=prog, section=section, aliases=aliases).config


# ----------------------------------------------------------------------------- reporting

SECRET_WORDS = ("password", "secret", "api_key")


def _mask(key: str, value: Any) -> Any:
    """Hide secrets: ``token``/``*_token`` fields and names with a secret word (not
    ``tokenizer`` or ``max_tokens``)."""
    key = key.lower()
    secret = key == "token" or key.endswith("_token") or any(w in key for w in SECRET_WORDS)
    return "***" if secret and value is not None else value


def report(resolved: Resolved) -> str:
    """The resolved config as YAML (secrets masked), then where the non-default values came
    from; services log it at start so a run's log says exactly what it ran with."""
    data = resolved.config.model_dump(mode="json")
    data = {k: _mask(k, v) for k, v in data.items()}
    text = yaml.safe_dump(data, sort_keys=False, default_flow_style=False, width=100)
    set_by = [f"  {k}: {v}" for k, v in sorted(resolved.sources.items())]
    return text + ("# set by:\n" + "\n".join("#" + s for s in set_by) if set_by else "")
