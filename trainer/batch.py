"""Scored groups (the data contract: docs/INTERFACES.md; Atropos fields: ``group.atropos``,
api/protocol_atropos.py, checked at lease time by trainer/atropos_fields.py) -> padded tensors
in token-budget micro-batches."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from api.protocol import ScoredGroup
from api.protocol_atropos import NATIVE
from trainer.prefix_tree.build import lcp

log = logging.getLogger(__name__)


@dataclass
class SeqItem:
    """One completion of a group, validated, with its place in the batch."""

    tokens: list[int]
    mask: list[int]
    """1 = a completion token to train on (aligned to ``tokens``)."""
    logprobs: list[float]
    """Inference logprobs aligned to ``tokens`` (values under mask 0 are ignored)."""
    rationale: list[int]
    """1 = a rationale token (self-certainty span), aligned to ``tokens``; may be all 0."""
    score: float
    group: int
    """Index of the group within the batch (advantage normalisation unit)."""
    index: int
    """Position of this item in the flattened batch."""
    policy_version: int
    trainable: bool
    """False when the sequence is over ``max_seq_len``: it still counts in its group's
    statistics (its score is real) but is left out of the loss rather than truncated, since a
    truncated context would no longer match the logprobs it was sampled with."""
    advantages: list[float] | None = None
    """An environment's own per-token advantages, aligned to ``tokens`` (the sequence's
    ``advantages``, or Atropos ``advantages``): they replace the group-normalised score on
    this sequence's tokens."""
    ref_logprobs: list[float] | None = None
    """An environment's reference logprobs, aligned to ``tokens`` (Atropos ``ref_logprobs``):
    the KL's reference for this sequence, instead of the reference model's."""
    logprobs_missing: bool = False
    """The environment sent no inference logprobs (``logprobs`` are placeholders): the
    trainer's own logprobs, computed before the step, stand in for them (on-policy)."""
    zero_advantage: bool = False
    """Atropos ``overrides[i].set_advantage_to_zero``: advantage 0 (it still counts in its
    group's statistics)."""


def flatten_groups(groups: Sequence[ScoredGroup], max_seq_len: int) -> tuple[list[SeqItem], int]:
    """Validate and flatten leased groups, with their Atropos fields (``group.atropos``: one
    ``AtroposSequence`` per sequence). Returns the items and the number of sequences dropped
    as malformed (named in the log with their group id): shorter than 2 tokens, nothing to
    train (mask all 0), or per-token fields not aligned to the tokens.

    A sequence over ``max_seq_len`` (a long multi-turn episode, say) is kept whole but not
    trained (``trainable`` False, logged with its group and length; the step's metrics count
    them as ``over_max_seq_len``): cutting it would train a context the model never sampled
    its later turns in, or leave tokens without the logprobs they were sampled with."""
    items: list[SeqItem] = []
    dropped = 0
    for g_idx, group in enumerate(groups):
        too_long = [len(s.tokens) for s in group.sequences if len(s.tokens) > max_seq_len]
        if too_long:
            log.warning(
                "group %s (env %s): %d of %d sequences are longer than max_seq_len %d "
                "(lengths %s): not trained, still counted in the group's statistics",
                group.group_id,
                group.env,
                len(too_long),
                len(group.sequences),
                max_seq_len,
                too_long,
            )
        fields = group.atropos
        for i, seq in enumerate(group.sequences):
            extra = NATIVE if fields is None else fields.sequence(i)
            tokens, mask = list(seq.tokens), list(seq.mask)
            rationale = list(seq.spans.get("rationale") or [0] * len(tokens))
            advantages = seq.advantages if seq.advantages is not None else extra.advantages
            per_token = [x for x in (advantages, extra.ref_logprobs) if x is not None]
            lengths = {len(tokens), len(mask), len(seq.logprobs), len(rationale)}
            lengths |= {len(x) for x in per_token}
            if len(lengths) != 1 or len(tokens) < 2 or not any(mask):
                log.warning(
                    "dropping a malformed sequence of group %s (lengths %s, %d masked)",
                    group.group_id,
                    sorted(lengths),
                    sum(mask),
                )
                dropped += 1
                continue
            items.append(
                SeqItem(
                    tokens,
                    mask,
                    [float(x) for x in seq.logprobs],
                    rationale,
                    float(seq.score),
                    g_idx,
                    len(items),
                    group.policy_version,
                    trainable=len(tokens) <= max_seq_len,
                    advantages=_floats(advantages),
                    ref_logprobs=_floats(extra.ref_logprobs),
                    logprobs_missing=extra.logprobs_missing,
                    zero_advantage=extra.zero_advantage,
                )
            )
    return items, dropped


def turns(mask: Sequence[int]) -> int:
    """How many runs of sampled tokens (mask 1) a sequence has: 1 for a single completion, the
    number of model turns in a multi-turn episode."""
    return sum(1 for j, m in enumerate(mask) if m and (j == 0 or not mask[j - 1]))


def _floats(values: Sequence[float] | None) -> list[float] | None:
    return None if values is None else [float(x) for x in values]


def micro_batches(items: list[SeqItem], max_tokens: int) -> list[list[SeqItem]]:
    """Split trainable items so each micro-batch's padded size (rows x longest) <= max_tokens.

    Items are sorted by length first so padding stays small; a single sequence longer than
    the budget still gets its own micro-batch (the budget is a target, not a hard limit).
    """
    batches: list[list[SeqItem]] = []
    current: list[SeqItem] = []
    for item in sorted((i for i in items if i.trainable), key=lambda i: len(i.tokens)):
        longest = max([len(item.tokens)] + [len(c.tokens) for c in current])
        if current and longest * (len(current) + 1) > max_tokens:
            batches.append(current)
            current = []
        current.append(item)
    if current:
        batches.append(current)
    return batches


