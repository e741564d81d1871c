"""What the endpoint is asked for one row (the paper's instruction, the row's context) and the
row's stable id, the key of the resume cache (docs/SYNTHESIS.md)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

INSTRUCTION = (
    "You explain the behaviour of a real person shopping online. You are shown the pages of "
    "their session so far and the action they take next. Explain why they take this next "
    'action: write their reason in ONE short sentence, in the first person ("I ..."), as '
    "the shopper would think it. Use only what is on the page and what they are looking for; "
    "do not mention any user-profile information (persona, age, gender, income, job, "
    "location). Answer with that one sentence only, no quotes, no preamble."
)
"""The paper's instruction for rationale synthesis (Shop-R1, Sec. 3.1), in our words."""

INSTRUCTION_VERSION = 1
"""Bumped when INSTRUCTION changes; cached rationales from another version are not reused."""


def row_id(row: Mapping[str, Any]) -> str:
    """Stable id of a row: a hash of what the rationale depends on (not of its position)."""
    key = [
        INSTRUCTION_VERSION,
        row["session_id"],
        int(row["step"]),
        list(row["previous_actions"]),
        row["action"],
        list(row["pages"])[-1],
    ]
    return hashlib.sha256(json.dumps(key, ensure_ascii=False).encode()).hexdigest()[:24]


def build_request_messages(row: Mapping[str, Any], max_context_chars: int) -> list[dict[str, str]]:
    """System (the instruction) + user (earlier actions, current page, the next action)."""
    page = list(row["pages"])[-1]
    if len(page) > max_context_chars:
        page = page[:max_context_chars] + "\n[... rest of the page cut ...]"
    earlier = list(row["previous_actions"])[-10:]
    history = "\n".join(f"{i + 1}. {a}" for i, a in enumerate(earlier)) or "(none)"
    user = (
        f"Earlier actions in this session (most recent last):\n{history}\n\n"
        f"Current page (simplified HTML):\n{page}\n\n"
        f"The shopper's next action: {row['action']}\n\n"
        "Why does the shopper take this action? One short first-person sentence."
    )
    return [{"role": "system", "content": INSTRUCTION}, {"role": "user", "content": user}]
