"""Layered resolution of one nested config (``launch.run_config.RunConfig`` or a single
service's section), lowest first: field defaults < file < environment < command line
(docs/RECIPES.md). The environment and the command line are read by pydantic-settings'
own sources: ``SHOP_R1_<SECTION>__<FIELD>`` variables (plus the names a field declares with
``settings.flags.from_env``) and dotted ``--section.field value`` flags.

Each layer is a nested mapping; top-level shortcut keys (:data:`SHORTCUTS`) fill the fields
they stand for inside their own layer, where it does not set them itself, and so do a
class's setter aliases (``clip_eps``: :func:`expand_setters`, called by :func:`merge`). A service started
on its own reads its section the same way (``settings.cli``). Imports neither torch nor
any service package.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from pydantic_settings import EnvSettingsSource

from settings.flags import env_names, set_dotted, setter_paths
from settings.recipe import RecipeError, model_type

M = TypeVar("M", bound=BaseModel)
ENV_PREFIX = "SHOP_R1_"
Layer = tuple[str, Mapping[str, Any]]

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
        obj = self.config
        for part in path.split("."):
            obj = getattr(obj, part)
        n = len(path) + 1
        return Resolved(obj, {k[n:]: v for k, v in self.sources.items() if k[:n] == path + "."})


def _get(d: Mapping[str, Any], dotted: str) -> tuple[bool, Any]:
    for part in dotted.split("."):
        if not isinstance(d, Mapping) or part not in d:
            return False, None
        d = d[part]
    return True, d


def _setdefault(d: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    for p in parents:
        d = d.setdefault(p, {})
    if last not in d:  # first: a shortcut's vLLM argument goes before the section's own
        items = list(d.items())
        d.clear()
        d[last] = value
        d.update(items)


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
        given, value = _get(out, key)
        for target in targets if given else ():
            path, _, template = target.partition("=")
            if template == "not":
                value_at = not value
            else:
                value_at = template.format(value) if template and value is not None else value
            _setdefault(out, path, value_at)
    return out


def _record(sources: dict[str, str], prefix: str, value: Any, label: str) -> None:
    if isinstance(value, Mapping) and value:
        for k, v in value.items():
            _record(sources, f"{prefix}.{k}", v, label)
    else:
        sources[prefix] = label


def expand_setters(cls: type[BaseModel] | None, layer: Mapping[str, Any]) -> Mapping[str, Any]:
    """``layer`` with each of ``cls.setter_aliases`` it gives (``clip_eps``) replaced by the
    fields that name sets, except those the layer sets itself: an explicit ``clip_low`` beats
    ``clip_eps`` in one layer, and a higher layer's ``clip_eps`` beats a lower one's
    ``clip_low``. ``None`` sets nothing (files written while ``clip_eps`` was a field)."""
    setters = getattr(cls, "setter_aliases", {})
    if not any(name in layer for name in setters):
        return layer
    out = dict(layer)
    for name, targets in setters.items():
        value = out.pop(name, None)
        for target in targets if value is not None else ():
            out.setdefault(target, value)
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
    layer that sets one field of a class's ``exclusive_fields`` group drops the others; setter
    aliases are resolved here, the one place every layer goes through (:func:`expand_setters`)."""
    over = expand_setters(cls, over)
    for group in getattr(cls, "exclusive_fields", ()):
        if any(k in over for k in group):
            for k in (k for k in group if k not in over):
                base.pop(k, None)
                for s in [s for s in sources if s == prefix + k or s.startswith(prefix + k + ".")]:
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


def resolve(cls: type[M], layers: Sequence[Layer]) -> Resolved:
    """Merge ``(label, values)`` layers, lowest first, and validate (a clear error naming the
    layers)."""
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
    """The environment's values for ``cls`` (the section at dotted ``path`` of a run):
    ``SHOP_R1_<PATH>__<FIELD>`` by pydantic-settings' convention (``__`` between levels), then
    the variables fields declare (``SHOP_R1_API_TOKEN``, ``GAIL_USE``, ...), which win. A
    setter alias reads its own (``SHOP_R1_TRAINER__GRPO__CLIP_EPS``)."""
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
            _setdefault(out, dotted, value)
    for dotted, name in env_names(cls).items():  # the declared names win
        if environ.get(name):
            set_dotted(out, dotted, environ[name])
    return out
