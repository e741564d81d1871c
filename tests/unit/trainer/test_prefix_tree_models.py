"""The packed prefix tree against padded rows on the real models: the embedded tiny Qwen2 and
SmolLM2-135M-Instruct (Llama, 49k vocabulary; marker ``smol``). One GRPO step's per-token
logprobs, loss and every trainable parameter's gradient agree within fp32 tolerance, full and
LoRA, for groups that share a long prompt, one that shares nothing and a sequence over
``max_seq_len``.

SmolLM2 runs with its first 4 decoder layers (``smol_first_layers``, tests/conftest.py): the real
weights, tokenizer vocabulary, tied 49k embedding and head, GQA attention and RoPE, at about a
third of the multiply-adds per token (the whole model took 94 s full and 128 s LoRA in a
two-worker run; 4 layers, about 29 s each). The contract checked is the same: the tree mask
and positions are applied the same way in every layer and a layer's packed output feeds the
next, which the stacked layers here still do, and every trainable tensor (embedding, each
layer's projections and norms, or each LoRA adapter) must get the padded run's gradient. The
other 26 layers would add float rounding, not another code path.

Both models get the same batch shape: groups sharing a prompt of 96 tokens (and 88), with
completions of 16 down to 7 tokens, 4 sequences a group. They were 400/48 tokens (tiny) and
160/24 (SmolLM2): nothing checked depends on the length. The tree still packs each shared
prompt once (asserted: under 0.6 of the padded run's forward tokens; 498 of 995 on SmolLM2),
micro-batches still hold four padded rows' tokens each, so the batch spans several (3 padded,
2 packed), the sequence over ``max_seq_len`` is still left out, and every trainable tensor
still gets a nonzero gradient (asserted), the KL term's among them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from api.protocol import ScoredGroup
from trainer.batch import flatten_groups
from trainer.config import GrpoConfig
from trainer.grpo_step import StepContext, accumulate
from trainer.model import Reference, load_model
from trainer.optim import build_optimizer, build_scheduler

pytestmark = pytest.mark.unit


def groups(vocab: int, prompt_len: int, comp_len: int, size: int, seed: int) -> list[ScoredGroup]:
    """Two groups sharing their prompt, one sharing nothing, and one sequence too long."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda n: torch.randint(0, vocab, (n,), generator=g).tolist()  # noqa: E731
    out = []
    for gi in range(3):
        prompt = rand(prompt_len - 8 * gi)
        seqs = []
        for si in range(size):
            if gi == 2:  # a group that shares nothing
                prompt = rand(prompt_len // 2)
            comp = rand(comp_len - 3 * si)
            lps = (-torch.rand(len(comp), generator=g) * 3).tolist()
            seqs.append(
                {
                    "tokens": prompt + comp,
                    "mask": [0] * len(prompt) + [1] * len(comp),
                    "logprobs": [0.0] * len(prompt) + lps,
                    "score": float((si * 5 + gi) % 3),
                }
            )
        out.append({"group_id": f"g{gi}", "env": "toy", "policy_version": 0, "sequences": seqs})
    out[0]["sequences"][0]["tokens"] += rand(prompt_len)  # over max_seq_len: left out
    out[0]["sequences"][0]["mask"] += [1] * prompt_len
    out[0]["sequences"][0]["logprobs"] += [-1.0] * prompt_len
    return [ScoredGroup.model_validate(g) for g in out]


def compare(
    model_dir: Path, tmp: Path, lora_r: int, prompt_len: int, comp_len: int, device: str = "cpu"
) -> None:
    cfg_groups = None
    results = []
    for packing in ("padded", "prefix_tree"):
        cfg = GrpoConfig(
            model_name=str(model_dir),
            save_path=str(tmp / packing),
            device=device,
            precision="fp32",
            packing=packing,
            kl_beta=0.05,
            lora_r=lora_r,
            lora_alpha=2 * max(lora_r, 1),
            max_seq_len=prompt_len + comp_len,
            micro_batch_tokens=4 * (prompt_len + comp_len),
            tensorboard=False,
        )
        lm = load_model(cfg)
        vocab = int(lm.model.get_output_embeddings().weight.shape[0])
        cfg_groups = cfg_groups or groups(min(vocab, 40000), prompt_len, comp_len, 4, seed=3)
        ref = Reference(lm)  # full weights: a copy of the start model, taken before the move
        torch.manual_seed(0)
        with torch.no_grad():  # move the policy off the reference so the KL term has a gradient
            for p in lm.model.parameters():
                if p.requires_grad:
                    p.add_(torch.randn_like(p) * 1e-3)
        opt = build_optimizer(lm.model, cfg)
        ctx = StepContext(lm, ref, opt, build_scheduler(opt, cfg), cfg)
        items = flatten_groups(cfg_groups, cfg.max_seq_len)[0]
        assert not items[0].trainable
        stats = accumulate(ctx, items)
        grads = {n: p.grad.clone() for n, p in lm.model.named_parameters() if p.requires_grad}
        results.append((lm.tree_attention, stats, grads))
    (tree_p, st_p, g_p), (tree_t, st_t, g_t) = results
    assert not tree_p and tree_t
    assert st_t["forward_tokens"] < 0.6 * st_p["forward_tokens"]
    assert set(g_t) == set(g_p)
    layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    assert {int(n.split(".layers.")[1].split(".")[0]) for n in g_p if ".layers." in n} == set(
        range(layers)
    ), "every decoder layer has trainable tensors compared"
    assert st_p["kl"] > 0, "the policy is off its reference"
    for key in ("loss", "kl", "entropy", "logprob_mismatch", "ratio_mean", "tokens"):
        assert st_t[key] == pytest.approx(st_p[key], rel=1e-4, abs=1e-5), key
    scale = max(g.abs().max() for g in g_p.values())
    for name in g_p:
        assert g_p[name].abs().max() > 0, name
        assert (g_p[name] - g_t[name]).abs().max() <= 1e-5 * max(1.0, float(scale)), name


@pytest.mark.parametrize("lora_r", [0, 8], ids=["full", "lora"])
def test_tiny_model_packed_equals_padded(tiny_model_dir: Path, tmp_path: Path, lora_r: int) -> None:
    compare(tiny_model_dir, tmp_path, lora_r, prompt_len=96, comp_len=16)


@pytest.mark.smol
@pytest.mark.parametrize("lora_r", [0, 8], ids=["full", "lora"])
def test_smollm2_packed_equals_padded(smol_first_layers: Path, tmp_path: Path, lora_r: int) -> None:
    compare(smol_first_layers, tmp_path, lora_r, prompt_len=96, comp_len=16)
