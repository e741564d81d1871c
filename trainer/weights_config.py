"""``trainer.grpo.weights``: how new weights reach vLLM after each step, one member per
transport, chosen by its ``type`` (``broadcast``, ``single_copy``, ``lora``, ``reload``;
trainer/bridge/ holds one class per transport). Each member holds only its own fields, so a
field of another transport (``reload_every`` with ``broadcast``) is refused when the file is
read, naming the key. The old pair ``weight_bridge_mode`` (``shared_vllm``, ``lora_only``,
``none``) + ``single_copy`` still sets it, layer by layer (:func:`fold_old_keys`), as do
``reload_every``/``vllm_restart_interval`` (:data:`OLD_KEYS`). :class:`SyncDeadlines`: how long
each phase of a sync may wait, whatever the transport. Imports no torch."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, TypeAdapter, ValidationError

from settings.layers import RecipeError
from vllm_patching.protocol import BridgeMode


class _Weights(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    mode: ClassVar[BridgeMode] = "shared_vllm"
    """The old ``weight_bridge_mode`` of this transport (what the vLLM server is started with)."""
    single_copy: ClassVar[bool] = False
    """The old ``single_copy`` of this transport."""


class BroadcastWeights(_Weights):
    """The trainer packs its weights and broadcasts them to every vLLM worker (gloo on CPU,
    vLLM's ``nccl`` engine on CUDA); vLLM keeps its own copy."""

    type: Literal["broadcast"] = "broadcast"
    """Which transport."""


class SingleCopyWeights(_Weights):
    """Trainer and vLLM on one device share one copy of the weights (/dev/shm on CPU, CUDA
    IPC handles on CUDA): one server, one GPU."""

    single_copy: ClassVar[bool] = True
    type: Literal["single_copy"] = "single_copy"
    """Which transport."""


class LoraWeights(_Weights):
    """Only a LoRA adapter moves: saved each step, loaded by vLLM as a new adapter version."""

    mode: ClassVar[BridgeMode] = "lora_only"
    type: Literal["lora"] = "lora"
    """Which transport."""


class ReloadWeights(_Weights):
    """The full model is saved (safetensors) and vLLM reloads it in place."""

    mode: ClassVar[BridgeMode] = "none"
    type: Literal["reload"] = "reload"
    """Which transport."""
    reload_every: int = Field(1, ge=1)
    """Reload the saved weights every N steps (Atropos: ``--vllm-restart-interval``)."""


MEMBERS: tuple[type[_Weights], ...] = (
    BroadcastWeights,
    SingleCopyWeights,
    LoraWeights,
    ReloadWeights,
)
BY_TYPE = {m.model_fields["type"].default: m for m in MEMBERS}
"""``weights.type`` -> its member."""
BY_MODE = {(m.mode, m.single_copy): t for t, m in BY_TYPE.items()}
"""The old pair ``(weight_bridge_mode, single_copy)`` -> ``weights.type``."""


def _tag(value: Any) -> str | None:
    """A transport's member: its ``type``, ``broadcast`` when a layer gives none."""
    if isinstance(value, dict):
        return value.get("type", "broadcast")
    return getattr(value, "type", None)


WeightTransport = Annotated[
    Annotated[BroadcastWeights, Tag("broadcast")]
    | Annotated[SingleCopyWeights, Tag("single_copy")]
    | Annotated[LoraWeights, Tag("lora")]
    | Annotated[ReloadWeights, Tag("reload")],
    Discriminator(
        _tag,
        custom_error_type="weights_type",
        custom_error_message=(
            f"weights.type (old keys: weight_bridge_mode, single_copy) is one of {', '.join(BY_TYPE)}"
        ),
    ),
]
"""``weights: {type: broadcast|single_copy|lora|reload, ...}``: a key the member lacks is
refused, named."""

OLD_KEYS = {"reload_every": "weights.reload_every", "vllm_restart_interval": "weights.reload_every"}
"""``trainer.grpo``'s keys of the ``reload`` transport before it was a section."""
PAIR = ("weight_bridge_mode", "single_copy")
"""The old keys that together choose the member (:func:`fold_old_keys`)."""


def old_pair_tag(mode: Any, single_copy: Any, where: str = "") -> str:
    """``weights.type`` of the old pair; an impossible pair (``single_copy`` with another
    mode than ``shared_vllm``) or a wrong value is refused, naming the key."""
    try:
        mode = TypeAdapter(BridgeMode).validate_python(mode)
    except ValidationError:
        raise ValueError(
            f"{where}weight_bridge_mode is one of shared_vllm, lora_only, none, got {mode!r}"
        ) from None
    try:
        single_copy = TypeAdapter(bool).validate_python(single_copy)
    except ValidationError:
        raise ValueError(f"{where}single_copy must be true or false, got {single_copy!r}") from None
    if (mode, single_copy) not in BY_MODE:
        raise ValueError(
            f"{where}single_copy: true only applies to weight_bridge_mode shared_vllm "
            f"(weights.type single_copy), not {mode} (weights.type {BY_MODE[(mode, False)]})"
        )
    return BY_MODE[(mode, single_copy)]


def _section(layer: Any, path: Sequence[str]) -> Any:
    for part in path:
        layer = layer.get(part) if isinstance(layer, Mapping) else None
    return layer


def fold_old_keys(
    layers: Sequence[tuple[str, Mapping[str, Any]]], path: Sequence[str]
) -> list[tuple[str, Mapping[str, Any]]]:
    """Run layers (lowest first) with the old pair at ``path`` (``trainer.grpo``) replaced by
    ``weights.type``: each layer's pair completed by what the layers below chose, so a layer
    giving only ``single_copy: true`` over another's ``weight_bridge_mode: shared_vllm`` is
    ``single_copy``, whichever spelling each layer uses. A pair that is impossible, or a
    layer giving the old pair and another ``weights.type``, is refused naming the keys."""
    mode, single, out = "shared_vllm", False, []
    where = ".".join(path) + "." if path else ""
    for label, layer in layers:
        section = _section(layer, path)
        weights = section.get("weights") if isinstance(section, Mapping) else None
        given = weights.get("type") if isinstance(weights, Mapping) else None
        if not isinstance(section, Mapping) or not set(PAIR) & section.keys():
            if isinstance(given, str) and given in BY_TYPE:
                mode, single = BY_TYPE[given].mode, BY_TYPE[given].single_copy
            out.append((label, layer))
            continue
        section = dict(section)
        mode = section.pop("weight_bridge_mode", mode)
        single = section.pop("single_copy", single)
        try:
            tag = old_pair_tag(mode, single, where)
        except ValueError as e:
            raise RecipeError(f"{label}: {e}") from None
        mode, single = BY_TYPE[tag].mode, BY_TYPE[tag].single_copy
        if given is not None and given != tag:
            raise RecipeError(
                f"{label}: {where}weights.type {given} and the old {where}weight_bridge_mode/"
                f"single_copy ({tag}) are one setting: give it once ({where}weights.type)"
            )
        section["weights"] = {**(weights if isinstance(weights, Mapping) else {}), "type": tag}
        out.append((label, _replaced(layer, path, section)))
    return out


def _replaced(layer: Mapping[str, Any], path: Sequence[str], section: Any) -> dict[str, Any]:
    """``layer`` with ``section`` at ``path`` (the rest shared, not copied)."""
    if not path:
        return section
    return {**layer, path[0]: _replaced(layer[path[0]], path[1:], section)}


def with_old_keys(data: Any) -> Any:
    """``trainer.grpo``'s values with the old pair and ``reload_every`` moved into
    ``weights`` (``GrpoConfig`` built in Python: ``GrpoConfig(weight_bridge_mode="none")``);
    one setting given both ways is refused, naming both keys."""
    if not isinstance(data, dict) or not {*PAIR, *OLD_KEYS} & data.keys():
        return data
    data, weights = dict(data), data.get("weights")
    if isinstance(weights, BaseModel):
        weights = {"type": getattr(weights, "type", None), **weights.model_dump(exclude_unset=True)}
    weights = dict(weights) if isinstance(weights, Mapping) else {}
    if set(PAIR) & data.keys():
        mode = data.pop("weight_bridge_mode", None)
        single = data.pop("single_copy", None)
        if mode is None and single is None:  # the fields' own unset value
            pass
        else:
            given = weights.get("type")
            base = BY_TYPE.get(given or "broadcast", BroadcastWeights)
            tag = old_pair_tag(
                base.mode if mode is None else mode, base.single_copy if single is None else single
            )
            if given is not None and given != tag:
                raise ValueError(
                    f"weights.type {given} and weight_bridge_mode/single_copy ({tag}) are one "
                    "setting: give it once (weights.type)"
                )
            weights["type"] = tag
    for old, new in OLD_KEYS.items():
        key = new.split(".", 1)[1]
        if old in data:
            if key in weights:
                raise ValueError(f"{old} and {new} are one setting: give it once ({new})")
            weights[key] = data.pop(old)
    return {**data, "weights": weights}


class SyncDeadlines(BaseModel):
    """Seconds each phase of a weight sync may wait on an inference server before the sync
    fails with an error naming the phase, the server and the deadline (docs/BRIDGE.md,
    docs/FAULT_TOLERANCE.md). Flags: ``--sync-deadline.apply 60``."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    check: float = Field(30.0, gt=0)
    """A server's /bridge/health or /bridge/info (its run_id and version)."""
    connect: float = Field(120.0, gt=0)
    """Setting the data plane up: /init_weight_transfer_engine and the gloo rendezvous."""
    stage: float = Field(60.0, gt=0)
    """/bridge/stage: the receivers on other hosts start listening (broadcast)."""
    transfer: float = Field(300.0, gt=0)
    """The gloo broadcast of the packed weights to receivers on other hosts."""
    apply: float = Field(300.0, gt=0)
    """Pause, load, set the version, resume: /bridge/apply, /bridge/reload, /bridge/lora/load."""
    close: float = Field(30.0, gt=0)
    """/shutdown_weight_transfer_engine when the trainer drops its data plane."""

    def of(self, phase: str) -> float:
        return float(getattr(self, phase))

    def group_s(self) -> float:
        """The gloo group's own timeout (trainer and workers): the longest of its waits, so
        a call abandoned by the trainer, or left in a woken worker, ends by itself."""
        return max(self.connect, self.transfer)
