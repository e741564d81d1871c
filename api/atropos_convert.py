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


_SEQUENCES = frozenset({"tokens", "masks", "scores", "inference_logprobs"})
"""The ``ScoredData`` fields that become the native sequences; the others are ``atropos``."""


def to_native(payload: str, group_id: str, env: str, policy_version: int) -> str:
    """A stored Atropos group -> native ``ScoredGroup`` JSON (for a native lease): labels
    become the 0/1 ``mask`` (kept verbatim in ``atropos.masks`` if they were not in label
    form), missing logprobs become 0.0 with ``atropos.inference_logprobs_missing``; the other
    fields sent go to ``atropos`` (``api.protocol_atropos.AtroposFields``)."""
    g = json.loads(payload)
    tokens, masks = g["tokens"], g["masks"]
    logprobs = g.get("inference_logprobs")
    fields = {
        k: v for k, v in g.items() if k in ATROPOS_FIELDS and k not in _SEQUENCES and v is not None
    }
    mask01 = [[0 if m == -100 else 1 for m in mask] for mask in masks]
    if any(labels(t, m01) != m for t, m01, m in zip(tokens, mask01, masks, strict=True)):
        fields["masks"] = masks
    if logprobs is None:
        fields["inference_logprobs_missing"] = True
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
        "extras": {},
        "atropos": fields,
    }
    return json.dumps(group, separators=(",", ":"))


def from_native(payload: str) -> str:
    """A stored native group -> Atropos ``ScoredData`` JSON (for ``GET /batch``). Its
    ``atropos`` fields, or ``extras["atropos"]`` in a group stored before that field, are
    served as sent."""
    group = json.loads(payload)
    fields = group.get("atropos") or group.get("extras", {}).get("atropos") or {}
    seqs = group["sequences"]
    out: dict[str, Any] = {k: fields.get(k) for k in ATROPOS_FIELDS}
    out["tokens"] = [s["tokens"] for s in seqs]
    out["masks"] = fields.get("masks") or [labels(s["tokens"], s["mask"]) for s in seqs]
    out["scores"] = [s["score"] for s in seqs]
    missing = fields.get("inference_logprobs_missing", False)
    out["inference_logprobs"] = None if missing else [s["logprobs"] for s in seqs]
    if all(s.get("advantages") is not None for s in seqs):  # a native env's own advantages
        out["advantages"] = [s["advantages"] for s in seqs]
    return json.dumps(out, separators=(",", ":"))


def labels(tokens: list[int], mask: list[int]) -> list[int]:
    """Atropos labels of a 0/1 mask: the token id where trained, -100 elsewhere."""
    return [t if m else -100 for t, m in zip(tokens, mask, strict=False)]
