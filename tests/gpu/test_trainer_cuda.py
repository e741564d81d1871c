"""The trainer's bf16-autocast path on CUDA: fp32 master weights, finite loss, real steps."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.unit.trainer.test_trainer_core import build_micro_model, make_groups
from trainer.batch import collate, flatten_groups
from trainer.config import GrpoConfig
from trainer.grpo_step import StepContext, grpo_step
from trainer.loss import token_stats
from trainer.model import Reference, autocast, load_model, resolve_attention
from trainer.optim import build_optimizer, build_scheduler

pytestmark = pytest.mark.gpu


def _cfg(model_dir: Path, tmp_path: Path, **kw: object) -> GrpoConfig:
    base = dict(
        model_name=str(model_dir),
        save_path=str(tmp_path),
        device="cuda",
        lr=1e-3,
        warmup_steps=0,
        micro_batch_tokens=24,
        tensorboard=False,
        kl_beta=0.1,
    )
    return GrpoConfig(**(base | kw))


@pytest.mark.parametrize("lora_r", [0, 4])
def test_grpo_steps_bf16_autocast(tmp_path: Path, lora_r: int) -> None:
    cfg = _cfg(build_micro_model(tmp_path / "m"), tmp_path, lora_r=lora_r)
    lm = load_model(cfg)
    assert lm.compute_dtype == torch.bfloat16  # precision=auto on CUDA
    assert all(p.dtype == torch.float32 and p.is_cuda for p in lm.model.parameters())
    opt = build_optimizer(lm.model, cfg)
    ctx = StepContext(lm, Reference(lm), opt, build_scheduler(opt, cfg), cfg)
    before = {n: p.detach().clone() for n, p in lm.model.named_parameters() if p.requires_grad}
    stats = [grpo_step(ctx, flatten_groups(make_groups(seed=s), 64)[0]) for s in range(3)]
    for row in stats:
        assert all(math.isfinite(v) for v in row.values()), row
    assert stats[0]["kl"] == pytest.approx(0.0, abs=1e-6)
    assert stats[-1]["kl"] > 0
    changed = [
        n
        for n, p in lm.model.named_parameters()
        if p.requires_grad and not torch.equal(p.detach(), before[n])
    ]
    assert changed and all(p.dtype == torch.float32 for p in lm.model.parameters())


def test_bf16_logprobs_close_to_fp32(tmp_path: Path) -> None:
    cfg = _cfg(build_micro_model(tmp_path / "m"), tmp_path)
    lm = load_model(cfg)
    items, _ = flatten_groups(make_groups(seed=5), 64)
    batch = collate(items, 0, lm.device)
    with torch.no_grad():
        fp32 = token_stats(lm.model(input_ids=batch["tokens"]).logits, batch["tokens"])
        with autocast(lm.device, torch.bfloat16):
            logits = lm.model(input_ids=batch["tokens"]).logits
        bf16 = token_stats(logits, batch["tokens"])
    assert bf16.logprobs.dtype == torch.float32  # upcast before the softmax
    assert (bf16.logprobs - fp32.logprobs).abs().max().item() < 0.05


def test_attention_defaults_to_sdpa_without_flash_attn() -> None:
    import importlib.util

    chosen = resolve_attention("auto", torch.device("cuda"), torch.bfloat16)
    has_fa2 = importlib.util.find_spec("flash_attn") is not None
    assert chosen == ("flash_attention_2" if has_fa2 else "sdpa")
    assert resolve_attention("flash_attention_2", torch.device("cpu"), torch.float32) == "sdpa"
