"""Sequences that share prefixes -> one packed row in which every shared token appears once.

A GRPO group's completions all continue one prompt; Shop-R1 prompts are long (up to ~900
tokens) and completions short (~80), so padding every rollout to its own row makes the model
compute the prompt once per rollout. Here the sequences of a micro-batch become a *radix tree*
(a trie whose nodes are runs of tokens): a node holds tokens ``[start, end)`` that every
sequence through it has in common, its children continue it. Nothing is assumed about where
a prompt ends: the tree is derived from the token ids alone, so a group that shares nothing
simply gives one root per sequence (the plain packed path), identical rollouts share all of
their tokens, and every prompt of a batch shares the system prompt.

Every node is laid out once in a single packed row. A token's position id is its index in
its own sequence, and it attends causally to its node and to all its ancestors
(``trainer/prefix_tree/attention.py``), so each sequence sees exactly the context it has when padded
in a row of its own: per-token logprobs are the same up to float summation order (the tests
in ``tests/unit/trainer/test_prefix_tree.py`` hold it to fp32 tolerance).

A run of shared tokens shorter than ``min_shared`` is not split out (a node costs one more
attention call per layer, which a handful of tokens does not pay for): its tokens are then
computed once per sequence, as in a padded batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

MIN_SHARED_TOKENS = 16
"""Default shortest run of shared tokens worth a node of its own."""


@dataclass
class Node:
    parent: int
    """Index of the parent node, -1 for a root."""
    seq: int
    """A sequence that passes through this node (its tokens ``[start, end)`` are the node's)."""
    start: int
    end: int
    members: list[int] = field(default_factory=list)
    """Every sequence that passes through this node."""
    offset: int = -1
    """Where the node's tokens begin in the packed row (set by :func:`pack`)."""

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclass
class SiblingSet:
    """The children of one node (or the roots): their attention plan for each layer.

    Their tokens are contiguous in the packed row, child after child. A child longer than its
    ancestors attends *alone*: its ancestors' tokens and its own as one causal sequence (the
    kernel skips the masked half, and no padding; the ancestors' own rows are computed again
    and dropped, which costs less than the masked half). The others are *batched*: one call
    for all of them, padded to the longest, with an explicit mask (every ancestor + causal
    within the child), which is the cheaper plan when a long prompt has short completions."""

    ancestors: torch.Tensor
    """Packed positions of every ancestor token, oldest first (``[A]``; empty for roots)."""
    queries: torch.Tensor
    """``[S, n_max]`` packed positions of each batched child's tokens, padded with its last
    (``[0, 0]`` when no child is batched)."""
    mask: torch.Tensor | None
    """``[S, 1, n_max, A + n_max]`` bool: all ancestors + causal within the child; None when
    the batched children are roots of one length (plain causal attention)."""
    valid: torch.Tensor
    """Flat indices into ``[S * n_max]`` of the real (unpadded) query rows, in packed order."""
    alone: list[torch.Tensor] = field(default_factory=list)
    """Per child attended alone, the packed positions of its ancestors and then its own
    tokens (``[A + n]``); its output rows are those after the ``A`` ancestors."""


@dataclass
class PackedTree:
    """One micro-batch of sequences packed as a radix tree (see the module docstring)."""

    input_ids: torch.Tensor
    """``[1, N]`` the packed row."""
    position_ids: torch.Tensor
    """``[1, N]`` each token's index in its own sequence."""
    sets: list[SiblingSet]
    token_index: list[torch.Tensor]
    """Per sequence, the packed position of each of its tokens (``[len]``)."""
    lengths: list[int]
    nodes: list[Node] = field(repr=False)
    order: torch.Tensor = field(repr=False)
    """Where each packed position's row is in the concatenated outputs of the sets' calls
    (batched children first, then those alone, set after set)."""

    @property
    def packed_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def sequence_tokens(self) -> int:
        """Tokens the same sequences take one row each (what a padded batch computes, less
        its padding)."""
        return sum(self.lengths)

    def to(self, device: torch.device) -> PackedTree:
        def move(s: SiblingSet) -> SiblingSet:
            mask = None if s.mask is None else s.mask.to(device)
            return SiblingSet(
                s.ancestors.to(device),
                s.queries.to(device),
                mask,
                s.valid.to(device),
                [a.to(device) for a in s.alone],
            )

        return PackedTree(
            self.input_ids.to(device),
            self.position_ids.to(device),
            [move(s) for s in self.sets],
            [t.to(device) for t in self.token_index],
            self.lengths,
            self.nodes,
            self.order.to(device),
        )


def lcp(seqs: Sequence[Sequence[int]], start: int = 0) -> int:
    """How many tokens from ``start`` on every one of ``seqs`` has in common (their longest
    common prefix past ``start``)."""
    first = seqs[0]
    n = min(len(s) for s in seqs) - start
    for j in range(n):
        tok = first[start + j]
        if any(s[start + j] != tok for s in seqs[1:]):
            return j
    return n


def build_tree(seqs: Sequence[Sequence[int]], min_shared: int = MIN_SHARED_TOKENS) -> list[Node]:
    """The radix tree of ``seqs`` as a node list, parents before children (each node names the
    sequences through it: :func:`paths`). Empty sequences are refused."""
    if any(len(s) == 0 for s in seqs):
        raise ValueError("every sequence needs at least one token")
    if min_shared < 1:
        raise ValueError(f"min_shared must be >= 1 (got {min_shared})")
    nodes: list[Node] = []

    def split(idx: list[int], at: int) -> list[list[int]]:
        """``idx`` partitioned by the token at ``at`` (those that end there: one part)."""
        parts: dict[object, list[int]] = {}
        for r in idx:
            key = seqs[r][at] if len(seqs[r]) > at else None
            parts.setdefault(key, []).append(r)
        return list(parts.values())

    def build(idx: list[int], d: int, parent: int) -> None:
        # Every sequence in idx has tokens [0, d) in the ancestors of ``parent``.
        idx = [r for r in idx if len(seqs[r]) > d]
        if not idx:
            return
        if len(idx) == 1:
            nodes.append(Node(parent, idx[0], d, len(seqs[idx[0]]), idx))
            return
        shared = lcp([seqs[r] for r in idx], d)
        identical = all(len(seqs[r]) == d + shared for r in idx)
        if shared >= min_shared or (identical and shared > 0):
            nodes.append(Node(parent, idx[0], d, d + shared, idx))
            me = len(nodes) - 1
            for part in split(idx, d + shared):
                build(part, d + shared, me)
            return
        # Too few shared tokens for a node: split where they diverge; each part starts at d
        # (repeating the short shared run) and may share a longer run of its own.
        for part in split(idx, d + shared):
            build(part, d, parent)

    build(list(range(len(seqs))), 0, -1)
    return nodes


def paths(nodes: Sequence[Node], n_seqs: int) -> list[list[int]]:
    """Each sequence's nodes, root first (nodes are listed parents before children)."""
    result: list[list[int]] = [[] for _ in range(n_seqs)]
    for i, node in enumerate(nodes):
        for r in node.members:
            result[r].append(i)
    return result


def pack(seqs: Sequence[Sequence[int]], min_shared: int = MIN_SHARED_TOKENS) -> PackedTree:
    """Build the tree of ``seqs`` and lay it out in one row, sibling set after sibling set
    (breadth first), with each set's attention plan."""
    nodes = build_tree(seqs, min_shared)
    children: dict[int, list[int]] = {}
    for i, node in enumerate(nodes):
        children.setdefault(node.parent, []).append(i)
    ids: list[int] = []
    positions: list[int] = []
    sets: list[SiblingSet] = []
    queue = [-1]
    while queue:
        parent = queue.pop(0)
        kids = children.get(parent, [])
        if not kids:
            continue
        for i in kids:
            node = nodes[i]
            node.offset = len(ids)
            ids.extend(seqs[node.seq][node.start : node.end])
            positions.extend(range(node.start, node.end))
        sets.append(_sibling_set(nodes, parent, kids))
        queue.extend(kids)
    token_index = [
        torch.cat([torch.arange(nodes[i].offset, nodes[i].offset + nodes[i].length) for i in p])
        for p in paths(nodes, len(seqs))
    ]
    rows = []  # the packed position of each output row, in the order the calls produce them
    for s in sets:
        rows.append(s.queries.reshape(-1)[s.valid])
        rows.extend(a[len(s.ancestors) :] for a in s.alone)
    return PackedTree(
        torch.tensor([ids], dtype=torch.long),
        torch.tensor([positions], dtype=torch.long),
        sets,
        token_index,
        [len(s) for s in seqs],
        nodes,
        torch.argsort(torch.cat(rows)),
    )


def _sibling_set(nodes: Sequence[Node], parent: int, kids: list[int]) -> SiblingSet:
    chain: list[int] = []
    p = parent
    while p >= 0:
        chain.append(p)
        p = nodes[p].parent
    ancestors = [
        torch.arange(nodes[i].offset, nodes[i].offset + nodes[i].length) for i in reversed(chain)
    ]
    anc = torch.cat(ancestors) if ancestors else torch.zeros(0, dtype=torch.long)
    # Alone: (A + n)^2 / 2 score entries, causal; batched: n * (A + n) (the mask has no
    # skippable half) plus the padding. Alone wins when n > A (every root: A = 0).
    alone = [i for i in kids if nodes[i].length > len(anc)]
    batched = [i for i in kids if nodes[i].length <= len(anc)]
    own = [torch.arange(nodes[i].offset, nodes[i].offset + nodes[i].length) for i in alone]
    plan = _batched(anc, nodes, batched)
    return SiblingSet(anc, *plan, [torch.cat([anc, o]) for o in own])


def _batched(
    anc: torch.Tensor, nodes: Sequence[Node], kids: list[int]
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``queries``, ``mask`` and ``valid`` of the children attended in one padded call."""
    if not kids:
        empty = torch.zeros(0, dtype=torch.long)
        return torch.zeros(0, 0, dtype=torch.long), None, empty
    lengths = torch.tensor([nodes[i].length for i in kids])
    offsets = torch.tensor([nodes[i].offset for i in kids])
    n_max = int(lengths.max())
    steps = torch.arange(n_max)
    real = steps[None, :] < lengths[:, None]  # [S, n_max]
    queries = offsets[:, None] + torch.minimum(steps[None, :], lengths[:, None] - 1)
    valid = real.reshape(-1).nonzero().squeeze(-1)
    mask = None
    if len(anc) or not bool(real.all()):
        own = (steps[None, :] <= steps[:, None])[None] & real[:, None, :]  # [S, n_max, n_max]
        seen = torch.ones(len(kids), n_max, len(anc), dtype=torch.bool)
        mask = torch.cat([seen, own], dim=-1).unsqueeze(1)
    return queries, mask, valid
