"""The CPU kernel for batched children (trainer/prefix_tree/attention.py ``_cascade``) against the
SDPA call it replaces, and the packed forward's skipped mask (``_IN_TREE``)."""

from __future__ import annotations

import pytest
import torch

from trainer.prefix_tree import attention as tree_attention
from trainer.prefix_tree.build import pack

pytestmark = pytest.mark.unit


def _tree_with_batched_children() -> tuple[object, object]:
    """Two prompts of 40 / 30 tokens, each continued by children of 3-7 tokens: every child is
    shorter than its ancestors, so it is batched (with padding: the lengths differ)."""
    rng = torch.Generator().manual_seed(0)
    seqs = []
    for prompt_len, kids in ((40, (3, 7, 5, 7)), (30, (4, 6))):
        prompt = torch.randint(10, 99, (prompt_len,), generator=rng).tolist()
        for i, n in enumerate(kids):
            seqs.append(
                prompt + [100 + i] + torch.randint(10, 99, (n - 1,), generator=rng).tolist()
            )
    tree = pack(seqs, min_shared=16)
    sets = [s for s in tree.sets if s.queries.numel() and len(s.ancestors)]
    assert len(sets) == 2 and all(s.mask is not None for s in sets)
    return tree, sets


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (9, 3)])
def test_cascade_equals_the_sdpa_call_and_its_gradients(heads: int, kv_heads: int) -> None:
    tree, sets = _tree_with_batched_children()
    n, d = tree.packed_tokens, 16
    gen = torch.Generator().manual_seed(1)
    base = [torch.randn(h, n, d, generator=gen) for h in (heads, kv_heads, kv_heads)]
    outs, grads = [], []
    for kernel in (tree_attention._batched, tree_attention._cascade):
        q, k, v = (t.clone().requires_grad_() for t in base)
        out = torch.cat([kernel(q, k, v, s, heads // kv_heads, 0.0, None) for s in sets])
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        outs.append(out.detach())
        grads.append([t.grad for t in (q, k, v)])
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-6)
    for got, want in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_the_mask_builder_builds_nothing_inside_a_packed_forward() -> None:
    calls = []
    mask = tree_attention._mask(lambda *a, **kw: calls.append(kw) or "plain mask")
    assert mask(attention_mask=None) == "plain mask" and len(calls) == 1
    token = tree_attention._IN_TREE.set(True)
    try:
        assert mask(attention_mask=None) is None and len(calls) == 1
    finally:
        tree_attention._IN_TREE.reset(token)
    assert mask(attention_mask=None) == "plain mask" and len(calls) == 2


def test_the_cascade_takes_short_children_in_16_bit_on_the_cpu_only() -> None:
    _, sets = _tree_with_batched_children()
    s = sets[0]
    bf16, fp32 = torch.zeros(1, dtype=torch.bfloat16), torch.zeros(1)
    assert tree_attention.use_cascade(bf16, s, 0.0)
    assert not tree_attention.use_cascade(fp32, s, 0.0)  # fp32: SDPA is as fast
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the trainer's bf16: fp32 q, bf16 math
        assert tree_attention.use_cascade(fp32, s, 0.0)
    assert not tree_attention.use_cascade(bf16, s, 0.1)  # dropout: SDPA applies it
    long = type(s)(s.ancestors, s.queries.repeat(1, 60), s.mask, s.valid)
    assert long.queries.shape[1] > tree_attention.CASCADE_MAX_CHILD
    assert not tree_attention.use_cascade(bf16, long, 0.0)
