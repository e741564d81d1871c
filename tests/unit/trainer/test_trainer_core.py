"""Trainer building blocks on a micro Qwen2 model (CPU, seconds): schedule, fp32 master
weights, exact checkpoint resume, batching, and a real GRPO step incl. the LoRA reference."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from api.protocol import ScoredGroup, ScoredSequence
from trainer.batch import collate, flatten_groups, micro_batches
from trainer.checkpoint import (
    TrainerState,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)
from trainer.config import GrpoConfig, SftConfig
from trainer.grpo_step import StepContext, grpo_step
from trainer.model import Reference, load_model
from trainer.optim import build_optimizer, build_scheduler, clip_and_step, lr_factor

pytestmark = pytest.mark.unit
VOCAB = 48


def build_micro_model(out: Path) -> Path:
    """A 2-layer Qwen2 with a word-level tokenizer: small enough for exact CPU tests."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    vocab = {f"w{i}": i for i in range(VOCAB - 2)} | {"<|im_end|>": VOCAB - 2, "<unk>": VOCAB - 1}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|im_end|>", unk_token="<unk>"
    )
    cfg = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def micro_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_micro_model(tmp_path_factory.mktemp("micro"))


def make_groups(n_groups: int = 2, size: int = 3, seed: int = 0) -> list[ScoredGroup]:
    g = torch.Generator().manual_seed(seed)
    groups = []
    for gi in range(n_groups):
        seqs = []
        for si in range(size):
            n_prompt, n_comp = 4, 3 + si
            tokens = torch.randint(0, VOCAB - 2, (n_prompt + n_comp,), generator=g).tolist()
            seqs.append(
                {
                    "tokens": tokens,
                    "mask": [0] * n_prompt + [1] * n_comp,
                    "logprobs": [0.0] * n_prompt + [-3.5] * n_comp,
                    "score": float(si == gi),
                    "spans": {"rationale": [0] * n_prompt + [1] * (n_comp - 1) + [0]},
                }
            )
        group = {"group_id": f"g{seed}-{gi}", "env": "toy", "policy_version": 0, "sequences": seqs}
        groups.append(ScoredGroup.model_validate(group))
    return groups


def test_schedule_warmup_then_cosine_and_linear() -> None:
    cfg = SftConfig(
        lr=1.0, warmup_steps=4, training_steps=14, lr_schedule="cosine", min_lr_ratio=0.0
    )
    assert [lr_factor(s, cfg) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_factor(9, cfg) == pytest.approx(0.5)  # halfway through the 10 decay steps
    assert lr_factor(14, cfg) == pytest.approx(0.0, abs=1e-12)
    lin = cfg.model_copy(update={"lr_schedule": "linear", "min_lr_ratio": 0.1})
    assert lr_factor(9, lin) == pytest.approx(0.1 + 0.9 * 0.5)
    const = cfg.model_copy(update={"lr_schedule": "constant"})
    assert lr_factor(13, const) == 1.0


def test_fp32_master_weights_keep_tiny_updates() -> None:
    # The paper's lr of 1e-7 on a weight of 1.0: bf16 cannot even represent the result.
    w = torch.ones(1)
    assert (w.bfloat16() + 1e-7).float().item() == 1.0
    assert (w + 1e-7).item() != 1.0
    model = torch.nn.Linear(4, 4)
    cfg = SftConfig(lr=1e-7, warmup_steps=0, lr_schedule="constant")
    opt = build_optimizer(model, cfg)
    before = model.weight.detach().clone()
    model(torch.ones(1, 4)).sum().backward()
    clip_and_step(model, opt, build_scheduler(opt, cfg), 1.0)
    assert not torch.equal(before, model.weight.detach())
    with pytest.raises(TypeError):
        build_optimizer(torch.nn.Linear(2, 2).bfloat16(), cfg)


def test_flatten_microbatch_collate() -> None:
    groups = make_groups()
    nothing_to_train = [0, 0, 0]  # a sequence without completion tokens is dropped
    groups[0].sequences.append(
        ScoredSequence(tokens=[1, 2, 3], mask=nothing_to_train, logprobs=[0.0] * 3, score=1.0)
    )
    items, dropped = flatten_groups(groups, max_seq_len=8)
    assert dropped == 1 and len(items) == 6
    assert [i.trainable for i in items] == [True, True, False] * 2  # 9 tokens > 8
    mbs = micro_batches(items, max_tokens=16)
    assert all(len(mb) * max(len(i.tokens) for i in mb) <= 16 for mb in mbs)
    assert sorted(i.index for mb in mbs for i in mb) == [0, 1, 3, 4]
    batch = collate(mbs[0], pad_id=VOCAB - 2, device=torch.device("cpu"))
    assert batch["tokens"].shape == batch["mask"].shape == batch["rationale"].shape


def _grpo_cfg(model_dir: Path, save: Path, **kw) -> GrpoConfig:
    # fp32 unless a test asks for bf16: `auto` would pick bf16 on CPUs with native bf16 only
    base = dict(
        model_name=str(model_dir),
        save_path=str(save),
        lr=1e-3,
        warmup_steps=0,
        micro_batch_tokens=24,
        tensorboard=False,
        kl_beta=0.1,
        precision="fp32",
    )
    return GrpoConfig(**(base | kw))


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters() if v.requires_grad}