def pad_rows(
    rows: Sequence[Sequence[Any]],
    length: int,
    value: Any,
    dtype: torch.dtype,
    device: torch.device,
    left: bool = False,
) -> torch.Tensor:
    """``rows`` as one ``[len(rows), length]`` tensor on ``device``, each row padded with
    ``value`` on the right (``left``: on the left, as generation wants its prompts)."""
    out = torch.full((len(rows), length), value, dtype=dtype)
    for r, row in enumerate(rows):
        at = slice(length - len(row), length) if left else slice(0, len(row))
        out[r, at] = torch.tensor(row, dtype=dtype)
    return out.to(device)


def collate(items: list[SeqItem], pad_id: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Right-padded ``[B, L]`` tensors; padding has attention 0 and mask 0."""
    length = max(len(i.tokens) for i in items)

    def pad(rows: list[list[Any]], value: Any, dtype: torch.dtype) -> torch.Tensor:
        return pad_rows(rows, length, value, dtype, device)

    return {
        "tokens": pad([i.tokens for i in items], pad_id, torch.long),
        "attention": pad([[1] * len(i.tokens) for i in items], 0, torch.long),
        "mask": pad([i.mask for i in items], 0, torch.long),
        "logprobs": pad([i.logprobs for i in items], 0.0, torch.float32),
        "rationale": pad([i.rationale for i in items], 0, torch.long),
    }


@dataclass
class EnvRows:
    """What the environment sent for each row of a micro-batch beyond tokens and logprobs
    (an env's own ``advantages``, the Atropos fields): ``[B, L]`` values padded like
    ``collate``'s tensors (0 where a row has none) and ``[B]`` flags, on the device."""

    advantages: torch.Tensor
    """Per-token advantages of the rows that sent them (``has_advantages``)."""
    has_advantages: torch.Tensor
    ref_logprobs: torch.Tensor
    """Per-token reference logprobs of the rows that sent them (``has_ref``)."""
    has_ref: torch.Tensor
    logprobs_missing: torch.Tensor
    """The row's inference logprobs are placeholders (``SeqItem.logprobs_missing``)."""
    zero_advantage: torch.Tensor
    """``SeqItem.zero_advantage``: advantage 0 on the row."""

    @classmethod
    def of(cls, items: list[SeqItem], device: torch.device) -> EnvRows:
        length = max(len(i.tokens) for i in items)

        def flags(values: list[bool]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.bool, device=device)

        return cls(
            advantages=pad_rows(
                [i.advantages or [] for i in items], length, 0.0, torch.float32, device
            ),
            has_advantages=flags([i.advantages is not None for i in items]),
            ref_logprobs=pad_rows(
                [i.ref_logprobs or [] for i in items], length, 0.0, torch.float32, device
            ),
            has_ref=flags([i.ref_logprobs is not None for i in items]),
            logprobs_missing=flags([i.logprobs_missing for i in items]),
            zero_advantage=flags([i.zero_advantage for i in items]),
        )


def tree_micro_batches(
    items: list[SeqItem], max_tokens: int, min_shared: int, parts: int = 1
) -> list[list[SeqItem]]:
    """Split trainable items so each micro-batch's *packed* size (its prefix tree's tokens,
    trainer/prefix_tree/build.py) is at most ``max_tokens`` where it can be.

    Items are sorted by their token ids, so sequences that share a prefix (a group's rollouts,
    prompts that share a system prompt) sit side by side; in that order a tree's size is the
    first sequence's length plus, for each next one, what it does not share with the one
    before. A range over the budget is cut where its neighbours share least (between groups
    before inside one), then neighbouring ranges are merged while they fit. With ``parts``
    ranks the largest micro-batches are cut further until every rank has one (when there are
    that many items). A single sequence over the budget gets a micro-batch of its own.
    """
    order = sorted((i for i in items if i.trainable), key=lambda i: i.tokens)
    if not order:
        return []
    shared = [0] + [lcp((a.tokens, b.tokens)) for a, b in zip(order, order[1:], strict=False)]
    shared = [k if k >= min_shared else 0 for k in shared]

    def cost(lo: int, hi: int) -> int:
        return sum(len(i.tokens) for i in order[lo:hi]) - sum(shared[lo + 1 : hi])

    def cut(lo: int, hi: int) -> int:
        mid = (lo + hi) / 2
        return min(range(lo + 1, hi), key=lambda k: (shared[k], abs(k - mid)))

    def split(lo: int, hi: int) -> list[tuple[int, int]]:
        if hi - lo == 1 or cost(lo, hi) <= max_tokens:
            return [(lo, hi)]
        k = cut(lo, hi)
        return split(lo, k) + split(k, hi)

    ranges: list[tuple[int, int]] = []
    for lo, hi in split(0, len(order)):
        if ranges and cost(ranges[-1][0], hi) <= max_tokens:
            ranges[-1] = (ranges[-1][0], hi)
        else:
            ranges.append((lo, hi))
    while len(ranges) < min(parts, len(order)):
        lo, hi = max((r for r in ranges if r[1] - r[0] > 1), key=lambda r: cost(*r))
        k = cut(lo, hi)
        at = ranges.index((lo, hi))
        ranges[at : at + 1] = [(lo, k), (k, hi)]
    return [order[lo:hi] for lo, hi in ranges]
