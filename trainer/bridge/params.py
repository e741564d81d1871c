"""The trainer's weights in HF checkpoint format, as the server expects them."""

from __future__ import annotations

from typing import Any

import torch

from vllm_patching.transport import TensorMeta, dtype_name, torch_dtype


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """Strip DDP / torch.compile wrappers (peft models are handled by the LoRA bridge)."""
    for attr in ("module", "_orig_mod"):
        while hasattr(model, attr) and isinstance(getattr(model, attr), torch.nn.Module):
            model = getattr(model, attr)
    return model


def hf_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """``(hf_name, parameter)`` for every weight vLLM loads, in module order.

    Module order keeps each decoder layer's tensors together, so every fused q/k/v and
    gate/up group arrives complete and vLLM processes a layer as soon as it has it. A tied
    ``lm_head.weight`` is skipped: checkpoints do not carry it and vLLM re-derives it.
    """
    model = unwrap(model)
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    return [
        (name, p) for name, p in model.named_parameters() if not (tied and name == "lm_head.weight")
    ]


def hf_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """:func:`hf_parameters` as detached tensors (the values, no autograd)."""
    return [(name, p.detach()) for name, p in hf_parameters(model)]


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
