"""The trainer's weights in HF checkpoint format, as the server expects them."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from vllm_patching.transport import TensorMeta, dtype_name, torch_dtype


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """Strip DDP / torch.compile wrappers (a peft model stays: see :func:`hf_parameters`)."""
    for attr in ("module", "_orig_mod"):
        while hasattr(model, attr) and isinstance(getattr(model, attr), torch.nn.Module):
            model = getattr(model, attr)
    return model


def _peft_base(model: torch.nn.Module) -> torch.nn.Module | None:
    """The HF model inside a peft model (LoRA layers injected in place), else None."""
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover - peft is a requirement
        return None
    return model.get_base_model() if isinstance(model, PeftModel) else None


def _lora_entry(base: torch.nn.Module, name: str, active: list[str]) -> tuple[str, Any] | None:
    """A peft parameter name -> (HF name, LoRA layer to merge from or None); None = skip.

    ``...q_proj.base_layer.weight`` -> ``...q_proj.weight`` merged with that layer's active
    adapters; ``lora_A/lora_B/...`` are dropped; a ``modules_to_save`` copy of the active
    adapter replaces its original module.
    """
    from peft.tuners.lora import LoraLayer

    parts = name.split(".")
    if any(p.startswith("lora_") for p in parts) or "original_module" in parts:
        return None
    if "modules_to_save" in parts:
        i = parts.index("modules_to_save")
        if parts[i + 1] not in active:
            return None
        parts = parts[:i] + parts[i + 2 :]
    if "base_layer" not in parts:
        return ".".join(parts), None
    i = parts.index("base_layer")
    layer = base.get_submodule(".".join(parts[:i]))
    if not isinstance(layer, LoraLayer):
        raise ValueError(
            f"{name}: only LoRA adapters can be merged for a full-weight sync, "
            f"not {type(layer).__name__} (use --weight-bridge-mode lora_only)"
        )
    for a in active:
        if layer.use_dora.get(a) or getattr(layer, "lora_bias", {}).get(a):
            raise ValueError(
                f"{name}: DoRA / LoRA-bias adapters are not merged for a full-weight sync "
                "(use --weight-bridge-mode lora_only, or plain LoRA)"
            )
    parts = parts[:i] + parts[i + 1 :]
    return ".".join(parts), (layer if parts[-1] == "weight" else None)


def _entries(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter, Any]]:
    """``(hf_name, parameter, lora layer or None)`` for every weight vLLM loads."""
    model = unwrap(model)
    base = _peft_base(model)
    if base is None:
        entries = [(n, p, None) for n, p in model.named_parameters()]
    else:
        active = list(model.active_adapters)
        entries = []
        for n, p in base.named_parameters():
            entry = _lora_entry(base, n, active)
            if entry is not None:
                entries.append((entry[0], p, entry[1]))
        model = base
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    return [e for e in entries if not (tied and e[0] == "lm_head.weight")]


@torch.no_grad()
def _merged(p: torch.nn.Parameter, layer: Any) -> torch.Tensor:
    """``W + sum of the active adapters' deltas`` (peft's own ``get_delta_weight``), out of
    place: the trainer's base weight is left untouched (no merge/unmerge rounding drift)."""
    w = p.detach()
    if layer is None or layer.merged:
        return w
    for a in layer.active_adapters:
        if a in layer.lora_A or a in getattr(layer, "lora_embedding_A", {}):
            w = w + layer.get_delta_weight(a).to(w.dtype)
    return w


def hf_parameters(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(hf_name, tensor)`` for every weight vLLM loads, in module order.

    Plain models give their parameters themselves. A peft (LoRA) model gives the HF names of
    its base model, each LoRA-wrapped weight merged with its adapters (a new tensor, computed
    now), so a full-weight sync of a LoRA run serves base + adapter (``lora_only`` instead
    ships the adapter alone).

    Module order keeps each decoder layer's tensors together, so every fused q/k/v and
    gate/up group arrives complete and vLLM processes a layer as soon as it has it. A tied
    ``lm_head.weight`` is skipped: checkpoints do not carry it and vLLM re-derives it.
    """
    return [(n, p if layer is None else _merged(p, layer)) for n, p, layer in _entries(model)]


def hf_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """:func:`hf_parameters` as detached tensors (the values, no autograd)."""
    return [(name, p.detach()) for name, p in hf_parameters(model)]


def iter_hf_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """:func:`hf_tensors` one at a time (a LoRA merge is computed when its tensor is due)."""
    for n, p, layer in _entries(model):
        yield n, _merged(p, layer)


def hf_shapes(model: torch.nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes of :func:`hf_tensors`, without computing any merge."""
    return [(n, tuple(p.shape)) for n, p, _ in _entries(model)]


def wire_metas(tensors: list[tuple[str, torch.Tensor]], dtype: str | None) -> list[TensorMeta]:
    """Metadata in the serving dtype (casting on the trainer halves bf16 traffic)."""
    if dtype is not None:
        torch_dtype(dtype)  # validate
    return [TensorMeta(n, dtype or dtype_name(t.dtype), tuple(t.shape)) for n, t in tensors]


def check_against_server(names: list[str], param_map: dict[str, Any]) -> None:
    """Refuse a sync that would leave part of the served model (or of a fused group) stale.

    The server's /bridge/info lists every HF name it loads (q/k/v and gate/up shards
    included); the trainer must send exactly that set.
    """
    sent, expected = set(names), set(param_map)
    missing, unknown = sorted(expected - sent), sorted(sent - expected)
    if missing or unknown:
        raise ValueError(
            "trainer model does not match the served model: "
            f"missing {missing[:8]}{'...' if len(missing) > 8 else ''}, "
            f"unknown {unknown[:8]}{'...' if len(unknown) > 8 else ''}"
        )
