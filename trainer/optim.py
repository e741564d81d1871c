"""AdamW over fp32 master weights, and the warm-up + decay learning-rate schedule."""

from __future__ import annotations

import math

import torch

from trainer.config import CommonConfig


def build_optimizer(model: torch.nn.Module, cfg: CommonConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not on biases, norms or 1-d parameters).

    The parameters are fp32 (autocast computes in bf16), so AdamW's moments and the update
    are fp32 too: a 1e-7 learning rate moves a weight of magnitude 1 by 1e-7, which bf16
    (8 bits of mantissa, step ~4e-3 at 1.0) would round away entirely.
    """
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    if any(p.dtype != torch.float32 for p in decay + no_decay):
        raise TypeError("trainable parameters must be fp32 master weights")
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    fused = all(p.is_cuda for p in decay + no_decay) and bool(decay + no_decay)
    return torch.optim.AdamW(
        groups,
        lr=cfg.lr,
        betas=(cfg.adam_beta1, cfg.adam_beta2),
        eps=cfg.adam_eps,
        fused=fused or None,
    )


def lr_factor(step: int, cfg: CommonConfig) -> float:
    """Multiplier of ``cfg.lr`` for optimizer step ``step`` (0-based)."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return 1.0
    decay_steps = max(1, cfg.training_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    if cfg.lr_schedule == "linear":
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: CommonConfig
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg))


def clip_and_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    max_grad_norm: float,
) -> float:
    """Clip the global grad norm, step, advance the schedule, zero grads. Returns the norm
    before clipping. A non-finite norm (an inf/NaN gradient) skips the update instead of
    poisoning the weights: neither the optimizer nor the schedule moves (the caller sees the
    skip as ``not math.isfinite(norm)`` and must not count it as a step)."""
    params = [p for p in model.parameters() if p.requires_grad and p.grad is not None]
    limit = max_grad_norm if max_grad_norm > 0 else float("inf")
    # clip_grad_norm_ in its two halves, so that under FSDP2 the norm of the sharded (DTensor)
    # gradients is reduced over ranks before it scales them: every rank clips alike.
    total = torch.nn.utils.get_total_norm([p.grad for p in params])
    if hasattr(total, "full_tensor"):
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, limit, total)
    norm = float(total)
    if math.isfinite(norm):
        optimizer.step()
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return norm
