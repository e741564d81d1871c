"""Converting a stored group between the Atropos ``ScoredData`` shape and the native
contract (docs/INTERFACES.md): a native lease serves Atropos groups as native ``ScoredGroup``
JSON (``to_native``), Atropos's ``GET /batch`` serves native groups as ``ScoredData``
(``from_native``). Plain ``json`` on already-validated payloads: the native lease path uses
this module and never loads the Atropos wire parser (``api.atropos_wire``, msgspec).
"""

from __future__ import annotations

import json
from typing import Any

ATROPOS_FIELDS = (
    "tokens",
    "masks",
    "scores",
    "advantages",
    "ref_logprobs",
    "messages",
    "generation_params",
    "inference_logprobs",
    "overrides",
    "group_overrides",
    "images",
    "env_id",
    "distill_token_ids",
    "distill_logprobs",
)
"""atroposlib 0.4.0's ``ScoredData`` fields, in its order (``api.atropos_wire.AtroposItem``
declares the same)."""


def to_native(payload: str, group_id: str, env: str, policy_version: int) -> str:
    """A stored Atropos group -> native ``ScoredGroup`` JSON (for a native lease): labels
    become the 0/1 ``mask`` (kept verbatim in extras if they were not in label form),
    missing logprobs become 0.0 with ``extras.atropos.inference_logprobs_missing``."""
    g = json.loads(payload)
    tokens, masks = g["tokens"], g["masks"]
    logprobs = g.get("inference_logprobs")
    extras = {
        k: v
        for k, v in g.items()
        if k not in ("tokens", "masks", "scores", "inference_logprobs") and v is not None
    }
    mask01 = [[0 if m == -100 else 1 for m in mask] for mask in masks]
    if any(labels(t, m01) != m for t, m01, m in zip(tokens, mask01, masks, strict=True)):
        extras["masks"] = masks
    if logprobs is None:
        extras["inference_logprobs_missing"] = True
        logprobs = [[0.0] * len(t) for t in tokens]
    seqs = [
        {"tokens": t, "mask": m, "logprobs": lp, "score": s}
        for t, m, lp, s in zip(tokens, mask01, logprobs, g["scores"], strict=True)
    ]
    group = {
        "group_id": group_id,
        "env": env,
        "policy_version": policy_version,
        "sequences": seqs,
        "metrics": {},
        "extras": {"atropos": extras},
    }
    return json.dumps(group, separators=(",", ":"))


def from_native(payload: str) -> str:
    """A stored native group -> Atropos ``ScoredData`` JSON (for ``GET /batch``)."""
    group = json.loads(payload)
    extras = group.get("extras", {}).get("atropos", {})
    seqs = group["sequences"]
    out: dict[str, Any] = {k: extras.get(k) for k in ATROPOS_FIELDS}
    out["tokens"] = [s["tokens"] for s in seqs]
    out["masks"] = extras.get("masks") or [labels(s["tokens"], s["mask"]) for s in seqs]
    out["scores"] = [s["score"] for s in seqs]
    missing = extras.get("inference_logprobs_missing", False)
    out["inference_logprobs"] = None if missing else [s["logprobs"] for s in seqs]
    if all(s.get("advantages") is not None for s in seqs):  # a native env's own advantages
        out["advantages"] = [s["advantages"] for s in seqs]
    return json.dumps(out, separators=(",", ":"))


def labels(tokens: list[int], mask: list[int]) -> list[int]:
    """Atropos labels of a 0/1 mask: the token id where trained, -100 elsewhere."""
    return [t if m else -100 for t, m in zip(tokens, mask, strict=False)]
