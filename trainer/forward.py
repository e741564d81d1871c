"""A micro-batch ready for the model, and its per-token statistics: padded rows (one row per
sequence, as before) or one packed prefix tree (every shared token once; trainer/prefix_tree/).
Both give the same ``[B, L-1]`` tensors, aligned to ``collate``'s rows, from the one
``trainer.loss.token_stats``, so the loss code does not know which ran."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from trainer.batch import EnvRows, SeqItem, collate, pad_rows
from trainer.loss import TokenStats, sft_loss, token_stats
from trainer.prefix_tree.attention import packed_logits
from trainer.prefix_tree.build import PackedTree, pack
from trainer.prefix_tree.targets import Targets, targets

Packing = Literal["prefix_tree", "padded"]


@dataclass
class MicroBatch:
    items: list[SeqItem]
    batch: dict[str, torch.Tensor]
    """``collate``'s padded tensors (tokens, attention, mask, logprobs, rationale)."""
    env: EnvRows
    """What the environment sent per row (its advantages, the Atropos fields), typed."""
    tree: PackedTree | None = None
    want: Targets | None = None
    """The predictions the tree path computes: every masked or rationale token."""

    @property
    def forward_tokens(self) -> int:
        """Tokens one forward pass puts through the model (padding included)."""
        if self.tree is not None:
            return self.tree.packed_tokens
        return int(self.batch["tokens"].numel())


def prepare(
    items: list[SeqItem], pad_id: int, device: torch.device, packed: bool, min_shared: int
) -> MicroBatch:
    batch = collate(items, pad_id, device)
    env = EnvRows.of(items, device)
    if not packed:
        return MicroBatch(items, batch, env)
    seqs = [i.tokens for i in items]
    tree = pack(seqs, min_shared)
    wanted = [[m or r for m, r in zip(i.mask, i.rationale, strict=True)] for i in items]
    return MicroBatch(items, batch, env, tree.to(device), targets(tree, seqs, wanted))


def stats_of(
    model: torch.nn.Module, mb: MicroBatch, temperature: float, with_entropy: bool = True
) -> TokenStats:
    """Per-prediction logprobs (and entropies) of ``mb``'s sequences under ``model``; the
    caller picks the autocast. Packed: computed at ``mb.want`` only, 0 elsewhere."""
    if mb.tree is None:
        b = mb.batch
        logits = model(input_ids=b["tokens"], attention_mask=b["attention"], use_cache=False).logits
        return token_stats(logits, b["tokens"], temperature, with_entropy)
    width = mb.batch["tokens"].shape[1] - 1
    return _tree_stats(model, mb.tree, mb.want, width, temperature, with_entropy)


def _tree_stats(
    model: torch.nn.Module,
    tree: PackedTree,
    want: Targets,
    width: int,
    temperature: float = 1.0,
    with_entropy: bool = True,
) -> TokenStats:
    """``token_stats`` of the sequences packed in ``tree`` as ``[B, width]`` tensors (``width``
    = longest sequence - 1), computed only at ``want``'s predictions (0 elsewhere)."""
    keep, where = torch.unique(want.packed.to(tree.input_ids.device), return_inverse=True)
    logits = packed_logits(model, tree, keep)  # [K, V]
    tokens = want.tokens.to(logits.device)
    stats = token_stats(logits, tokens, temperature, with_entropy, rows=where)
    return want.per_sequence(stats, len(tree.lengths), width)


def target_nll(
    model: torch.nn.Module,
    seqs: list[list[int]],
    loss_masks: list[list[int]],
    device: torch.device,
    packed: bool,
    min_shared: int,
    pad_id: int,
) -> torch.Tensor:
    """Summed next-token NLL of the SFT targets (``loss_masks`` aligned to ``seqs``, 1 = a
    target token), padded or as one packed prefix tree; the caller picks the autocast."""
    if packed:
        tree = pack(seqs, min_shared)
        want = targets(tree, seqs, loss_masks)
        width = max(len(s) for s in seqs) - 1
        stats = _tree_stats(model, tree.to(device), want, width, with_entropy=False)
        return -stats.logprobs.sum()
    length = max(len(s) for s in seqs)
    tokens = pad_rows(seqs, length, pad_id, torch.long, device)
    attention = pad_rows([[1] * len(s) for s in seqs], length, 0, torch.long, device)
    mask = pad_rows(loss_masks, length, 0.0, torch.float32, device)
    logits = model(input_ids=tokens, attention_mask=attention, use_cache=False).logits
    return sft_loss(logits, tokens, mask, normaliser=1.0)[0]
