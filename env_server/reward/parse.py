"""The strict output parser of the Shop-R1 reward (env_server/reward/__init__.py states the
format): ``parse_output`` never raises; a malformed completion is a ``FormatFailure``.

A small hand scanner (values still go through ``json``) catches duplicate keys and knows where
every value sits, so the rationale's character span can be handed to the trainer.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from env_server.actions import ACTION_TYPES, REQUIRED_KEYS, canonical_action


@dataclass(frozen=True)
class ParsedOutput:
    """A well-formed completion."""

    rationale: str
    action: dict[str, str]
    rationale_span: tuple[int, int]
    """Character offsets of the rationale string's content (between its quotes) in the text."""


@dataclass(frozen=True)
class FormatFailure:
    """Why a completion is not well-formed."""

    reason: str


_DECODER = json.JSONDecoder()
_WS = " \t\n\r"


class _Malformed(Exception):
    pass


def _skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in _WS:
        i += 1
    return i


def _scan_object(s: str, i: int) -> tuple[list[tuple[str, Any, int, int]], int]:
    """Scan a JSON object at ``s[i]``: ``[(key, value, value_start, value_end)], end``.

    A small hand scanner (values still go through ``json``) so that duplicate keys are caught
    and the position of every value is known.
    """
    if i >= len(s) or s[i] != "{":
        raise _Malformed("output does not start with a JSON object")
    items: list[tuple[str, Any, int, int]] = []
    i = _skip_ws(s, i + 1)
    if i < len(s) and s[i] == "}":
        return items, i + 1
    while True:
        if i >= len(s) or s[i] != '"':
            raise _Malformed("expected a quoted key")
        key, i = json.decoder.scanstring(s, i + 1)
        i = _skip_ws(s, i)
        if i >= len(s) or s[i] != ":":
            raise _Malformed(f"expected ':' after key {key!r}")
        start = _skip_ws(s, i + 1)
        value, end = _DECODER.raw_decode(s, start)
        items.append((key, value, start, end))
        i = _skip_ws(s, end)
        if i < len(s) and s[i] == ",":
            i = _skip_ws(s, i + 1)
            continue
        if i < len(s) and s[i] == "}":
            return items, i + 1
        raise _Malformed("expected ',' or '}' in the object")


def _check_unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    dup = sorted({k for k in keys if keys.count(k) > 1})
    if dup:
        raise _Malformed(f"duplicate key(s) {dup}")
    return dict(pairs)


_BAD_CHARS = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ud800-\udfff]")
"""Control characters (tab/newline/CR allowed) and lone surrogates (a ``\\ud800`` escape)."""


def _text_problem(v: Any) -> str | None:
    """Why ``v`` is not usable text (a non-empty string with something visible), or None."""
    if not isinstance(v, str):
        return f"got {type(v).__name__}"
    if not any(c.isprintable() and not c.isspace() for c in v):
        return "empty or only invisible characters"
    bad = _BAD_CHARS.search(v)
    if bad:
        return f"contains control/invalid character U+{ord(bad.group()):04X}"
    return None


def _check_action(value: Any) -> dict[str, str]:
    if not isinstance(value, dict):
        raise _Malformed("'action' is not an object")
    kind = value.get("type")
    if kind not in ACTION_TYPES:
        raise _Malformed(f"action type {kind!r} is not one of {list(ACTION_TYPES)}")
    extra = sorted(set(value) - {"type", "name", "text"})
    if extra:
        raise _Malformed(f"unknown action key(s) {extra}")
    for key in ("name", "text"):
        v = value.get(key)
        if key in REQUIRED_KEYS[kind]:
            if problem := _text_problem(v):
                raise _Malformed(f"a {kind} action needs a non-empty string '{key}' ({problem})")
        elif v not in (None, "") or (key in value and not isinstance(v, str)):
            raise _Malformed(f"a {kind} action takes no '{key}'")
    return canonical_action(value)


def parse_output(text: Any) -> ParsedOutput | FormatFailure:
    """Parse a completion strictly; never raises."""
    try:
        if not isinstance(text, str):
            raise _Malformed(f"output is {type(text).__name__}, not text")
        start = _skip_ws(text, 0)
        items, end = _scan_object(text, start)
        if _skip_ws(text, end) != len(text):
            raise _Malformed("text after the JSON object")
        obj = _check_unique([(k, v) for k, v, _, _ in items])
        if set(obj) != {"rationale", "action"}:
            raise _Malformed(f"keys must be exactly rationale and action, got {sorted(obj)}")
        rationale = obj["rationale"]
        if problem := _text_problem(rationale):
            raise _Malformed(f"'rationale' must be a non-empty string ({problem})")
        action_pairs = _action_pairs(text, items)
        action = _check_action(_check_unique(action_pairs))
        r_start, r_end = next((s, e) for k, _, s, e in items if k == "rationale")
        return ParsedOutput(
            rationale=rationale, action=action, rationale_span=(r_start + 1, r_end - 1)
        )
    except (_Malformed, ValueError, RecursionError) as e:
        # json's own errors are ValueError subclasses; RecursionError on absurd nesting.
        return FormatFailure(reason=str(e) or type(e).__name__)


def _action_pairs(text: str, items: list[tuple[str, Any, int, int]]) -> list[tuple[str, Any]]:
    """The action object's (key, value) pairs, duplicates kept (re-scanned from the text)."""
    _, value, start, _ = next(it for it in items if it[0] == "action")
    if not isinstance(value, dict):
        raise _Malformed("'action' is not an object")
    inner, _ = _scan_object(text, start)
    return [(k, v) for k, v, _, _ in inner]


def rationale_char_span(text: str) -> tuple[int, int] | None:
    """Character span of the rationale's content in a well-formed completion, else None."""
    parsed = parse_output(text)
    return parsed.rationale_span if isinstance(parsed, ParsedOutput) else None
