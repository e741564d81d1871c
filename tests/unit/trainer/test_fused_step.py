"""A step that fits one micro-batch scores the loss pass's own forward (trainer/grpo_step.py
``fused``): its loss, statistics and every gradient equal the two-pass order (a no-grad
scoring pass, then the loss pass) on the same micro-batch. Padded and packed, full weights and
LoRA, with the KL reference and the self-certainty bonus both on (a 2-layer Qwen2, fp32)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import trainer.grpo_step as grpo_step
from tests.unit.trainer.test_prefix_tree import _cfg, make_groups
from tests.unit.trainer.test_trainer_core import build_micro_model
from trainer.batch import flatten_groups
from trainer.grpo_step import StepContext, accumulate, fused, has_dropout, plan
from trainer.model import Reference, load_model
from trainer.optim import build_optimizer, build_scheduler

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def micro_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_micro_model(tmp_path_factory.mktemp("micro"))


def _step(cfg, groups, two_pass: bool, monkeypatch: pytest.MonkeyPatch):
    torch.manual_seed(0)
    lm = load_model(cfg)
    opt = build_optimizer(lm.model, cfg)
    ctx = StepContext(lm, Reference(lm), opt, build_scheduler(opt, cfg), cfg)
    for p in lm.model.parameters():  # a reference that differs from the policy
        if p.requires_grad:
            with torch.no_grad():
                p.add_(torch.randn_like(p) * 0.02)
    items = flatten_groups(groups, cfg.max_seq_len)[0]
    taken = []
    real_fused = grpo_step.fused

    def spy(c, mine):
        taken.append(False if two_pass else real_fused(c, mine))
        return taken[-1]

    with monkeypatch.context() as m:
        m.setattr(grpo_step, "fused", spy)
        stats = accumulate(ctx, items)
    grads = {n: p.grad.clone() for n, p in lm.model.named_parameters() if p.requires_grad}
    return taken, stats, grads


@pytest.mark.parametrize("lora_r", [0, 4], ids=["full", "lora"])
@pytest.mark.parametrize("packing", ["prefix_tree", "padded"])
def test_fused_step_equals_two_passes(
    micro_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, packing, lora_r
) -> None:
    groups = make_groups(True, 4) + make_groups(False, 5, n_groups=2)
    kw = {"lora_r": lora_r, "lora_alpha": 8, "micro_batch_tokens": 100_000}
    cfg = _cfg(micro_model_dir, tmp_path, packing, **kw)
    taken_f, st_f, g_f = _step(cfg, groups, False, monkeypatch)
    taken_2, st_2, g_2 = _step(cfg, groups, True, monkeypatch)
    assert taken_f == [True] and taken_2 == [False]
    assert st_f["micro_batches"] == st_2["micro_batches"] == 1
    for key in ("loss", "kl", "self_certainty", "entropy", "logprob_mismatch", "ratio_mean"):
        assert st_f[key] == pytest.approx(st_2[key], rel=1e-6, abs=1e-7), key
    assert g_f.keys() == g_2.keys() and g_f
    for name in g_f:
        assert g_f[name].abs().max() > 0, name  # every trainable parameter gets a gradient
        torch.testing.assert_close(g_f[name], g_2[name], rtol=1e-5, atol=1e-7, msg=name)


def test_not_fused_with_several_micro_batches_or_dropout(
    micro_model_dir: Path, tmp_path: Path
) -> None:
    groups = make_groups(True, 4) + make_groups(False, 5, n_groups=2)
    small = _cfg(micro_model_dir, tmp_path, "prefix_tree", micro_batch_tokens=40)
    lm = load_model(small)
    opt = build_optimizer(lm.model, small)
    ctx = StepContext(lm, Reference(lm), opt, build_scheduler(opt, small), small)
    mbs = plan(ctx, flatten_groups(groups, small.max_seq_len)[0])
    assert len(mbs) > 1 and not fused(ctx, ctx.work.split(mbs))
    assert fused(ctx, ctx.work.split(mbs[:1]))
    wet = _cfg(micro_model_dir, tmp_path, "prefix_tree", lora_r=4, lora_dropout=0.1)
    assert has_dropout(load_model(wet).model) and not has_dropout(lm.model)


@pytest.mark.parametrize("packing", ["prefix_tree", "padded"])
def test_constant_aggregation_scales_the_token_steps_gradients(
    micro_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, packing: str
) -> None:
    """``loss_aggregation constant`` (Dr. GRPO) over several micro-batches: the whole step's
    normaliser, its sequences x ``constant_length``, so every gradient is the ``token``
    step's times tokens / (sequences x length), whichever micro-batch a token is in."""
    groups = make_groups(True, 4) + make_groups(False, 5, n_groups=2)
    token = _cfg(micro_model_dir, tmp_path, packing)
    loss = {"type": "ppo", "loss_aggregation": "constant", "constant_length": 16}
    constant = _cfg(micro_model_dir, tmp_path, packing, loss=loss)
    _, st_t, g_t = _step(token, groups, False, monkeypatch)
    _, st_c, g_c = _step(constant, groups, False, monkeypatch)
    assert st_t["micro_batches"] == st_c["micro_batches"] > 1
    assert st_t["tokens"] == st_c["tokens"] > 0
    scale = st_t["tokens"] / (st_t["sequences_trained"] * 16)
    assert scale != pytest.approx(1.0)
    assert st_c["loss"] == pytest.approx(st_t["loss"] * scale, rel=1e-5)
    for name in g_t:
        assert g_t[name].abs().max() > 0, name
        torch.testing.assert_close(g_c[name], g_t[name] * scale, rtol=1e-5, atol=1e-8, msg=name)
