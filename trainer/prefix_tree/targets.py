"""Which predictions of a packed tree's sequences to compute (``Targets``), and their
statistics put back in per-sequence rows.

A prediction ``t`` of sequence ``r`` is of its token ``t + 1``, from the logits at its token
``t``, which sits at ``tree.token_index[r][t]`` in the packed row: a shared prompt's last
token is one packed position that predicts the first token of every completion after it.
Only the wanted predictions (trained or scored tokens) are computed; their statistics go back
to ``[B, L-1]`` rows aligned to ``trainer.batch.collate``'s, 0 elsewhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from trainer.loss import TokenStats
from trainer.prefix_tree.build import PackedTree


@dataclass
class Targets:
    """Which predictions of which sequences to compute, and their next tokens."""

    rows: torch.Tensor
    """``[M]`` sequence index of each prediction."""
    cols: torch.Tensor
    """``[M]`` prediction index ``t`` (predicts token ``t + 1``)."""
    tokens: torch.Tensor
    """``[M]`` the token at ``t + 1``."""
    packed: torch.Tensor
    """``[M]`` where in the packed row the logits of prediction ``t`` are (token ``t``)."""

    def per_sequence(self, stats: TokenStats, n_seqs: int, width: int) -> TokenStats:
        """``stats`` of the ``M`` predictions as ``[n_seqs, width]`` rows (``width`` = longest
        sequence - 1), 0 where no prediction was computed (every consumer masks them out)."""
        device = stats.logprobs.device
        at = (self.rows.to(device), self.cols.to(device))
        zeros = torch.zeros((n_seqs, width), device=device)
        return TokenStats(zeros.index_put(at, stats.logprobs), zeros.index_put(at, stats.entropy))


def targets(
    tree: PackedTree, seqs: Sequence[Sequence[int]], wanted: Sequence[Sequence[int]]
) -> Targets:
    """Predictions ``t`` where ``wanted[r][t + 1]`` is set (a trained or scored token)."""
    rows, cols, toks, packed = [], [], [], []
    for r, (s, w) in enumerate(zip(seqs, wanted, strict=True)):
        index = tree.token_index[r].tolist()
        for t in range(len(s) - 1):
            if w[t + 1]:
                rows.append(r)
                cols.append(t)
                toks.append(s[t + 1])
                packed.append(index[t])
    as_long = lambda x: torch.tensor(x, dtype=torch.long)  # noqa: E731
    return Targets(as_long(rows), as_long(cols), as_long(toks), as_long(packed))
