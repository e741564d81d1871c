"""Model loading: fp32 master weights, bf16 autocast compute, attention kernel choice, LoRA,
and the KL reference (a frozen copy, or the LoRA base weights at no extra memory)."""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from trainer.config import CommonConfig
from trainer.precision import choose_precision
from trainer.prefix_tree import attention as tree_attention

log = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"error: device {name!r} asked for but CUDA is not available")
    return device


def resolve_precision(precision: str, device: torch.device) -> torch.dtype:
    """The compute dtype: bf16 (autocast) or fp32, logged with its reason (``auto``: bf16 only
    where the device runs it natively, trainer/precision.py). Weights stay fp32 either way."""
    dtype, why = choose_precision(precision, device)
    log.info("compute precision %s (%s)", "bf16" if dtype == torch.bfloat16 else "fp32", why)
    return dtype


def resolve_attention(requested: str, device: torch.device, compute_dtype: torch.dtype) -> str:
    """SDPA by default; FlashAttention 2 only when it is installed and usable (CUDA + bf16)."""
    has_fa2 = importlib.util.find_spec("flash_attn") is not None
    fa2_usable = has_fa2 and device.type == "cuda" and compute_dtype == torch.bfloat16
    if requested == "auto":
        return "flash_attention_2" if fa2_usable else "sdpa"
    if requested == "flash_attention_2" and not fa2_usable:
        log.warning(
            "flash_attention_2 asked for but not usable here (installed=%s); using sdpa", has_fa2
        )
        return "sdpa"
    return requested


def autocast(device: torch.device, compute_dtype: torch.dtype) -> contextlib.AbstractContextManager:
    """bf16 autocast around forward passes (a no-op for fp32): fp32 master weights stay fp32,
    matmuls run in bf16, and our loss upcasts the logits to fp32 before any softmax."""
    if compute_dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=compute_dtype)


@dataclass
class LoadedModel:
    model: torch.nn.Module
    """The trainable model (a peft model under LoRA), fp32 parameters."""
    tokenizer: PreTrainedTokenizerBase
    device: torch.device
    compute_dtype: torch.dtype
    is_lora: bool
    tree_attention: bool = False
    """The model runs packed prefix trees (``packing: prefix_tree``, trainer/prefix_tree/)."""


def load_tokenizer(name: str) -> PreTrainedTokenizerBase:
    tok = AutoTokenizer.from_pretrained(name)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_model(cfg: CommonConfig, source: str | None = None) -> LoadedModel:
    """Load ``source`` (default ``cfg.model_name``) in fp32 on the configured device."""
    device = resolve_device(cfg.device)
    compute_dtype = resolve_precision(cfg.precision, device)
    attn = resolve_attention(cfg.attn_implementation, device, compute_dtype)
    name = source or cfg.model_name
    model = AutoModelForCausalLM.from_pretrained(
        name, dtype=torch.float32, attn_implementation=attn
    )
    model.to(device)
    tree = cfg.packing == "prefix_tree" and tree_attention.enable(model)
    if cfg.packing == "prefix_tree" and not tree:
        log.warning("packing: prefix_tree needs sdpa or flash_attention_2 (got %s); padded", attn)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    is_lora = cfg.lora_r > 0
    if is_lora:
        model = _add_lora(model, cfg)
    if cfg.freeze_layers:
        freeze_bottom(model, cfg.freeze_layers)
    log.info(
        "loaded %s on %s (compute %s, attention %s, lora=%s, packing %s)",
        name,
        device,
        compute_dtype,
        attn,
        is_lora,
        "prefix_tree" if tree else "padded",
    )
    return LoadedModel(model, load_tokenizer(name), device, compute_dtype, is_lora, tree)


def _add_lora(model: torch.nn.Module, cfg: CommonConfig) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    targets = cfg.lora_target_modules
    target_modules: str | list[str] = "all-linear" if targets == ["all-linear"] else targets
    torch.manual_seed(cfg.seed)  # LoRA A matrices are random: make them reproducible
    lora = LoraConfig(
        r=cfg.lora_r,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules=target_modules,
        task_type="CAUSAL_LM",
    )
    if cfg.gradient_checkpointing:
        model.enable_input_require_grads()
    return get_peft_model(model, lora)


def freeze_bottom(model: torch.nn.Module, n: int) -> None:
    """Freeze the first ``n`` decoder layers (LoRA adapters in them too) and detach the input
    embeddings' output, so no gradient flows below layer ``n`` (``freeze_layers``)."""
    from trainer.distributed import shard_units

    layers = shard_units(model)
    if n >= len(layers):
        raise ValueError(f"freeze_layers={n} leaves nothing to train ({len(layers)} layers)")
    for layer in layers[:n]:
        for p in layer.parameters():
            p.requires_grad_(False)
    embed = model.get_input_embeddings()
    embed.register_forward_hook(lambda _m, _i, out: out.detach())
    log.info("training above the first %d of %d decoder layers", n, len(layers))


class Reference:
    """The KL reference policy.

    Under LoRA the reference is the base model itself, reached by disabling the adapter for
    one forward pass: no second copy of the weights. Otherwise a frozen copy of the initial
    weights, kept in the compute dtype (bf16 on GPU halves its memory; it never trains).
    Build it before a resume loads checkpointed weights: the reference is always the start
    model, so it never needs checkpointing.
    """

    def __init__(self, loaded: LoadedModel) -> None:
        self._loaded = loaded
        self._frozen: torch.nn.Module | None = None
        if not loaded.is_lora:
            frozen = copy.deepcopy(loaded.model).to(loaded.compute_dtype).eval()
            for p in frozen.parameters():
                p.requires_grad_(False)
            self._frozen = frozen

    def shard(self, d: Any) -> None:
        """Under torchrun: shard the frozen copy like the policy (trainer/distributed.py);
        the LoRA reference is the (already sharded) policy itself."""
        if self._frozen is not None:
            from trainer.distributed import shard_model

            shard_model(self._frozen, d, self._loaded.compute_dtype)

    @contextlib.contextmanager
    def model(self) -> Iterator[torch.nn.Module]:
        if self._frozen is not None:
            yield self._frozen
            return
        peft_model = self._loaded.model
        with peft_model.disable_adapter():  # type: ignore[operator]
            yield peft_model


def vocab_size(model: torch.nn.Module) -> int:
    """Size of the logits' last dimension (the padded embedding size, not len(tokenizer))."""
    return int(model.get_output_embeddings().weight.shape[0])