def test_grpo_step_full_and_resume_is_exact(micro_model_dir: Path, tmp_path: Path) -> None:
    cfg = _grpo_cfg(micro_model_dir, tmp_path)
    lm = load_model(cfg)
    ref = Reference(lm)
    opt = build_optimizer(lm.model, cfg)
    sched = build_scheduler(opt, cfg)
    ctx = StepContext(lm, ref, opt, sched, cfg)
    start = _params(lm.model)
    first = grpo_step(ctx, flatten_groups(make_groups(seed=1), cfg.max_seq_len)[0])
    assert all(math.isfinite(v) for v in first.values())
    assert first["kl"] == pytest.approx(0.0, abs=1e-9)  # policy == reference before any step
    assert first["self_certainty"] > 0 and first["tokens"] == 2 * (3 + 4 + 5)
    assert any(not torch.equal(start[k], v) for k, v in _params(lm.model).items())
    save_checkpoint(tmp_path, lm.model, lm.tokenizer, opt, sched, TrainerState(step=1), keep=1)
    later = [flatten_groups(make_groups(seed=s), cfg.max_seq_len)[0] for s in (2, 3)]
    stats = [grpo_step(ctx, items) for items in later]
    assert stats[-1]["kl"] > 0  # moved away from the frozen reference
    straight = _params(lm.model)

    lm2 = load_model(cfg)
    ctx2 = StepContext(lm2, Reference(lm2), build_optimizer(lm2.model, cfg), None, cfg)
    ctx2.scheduler = build_scheduler(ctx2.optimizer, cfg)
    state = load_checkpoint(latest_checkpoint(tmp_path), lm2.model, ctx2.optimizer, ctx2.scheduler)
    assert state.step == 1
    for items in later:
        grpo_step(ctx2, items)
    for k, v in _params(lm2.model).items():
        assert torch.equal(v, straight[k]), k


def test_checkpoints_are_atomic_and_pruned(micro_model_dir: Path, tmp_path: Path) -> None:
    cfg = _grpo_cfg(micro_model_dir, tmp_path)
    lm = load_model(cfg)
    opt = build_optimizer(lm.model, cfg)
    sched = build_scheduler(opt, cfg)
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, lm.model, lm.tokenizer, opt, sched, TrainerState(step=step))
    (tmp_path / "checkpoints" / ".tmp-step_000004-123").mkdir()  # a write killed half-way
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000002", "step_000003"]
    assert latest_checkpoint(tmp_path).name == "step_000003"
    from transformers import AutoModelForCausalLM  # the weights load as a plain HF model

    AutoModelForCausalLM.from_pretrained(latest_checkpoint(tmp_path) / "model")


