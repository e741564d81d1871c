"""The Shop-R1 action space, shared by the simulator, the prompts, the parser and the reward.

An action is a small dict. Its canonical form carries exactly the keys its type needs:

    {"type": "click", "name": "add_to_cart"}
    {"type": "type_and_submit", "name": "search_input", "text": "wireless headphones"}
    {"type": "terminate"}
"""

from __future__ import annotations

import json
from typing import Any

ACTION_TYPES: tuple[str, ...] = ("click", "type_and_submit", "terminate")
"""Every action type, in the order used by tables and confusion matrices."""

REQUIRED_KEYS: dict[str, tuple[str, ...]] = {
    "click": ("name",),
    "type_and_submit": ("name", "text"),
    "terminate": (),
}
"""The attributes each type must carry (non-empty strings)."""


def canonical_action(action: dict[str, Any]) -> dict[str, str]:
    """Keep only the keys the type needs, in a fixed order (raises on an unknown type)."""
    kind = action.get("type")
    if kind not in REQUIRED_KEYS:
        raise ValueError(f"unknown action type {kind!r}; expected one of {ACTION_TYPES}")
    out = {"type": kind}
    for key in REQUIRED_KEYS[kind]:
        out[key] = str(action.get(key, ""))
    return out


def action_to_json(action: dict[str, Any]) -> str:
    """The canonical JSON text of an action (what the dataset stores and the model writes)."""
    return json.dumps(canonical_action(action), ensure_ascii=False)


def action_from_json(text: str) -> dict[str, str]:
    """Inverse of :func:`action_to_json` for trusted dataset strings."""
    return canonical_action(json.loads(text))


def normalize_attr(value: str) -> str:
    """Case- and whitespace-insensitive form used for exact-match comparisons."""
    return " ".join(value.lower().split())


def actions_equal(pred: dict[str, Any], gold: dict[str, Any]) -> bool:
    """Exact action match: same type and every required attribute equal after normalizing."""
    if pred.get("type") != gold.get("type") or gold.get("type") not in REQUIRED_KEYS:
        return False
    return all(
        normalize_attr(str(pred.get(k, ""))) == normalize_attr(str(gold.get(k, "")))
        for k in REQUIRED_KEYS[gold["type"]]
    )
