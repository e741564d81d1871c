"""Layered resolution of a run's ``launch.run_config.RunConfig`` (docs/RECIPES.md), lowest
first: field defaults < files < environment < command line. A shortcut (``model``, ``seed``,
...) fills its fields inside its own layer, where that layer does not set them itself."""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from pydantic_settings import EnvSettingsSource

from settings.recipe import RecipeError, recipe_chain

M = TypeVar("M", bound=BaseModel)
Layer = tuple[str, Mapping[str, Any]]
SHORTCUTS: dict[str, tuple[str, ...]] = {
    "model": ("trainer.grpo.model_name", "env.tokenizer", "vllm.model"),
    "seed": ("trainer.sft.seed", "trainer.grpo.seed", "env.seed", "vllm.seed"),
    "weight_bridge_mode": ("trainer.grpo.weight_bridge_mode", "vllm.weight_bridge_mode"),
    "single_copy": ("trainer.grpo.single_copy", "vllm.single_copy"),
    "training_steps": ("trainer.grpo.training_steps",),
    "sft_steps": ("trainer.sft.training_steps",),
    "num_sessions": ("trainer.sft.num_sessions", "env.num_sessions"),
    "keep_constant_groups": ("env.drop_constant_groups",),  # negated
}
"""Top-level keys of a run and the fields they fill."""
RUN_KEYS = {"name", "description", "preset", "recipe", "env_args", "trainer_args", *SHORTCUTS}
RUN_KEYS |= {"base", "launch", "api", "env", "trainer", "vllm"}
"""A run file's top-level keys (``RunConfig``'s fields and ``base``)."""
REWARD_KEYS = {"rewards", "reward", "reward_variant"}
"""``env``'s three ways to give the reward: a layer giving one drops the lower layers' others."""


def env_default(name: str, default: Any = None) -> Callable[[], Any]:
    """A field's ``default_factory``: environment variable ``name`` when set, else ``default``."""
    return lambda: os.environ.get(name) or default


def expand(layer: Mapping[str, Any]) -> dict[str, Any]:
    """``layer`` with its ``trainer:`` keys beside ``sft:``/``grpo:`` moved into both, and
    each shortcut filling its fields where the layer does not set them."""
    out = copy.deepcopy(dict(layer))
    if isinstance(trainer := out.get("trainer"), dict):
        common = {k: v for k, v in trainer.items() if k not in ("sft", "grpo")}
        sub = {c: trainer.get(c) or {} for c in ("sft", "grpo")}
        out["trainer"] = {c: {**common, **v} if isinstance(v, dict) else v for c, v in sub.items()}
    for key, targets in SHORTCUTS.items():
        for *parents, last in (t.split(".") for t in targets) if key in out else ():
            d = out
            for p in parents:
                d = d.setdefault(p, {}) if isinstance(d, dict) else None
            if isinstance(d, dict):
                d.setdefault(last, not out[key] if key == "keep_constant_groups" else out[key])
    return out


def file_layers(path: Path) -> list[Layer]:
    """A run file, one layer per file of its ``base:`` chain (its unknown top-level keys are
    an error: a service reads only its own section)."""
    layers: list[Layer] = []
    for file, data in recipe_chain(path):
        if unknown := sorted(data.keys() - RUN_KEYS):
            raise RecipeError(f"{file}: unknown top-level key {unknown[0]!r} of {sorted(RUN_KEYS)}")
        layers.append((f"file {file}", expand(data)))
    return layers


def nest(section: str, values: Any) -> Any:
    """``values`` placed at dotted ``section`` of a run (``trainer.grpo``)."""
    for part in reversed(section.split(".") if section else []):
        values = {part: values}
    return values


def merge(base: dict[str, Any], over: Mapping[str, Any], path: str = "") -> dict[str, Any]:
    """``over`` onto ``base``, mappings key by key (``rewards`` whole; see ``REWARD_KEYS``)."""
    if path == "env" and REWARD_KEYS & over.keys():
        for key in REWARD_KEYS - over.keys():
            base.pop(key, None)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(base.get(key), dict) and key != "rewards":
            merge(base[key], value, f"{path}.{key}".lstrip("."))
        else:
            base[key] = copy.deepcopy(value)
    return base


def env_layer(
    cls: type[BaseModel], section: str = "", environ: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """The run's ``SHOP_R1_<SECTION>__<FIELD>`` variables (pydantic-settings' convention) for
    ``cls``, the run's ``section``."""
    prefix = "SHOP_R1_" + "".join(f"{p.upper()}__" for p in section.split(".") if p)
    source = EnvSettingsSource(cls, env_prefix=prefix, env_nested_delimiter="__")
    if environ is not None:
        source.env_vars = {k.lower(): v for k, v in environ.items()}
    return nest(section, values) if (values := source()) else {}


def has_path(layer: Any, path: Sequence[Any]) -> bool:
    """Whether ``layer`` sets the value at ``path`` (``("env", "seed")``)."""
    for part in path:
        if not isinstance(layer, Mapping) or part not in layer:
            return False
        layer = layer[part]
    return layer != {}


def resolve(cls: type[M], layers: Sequence[Layer], section: str = "") -> M:
    """``(label, values)`` run layers merged, lowest first, and ``section`` of them (all:
    ``""``) validated as ``cls``; an error names each wrong key and the highest layer that set
    it."""
    values: Any = {}
    for _, layer in layers:
        merge(values, layer)
    for part in section.split(".") if section else []:
        values = values.get(part, {}) if isinstance(values, Mapping) else values
    try:
        return cls.model_validate({} if values is None else values)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            loc, origin = (
                (*(section.split(".") if section else []), *err["loc"]),
                [],
            )  # the key a layer sets (a union adds a member's name)
            while loc and not (origin := [n for n, layer in layers if has_path(layer, loc)]):
                loc = loc[:-1]
            where = ".".join(map(str, loc or err["loc"]))
            lines.append(f"{where} (set by {(origin or ['defaults'])[-1]})\n  {err['msg']}")
            shown = origin and not isinstance(err["input"], Mapping)  # no section, no secret
            lines[-1] += f" [input: {str(err['input'])[:80]!r}]" if shown else ""
        raise RecipeError(f"invalid {e.title}:\n" + "\n".join(lines)) from None
