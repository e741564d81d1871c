"""Attention over a packed prefix tree (trainer/prefix_tree/build.py), as a transformers
attention function, and the packed forward (``packed_logits``).

``enable(model)`` registers ``prefix_tree:<kernel>`` with transformers' ``AttentionInterface``
and points the model at it. A forward given ``prefix_tree=<PackedTree>`` (transformers passes
extra keyword arguments down to the attention function) attends sibling set by sibling set,
with PyTorch SDPA (its fused CPU flash kernel, or CUDA's memory-efficient kernel with a mask):
each child's queries see every ancestor token and their own tokens causally, batched with a
mask or alone as one causal sequence, whichever costs less (trainer/prefix_tree/build.py
``SiblingSet``). On the CPU in bf16, short batched children under shared ancestors (a GRPO
group's completions) are attended by two matmuls and one softmax instead (``_cascade``), and
no ``[N, N]`` mask of the packed row is built (``_IN_TREE``). Every other call
(generation, evaluation, the padded path) goes to the kernel the model was loaded with,
unchanged. The attention FLOPs are those of the tree, not of the padded rows: a completion's
queries meet the prompt's keys once each, and the prompt is computed once.

Only the positions whose next token is trained on reach the LM head (``logits_to_keep``): on a
49k vocabulary the head over a ~900-token prompt costs more than the completions' whole
forward.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any

import torch
import torch.nn.functional as F

from trainer.prefix_tree.build import PackedTree, SiblingSet

PREFIX = "prefix_tree:"
SUPPORTED_KERNELS = ("sdpa", "flash_attention_2")
_IN_TREE: ContextVar[bool] = ContextVar("prefix_tree_forward", default=False)
"""Set while :func:`packed_logits` runs the model: its mask builder then builds nothing
(the tree's attention ignores ``attention_mask``; transformers would otherwise build a
``[N, N]`` mask of the packed row on every forward, ~5% of a tiny-model step)."""


def _tree_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    prefix_tree: PackedTree | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """``query`` ``[1, H, N, D]``, ``key``/``value`` ``[1, H_kv, N, D]`` of the packed row ->
    ``[1, N, H, D]`` (transformers' layout for an attention function's output)."""
    if query.shape[0] != 1:
        raise ValueError(f"a packed prefix tree is one row (got a batch of {query.shape[0]})")
    if kwargs.get("sliding_window"):
        raise ValueError("prefix-tree packing does not support sliding-window attention")
    q, k, v = query[0], key[0], value[0]
    rep = q.shape[0] // k.shape[0]
    pieces = []
    for s in prefix_tree.sets:
        if s.queries.numel():
            kernel = _cascade if use_cascade(q, s, dropout) else _batched
            pieces.append(kernel(q, k, v, s, rep, dropout, scaling))
        for pos in s.alone:
            ks, vs = k[None, :, pos], v[None, :, pos]  # [1, H_kv, A + n, D]: 4-d for the kernels
            if rep > 1:
                ks, vs = ks.repeat_interleave(rep, dim=1), vs.repeat_interleave(rep, dim=1)
            out = F.scaled_dot_product_attention(
                q[None, :, pos], ks, vs, dropout_p=dropout, is_causal=True, scale=scaling
            )
            pieces.append(out[0, :, len(s.ancestors) :].transpose(0, 1))
    return torch.cat(pieces)[prefix_tree.order].unsqueeze(0), None


def _batched(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    s: SiblingSet,
    rep: int,
    dropout: float,
    scaling: float | None,
) -> torch.Tensor:
    """The batched children of ``s`` in one padded SDPA call -> ``[rows, H, D]``."""
    heads, head_dim = q.shape[0], q.shape[-1]
    n_sets, n_max = s.queries.shape
    qs = q[:, s.queries].transpose(0, 1)  # [S, H, n, D]
    ks, vs = k[:, s.queries], v[:, s.queries]  # [H_kv, S, n, D]
    if len(s.ancestors):
        shape = (-1, n_sets, -1, -1)
        ks = torch.cat([k[:, s.ancestors].unsqueeze(1).expand(shape), ks], dim=2)
        vs = torch.cat([v[:, s.ancestors].unsqueeze(1).expand(shape), vs], dim=2)
    ks, vs = ks.transpose(0, 1), vs.transpose(0, 1)  # [S, H_kv, A + n, D]
    if rep > 1:
        ks, vs = ks.repeat_interleave(rep, dim=1), vs.repeat_interleave(rep, dim=1)
    out = F.scaled_dot_product_attention(
        qs,
        ks,
        vs,
        attn_mask=s.mask,
        dropout_p=dropout,
        is_causal=s.mask is None,
        scale=scaling,
    )
    return out.transpose(1, 2).reshape(n_sets * n_max, heads, head_dim)[s.valid]


CASCADE_MAX_CHILD = 256
"""The longest batched child :func:`_cascade` takes (BENCHMARKS section 5c: 1.2-1.9x faster
than the SDPA call for children of 50-300 tokens under 400-900 shared ones in bf16, slower
for 500; in fp32 no faster at all, so fp32 keeps SDPA)."""


def use_cascade(q: torch.Tensor, s: SiblingSet, dropout: float) -> bool:
    """Whether the batched children of ``s`` go to :func:`_cascade`: on the CPU, computing in
    a 16-bit dtype (bf16 autocast: ``q`` itself is fp32 after the rotary embedding), under
    shared ancestors, children of at most ``CASCADE_MAX_CHILD`` tokens, no dropout."""
    on_cpu = q.device.type == "cpu"
    dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else q.dtype
    return (
        on_cpu
        and dtype in (torch.bfloat16, torch.float16)
        and len(s.ancestors) > 0
        and s.queries.shape[1] <= CASCADE_MAX_CHILD
        and not dropout
    )


def _cascade(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    s: SiblingSet,
    rep: int,
    dropout: float,
    scaling: float | None,
) -> torch.Tensor:
    """:func:`_batched` (without dropout) on the CPU, without copying the shared ancestors
    once per child: every child's queries meet the ancestors' keys in one matmul and their own
    keys in another, and one softmax runs over both (the scores, mask and result of the SDPA
    call). The SDPA call needs the ancestors' keys and values expanded to every child (and to
    every query head under GQA), a copy that costs more than the attention on the CPU
    (:func:`use_cascade` says when this is the faster of the two). The probabilities are kept
    for the backward (``[H, S, n, A + n]``), which SDPA's fused kernels avoid, so CUDA keeps
    the SDPA call."""
    heads, head_dim = q.shape[0], q.shape[-1]
    kv_heads, (n_sets, n_max), n_anc = k.shape[0], s.queries.shape, len(s.ancestors)
    scale = head_dim**-0.5 if scaling is None else scaling
    qs = q[:, s.queries].view(kv_heads, rep, n_sets, n_max, head_dim)  # query head = kv * rep + r
    k_anc, v_anc = k[:, s.ancestors], v[:, s.ancestors]  # [H_kv, A, D]
    k_own, v_own = k[:, s.queries].unsqueeze(1), v[:, s.queries].unsqueeze(1)  # [H_kv, 1, S, n, D]
    seen = torch.matmul(qs.reshape(kv_heads, -1, head_dim), k_anc.transpose(1, 2))
    own = torch.matmul(qs, k_own.transpose(-1, -2))  # [H_kv, rep, S, n, n]
    own = own.masked_fill(~s.mask[:, 0, :, n_anc:], float("-inf"))  # causal within the child
    scores = torch.cat([seen.view(kv_heads, rep, n_sets, n_max, n_anc), own], dim=-1)
    probs = torch.softmax(scores.float() * scale, dim=-1).to(v.dtype)
    out = torch.matmul(probs[..., :n_anc].reshape(kv_heads, -1, n_anc), v_anc)
    out = out.view(kv_heads, rep, n_sets, n_max, head_dim) + torch.matmul(probs[..., n_anc:], v_own)
    return out.reshape(heads, n_sets * n_max, head_dim).transpose(0, 1)[s.valid]


def _dispatch(base: str):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    plain = ALL_ATTENTION_FUNCTIONS[base]

    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        if kwargs.get("prefix_tree") is not None:
            return _tree_attention(module, query, key, value, attention_mask, *args, **kwargs)
        kwargs.pop("prefix_tree", None)
        return plain(module, query, key, value, attention_mask, *args, **kwargs)

    return attention


def _mask(plain: Any) -> Any:
    """The kernel's mask builder, except inside a prefix-tree forward (no mask: ``_IN_TREE``)."""

    def mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
        return None if _IN_TREE.get() else plain(*args, **kwargs)

    return mask


