"""Layered resolution of one nested config (``launch.run_config.RunConfig`` or one service's
section), lowest first: field defaults < file < environment < command line; shortcuts and
setter aliases fill their fields inside their own layer (docs/RECIPES.md). Imports neither
torch nor any service package."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import reduce
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from pydantic_settings import EnvSettingsSource

from settings.flags import env_values, set_dotted, setter_paths
from settings.recipe import RecipeError, model_type

M = TypeVar("M", bound=BaseModel)
ENV_PREFIX = "SHOP_R1_"
Layer = tuple[str, Mapping[str, Any]]
_UNSET = object()

SHORTCUTS: dict[str, tuple[str, ...]] = {
    "model": ("trainer.sft.model_name", "trainer.grpo.model_name", "env.tokenizer", "vllm.model"),
    "seed": ("trainer.sft.seed", "trainer.grpo.seed", "env.seed", "vllm.seed"),
    "output_dir": (
        "trainer.sft.save_path",
        "trainer.grpo.save_path",
        "api.db_path={}/api.sqlite",
        "env.metrics_path={}/env_metrics.jsonl",
        "vllm.bridge_config={}/vllm_bridge_config.json",
    ),
    "data.dir": ("trainer.sft.data_dir", "env.data_dir"),
    "data.num_sessions": ("trainer.sft.num_sessions", "env.num_sessions"),
    "rewards": ("env.rewards",),
    "weight_bridge_mode": ("trainer.grpo.weight_bridge_mode", "vllm.weight_bridge_mode"),
    "single_copy": ("trainer.grpo.single_copy", "vllm.single_copy"),
    "logging.wandb_project": ("trainer.sft.wandb_project", "trainer.grpo.wandb_project"),
    "logging.tensorboard": ("trainer.sft.tensorboard", "trainer.grpo.tensorboard"),
    "logging.log_level": ("api.log_level",),
    "training_steps": ("trainer.grpo.training_steps",),
    "sft_steps": ("trainer.sft.training_steps",),
    "num_sessions": ("trainer.sft.num_sessions", "env.num_sessions"),
    "keep_constant_groups": ("env.drop_constant_groups=not",),
}
"""Top-level keys and the fields they fill (``field={}/file``: a file in that directory;
``=not``: negated). The section's own value in the same layer wins over the shortcut."""


@dataclass
class Resolved:
    """A validated config plus, per dotted field, the layer that set it."""

    config: Any
    sources: dict[str, str] = field(default_factory=dict)

    def section(self, path: str) -> Resolved:
        """The section at dotted ``path`` with its own sources (``trainer.grpo``)."""
        n = len(path) + 1
        return Resolved(
            reduce(getattr, path.split("."), self.config),
            {k[n:]: v for k, v in self.sources.items() if k[:n] == path + "."},
        )


def snake(value: Any, key: str = "") -> Any:
    """Keys ``max-tokens`` -> ``max_tokens`` at every level (reward entries kept as written)."""
    if isinstance(value, Mapping) and key != "rewards":
        return {str(k).replace("-", "_"): snake(v, str(k)) for k, v in value.items()}
    return value


def expand(layer: Mapping[str, Any], shortcuts: Mapping[str, Sequence[str]]) -> dict[str, Any]:
    """``layer`` with its shortcut keys filled in where it does not set the field itself, and
    ``trainer:`` keys given beside ``sft:``/``grpo:`` moved into both."""
    out = snake(dict(layer))
    trainer = out.get("trainer")
    if isinstance(trainer, dict):
        common = {k: v for k, v in trainer.items() if k not in ("sft", "grpo")}
        out["trainer"] = {c: {**common, **(trainer.get(c) or {})} for c in ("sft", "grpo")}
    for key, targets in reversed(shortcuts.items()):
        value: Any = out
        for part in key.split("."):
            value = value.get(part, _UNSET) if isinstance(value, Mapping) else _UNSET
        for target in targets if value is not _UNSET else ():
            path, _, template = target.partition("=")
            if template == "not":
                value_at = not value
            else:
                value_at = template.format(value) if template and value is not None else value
            set_dotted(out, path, value_at, first=True)
    return out


def merge(
    base: dict[str, Any],
    over: Mapping[str, Any],
    cls: type[BaseModel] | None,
    label: str,
    sources: dict[str, str],
    prefix: str = "",
) -> None:
    """``over`` onto ``base``: mappings merge key by key (``rewards`` is replaced whole); a
    layer that sets one field of a class's ``exclusive_fields`` group drops the others; each
    setter alias (``clip_eps``) sets the fields it names that the layer does not set itself."""
    over = dict(over)
    for name, targets in getattr(cls, "setter_aliases", {}).items():
        value = over.pop(name, None)  # None sets nothing (files of when clip_eps was a field)
        for target in targets if value is not None else ():
            over.setdefault(target, value)
    for group in getattr(cls, "exclusive_fields", ()):
        if any(k in over for k in group):
            for k in (k for k in group if k not in over):
                base.pop(k, None)
                for s in [s for s in sources if s == prefix + k or s.startswith(f"{prefix}{k}.")]:
                    del sources[s]
    for key, value in over.items():
        info = cls.model_fields.get(key) if cls is not None else None
        sub = model_type(info.annotation) if info is not None else None
        if sub is not None and isinstance(value, Mapping) and not isinstance(base.get(key), dict):
            base[key] = {}  # a section: merged key by key, so its setter aliases resolve
        if key != "rewards" and isinstance(value, Mapping) and isinstance(base.get(key), dict):
            merge(base[key], value, sub, label, sources, f"{prefix}{key}.")
        else:
            base[key] = dict(value) if isinstance(value, Mapping) else value
            _record(sources, prefix + key, value, label)


def _record(sources: dict[str, str], prefix: str, value: Any, label: str) -> None:
    if isinstance(value, Mapping) and value:
        for k, v in value.items():
            _record(sources, f"{prefix}.{k}", v, label)
    else:
        sources[prefix] = label


def resolve(cls: type[M], layers: Sequence[Layer]) -> Resolved:
    """Merge ``(label, values)`` layers, lowest first, and validate (an error names them)."""
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for label, layer in layers:
        merge(values, layer, cls, label, sources)
    try:
        return Resolved(cls.model_validate(values), sources)
    except ValidationError as e:
        origin = ", ".join(label for label, layer in layers if layer) or "defaults"
        raise RecipeError(f"invalid {cls.__name__} (from {origin}):\n{e}") from None


def env_layer(
    cls: type[BaseModel], path: str = "", environ: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """The environment's values for ``cls``, the section at dotted ``path`` of a run:
    ``SHOP_R1_<PATH>__<FIELD>`` (a setter alias too), then the names fields declare, which win."""
    environ = os.environ if environ is None else environ
    prefix = ENV_PREFIX + "".join(p.upper() + "__" for p in path.split(".") if p)
    source = EnvSettingsSource(
        cls, env_prefix=prefix, env_nested_delimiter="__", case_sensitive=False
    )
    source.env_vars = {k.lower(): v for k, v in environ.items()}
    out = snake(source())
    for dotted in setter_paths(cls):  # no field, so pydantic-settings skips it at the top
        value = source.env_vars.get((prefix + dotted.replace(".", "__")).lower())
        if value:
            set_dotted(out, dotted, value, first=True)
    return env_values(cls, environ, out)
