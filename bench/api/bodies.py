"""The request bodies of ``bench/api/throughput.py``: the same groups in Atropos's shape and in
the native data contract (docs/INTERFACES.md), gzip-compressed before the clock starts.
"""

from __future__ import annotations

import gzip
import json
from typing import Any


def atropos_group(g: int, group_size: int, seq_len: int) -> dict[str, Any]:
    """One group in Atropos's ``ScoredData`` shape; ``g`` makes its content unique."""
    half = seq_len // 2
    tokens, masks = [], []
    for s in range(group_size):
        toks = [g % 4096, s] + [1000 + (j % 3000) for j in range(seq_len - 2)]
        tokens.append(toks)
        masks.append([-100] * half + toks[half:])
    return {
        "tokens": tokens,
        "masks": masks,
        "scores": [0.5] * group_size,
        "inference_logprobs": [[-0.1234567] * seq_len for _ in range(group_size)],
    }


def native_group(g: int, group_size: int, seq_len: int) -> dict[str, Any]:
    """The same content as ``atropos_group`` in the native data contract."""
    a = atropos_group(g, group_size, seq_len)
    seqs = [
        {"tokens": t, "mask": [0 if m == -100 else 1 for m in mk], "logprobs": lp, "score": sc}
        for t, mk, lp, sc in zip(
            a["tokens"], a["masks"], a["inference_logprobs"], a["scores"], strict=True
        )
    ]
    return {"group_id": f"bench-{g}", "env": "bench", "policy_version": 0, "sequences": seqs}


def encode_bodies(
    target: str, n_groups: int, group_size: int, seq_len: int, per_push: int
) -> list[bytes]:
    """Gzip-compressed request bodies, ``per_push`` groups each."""
    make = native_group if target == "ours-native" else atropos_group
    bodies = []
    for start in range(0, n_groups, per_push):
        groups = [
            make(g, group_size, seq_len) for g in range(start, min(n_groups, start + per_push))
        ]
        payload = {"groups": groups} if target == "ours-native" else groups
        bodies.append(gzip.compress(json.dumps(payload).encode(), compresslevel=1))
    return bodies