def enable(model: torch.nn.Module) -> bool:
    """Point ``model`` (and its sub-configs) at ``prefix_tree:<its kernel>``; False when its
    kernel is not one the tree path wraps (``eager``): the caller then keeps padded batches."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    config = model.config
    current = config._attn_implementation
    if current.startswith(PREFIX):
        return True
    if current not in SUPPORTED_KERNELS:
        return False
    name = PREFIX + current
    if name not in ALL_ATTENTION_FUNCTIONS:
        ALL_ATTENTION_FUNCTIONS.register(name, _dispatch(current))
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, _mask(ALL_MASK_ATTENTION_FUNCTIONS[current]))
    config._attn_implementation = name
    return True


def packed_logits(model: torch.nn.Module, tree: PackedTree, keep: torch.Tensor) -> torch.Tensor:
    """The logits ``[K, V]`` at the packed positions ``keep`` (``[K]``, on the tree's device)
    of one forward over ``tree`` of a ``model`` set up by :func:`enable`; the caller picks the
    autocast. No mask of the packed row is built (``_IN_TREE``)."""
    token = _IN_TREE.set(True)
    try:
        return model(
            input_ids=tree.input_ids,
            position_ids=tree.position_ids,
            logits_to_keep=keep,
            prefix_tree=tree,
            use_cache=False,
        ).logits[0]
    finally:
        _IN_TREE.reset(token)
