"""Layered resolution of a run's ``launch.run_config.RunConfig`` (docs/RECIPES.md), lowest
first: field defaults < files < environment < command line. A shortcut (``model``, ``seed``,
...) fills its fields inside its own layer, where that layer does not set them itself."""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from pydantic_settings import EnvSettingsSource

from settings.recipe import RecipeError

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


def env_layer(cls: type[BaseModel], environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """``SHOP_R1_<SECTION>__<FIELD>`` variables (pydantic-settings' convention) of ``cls``."""
    source = EnvSettingsSource(
        cls, env_prefix="SHOP_R1_", env_nested_delimiter="__", case_sensitive=False
    )
    if environ is not None:
        source.env_vars = {k.lower(): v for k, v in environ.items()}
    return source()


def has_path(layer: Any, path: Sequence[Any]) -> bool:
    """Whether ``layer`` sets the value at ``path`` (``("env", "seed")``)."""
    for part in path:
        if not isinstance(layer, Mapping) or part not in layer:
            return False
        layer = layer[part]
    return True


def resolve(cls: type[M], layers: Sequence[Layer]) -> M:
    """``(label, values)`` layers merged, lowest first, and validated; an error names each
    wrong key and the highest layer that set it."""
    values: dict[str, Any] = {}
    for _, layer in layers:
        merge(values, layer)
    try:
        return cls.model_validate(values)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            loc, origin = err["loc"], []  # the key a layer sets (a union adds a member's name)
            while loc and not (origin := [n for n, layer in layers if has_path(layer, loc)]):
                loc = loc[:-1]
            where = ".".join(map(str, loc or err["loc"]))
            lines.append(f"{where} (set by {(origin or ['defaults'])[-1]})\n  {err['msg']}")
            shown = origin and not isinstance(err["input"], Mapping)  # no section, no secret
            lines[-1] += f" [input: {str(err['input'])[:80]!r}]" if shown else ""
        raise RecipeError(f"invalid {e.title}:\n" + "\n".join(lines)) from None
