"""Resident weights: the trainer's parameters live in the bridge's shared buckets."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from trainer.bridge.params import hf_parameters, wire_metas
from trainer.bridge.resident import ResidentWeights
from vllm_patching.shm_segment import ShmSegment, new_segment_name
from vllm_patching.transport import Packer, plan_buckets, unpack

pytestmark = pytest.mark.unit


def _model() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        tie_word_embeddings=True,
    )
    return Qwen2ForCausalLM(cfg)


def _segment_packer(model: torch.nn.Module, dtype: str = "float32"):
    params = hf_parameters(model)
    plan = plan_buckets(wire_metas(params, dtype), bucket_bytes=4096)
    seg = ShmSegment(new_segment_name(), plan.total_bytes, create=True)
    buckets, offset = [], 0
    for size in plan.bucket_sizes:
        buckets.append(seg.buffer[offset : offset + size])
        offset += size
    return params, plan, seg, buckets, Packer(plan, buckets)


def test_adopted_parameters_train_in_place_and_syncs_copy_nothing(tmp_path) -> None:
    model = _model()
    before = {n: p.detach().clone() for n, p in hf_parameters(model)}
    params, plan, seg, buckets, packer = _segment_packer(model)
    try:
        resident = ResidentWeights.adopt(packer, [p for _, p in params])
        assert len(resident.params) == len(params)
        # Same values, now in the shared segment; the tied lm_head follows the embedding.
        for (name, p), (_, got) in zip(params, unpack(plan, buckets), strict=True):
            assert torch.equal(p.detach(), before[name]) and torch.equal(got, before[name])
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

        # A real optimizer step writes the shared bytes directly; the pack copies nothing.
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model(
            input_ids=torch.tensor([[1, 2, 3, 4]]), labels=torch.tensor([[1, 2, 3, 4]])
        ).loss.backward()
        opt.step()
        assert packer.pack([p.detach() for _, p in params]) == 0
        for (name, p), (_, got) in zip(params, unpack(plan, buckets), strict=True):
            assert torch.equal(got, p.detach())
            assert not torch.equal(got, before[name])  # every tensor moved

        # Checkpoints still hold every tensor (transformers sees disjoint views of one buffer).
        model.save_pretrained(tmp_path / "ckpt")
        again = Qwen2ForCausalLM.from_pretrained(tmp_path / "ckpt")
        for name, p in hf_parameters(again):
            assert torch.equal(p.detach(), dict(params)[name].detach()), name

        # Release: private memory, same values; the buckets can go away safely.
        trained = {n: p.detach().clone() for n, p in params}
        resident.release()
        seg.buffer.zero_()
        for name, p in params:
            assert torch.equal(p.detach(), trained[name])
        # ... and syncs go back to copying every byte.
        assert packer.pack([p.detach() for _, p in params]) == sum(
            s.meta.nbytes for s in plan.slots
        )
        for (_, got), (name, _) in zip(unpack(plan, buckets), params, strict=True):
            assert torch.equal(got, trained[name])
    finally:
        del buckets, packer
        seg.close()


def test_parameters_of_another_dtype_stay_private_and_are_copied() -> None:
    model = _model()
    params, plan, seg, buckets, packer = _segment_packer(model, dtype="bfloat16")
    try:
        resident = ResidentWeights.adopt(packer, [p for _, p in params])
        assert resident.params == []  # fp32 master weights cannot live in bf16 slots
        copied = packer.pack([p.detach() for _, p in params])
        assert copied == sum(s.meta.nbytes for s in plan.slots)
        for (_, p), (_, got) in zip(params, unpack(plan, buckets), strict=True):
            assert torch.equal(got, p.detach().to(torch.bfloat16))
    finally:
        del buckets, packer
        seg.close()