def test_lora_reference_is_the_base_without_a_copy(micro_model_dir: Path, tmp_path: Path) -> None:
    cfg = _grpo_cfg(micro_model_dir, tmp_path, lora_r=4, lora_alpha=8, lr=1e-2)
    lm = load_model(cfg)
    ref = Reference(lm)
    assert ref._frozen is None  # no second copy of the weights
    n_before = sum(p.numel() for p in lm.model.parameters())
    opt = build_optimizer(lm.model, cfg)
    ctx = StepContext(lm, ref, opt, build_scheduler(opt, cfg), cfg)
    first = grpo_step(ctx, flatten_groups(make_groups(seed=1), cfg.max_seq_len)[0])
    assert first["kl"] == pytest.approx(0.0, abs=1e-9)  # LoRA B starts at 0: policy == base
    for s in (2, 3):
        last = grpo_step(ctx, flatten_groups(make_groups(seed=s), cfg.max_seq_len)[0])
    assert last["kl"] > 0
    assert sum(p.numel() for p in lm.model.parameters()) == n_before
    base_trainable = [n for n, p in lm.model.named_parameters() if p.requires_grad]
    assert base_trainable and all("lora_" in n for n in base_trainable)
    # The checkpoint holds the adapter (safetensors) and restores it into a fresh LoRA model.
    ckpt = save_checkpoint(tmp_path, lm.model, lm.tokenizer, opt, ctx.scheduler, TrainerState(3))
    assert (ckpt / "model" / "adapter_model.safetensors").exists()
    lm2 = load_model(cfg)
    opt2 = build_optimizer(lm2.model, cfg)
    load_checkpoint(ckpt, lm2.model, opt2, build_scheduler(opt2, cfg))
    for k, v in _params(lm2.model).items():
        assert torch.equal(v, _params(lm.model)[k]), k


def test_relased_groups_are_not_trained_twice() -> None:
    from trainer.leasing import RECENT_BATCHES, remember, untrained

    state = TrainerState()
    trained = make_groups(seed=1)
    remember(state, "batch-1", trained)
    # After a crash between checkpoint and ack the API re-leases the groups (maybe re-batched).
    fresh = make_groups(seed=2)
    assert untrained(trained, state.recent_batches) == []
    assert untrained([trained[1], *fresh], state.recent_batches) == fresh
    for i in range(RECENT_BATCHES + 5):
        remember(state, f"b{i}", [])
    assert len(state.recent_batches) == RECENT_BATCHES  # bounded in the checkpoint


@pytest.mark.parametrize("lora_r", [0, 4])
def test_cpu_bf16_steps_with_unscaled_advantages(
    micro_model_dir: Path, tmp_path: Path, lora_r: int
) -> None:
    """The cpu-tiny preset's trainer: bf16 autocast on the CPU, Dr. GRPO advantages, sampling
    temperature 0.7 -- full weights and LoRA. The master weights stay fp32 and move."""
    cfg = _grpo_cfg(
        micro_model_dir,
        tmp_path,
        precision="bf16",
        scale_advantages=False,
        temperature=0.7,
        lora_r=lora_r,
        lora_alpha=8,
    )
    lm = load_model(cfg)
    assert lm.device.type == "cpu" and lm.compute_dtype == torch.bfloat16
    ref = Reference(lm)
    opt = build_optimizer(lm.model, cfg)
    ctx = StepContext(lm, ref, opt, build_scheduler(opt, cfg), cfg)
    before = _params(lm.model)
    for seed in (1, 2):
        m = grpo_step(ctx, flatten_groups(make_groups(seed=seed), cfg.max_seq_len)[0])
        assert math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"])
    after = _params(lm.model)
    assert all(v.dtype == torch.float32 for v in after.values())
    assert any(not torch.equal(after[k], before[k]) for k in before)
