"""Prompt builder: the system prompt, the session context, and the assistant target.

The user message holds the whole session so far (paper Sec. 3): the simplified HTML of every
page, oldest first, each followed by the action taken on it, then the current page. When a
token budget is given and the session does not fit, the HTML of the OLDEST pages is dropped
first (their actions stay, they are short and carry the trajectory) and the prompt says how
many pages were left out; only if the current page alone is too long is it cut, also with a
note. ``latest_only=True`` is the paper's Table 5 ablation: the current page and the list of
earlier actions, no earlier HTML.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from env_server.actions import canonical_action

SYSTEM_PROMPT = (
    "You simulate a real person shopping online. You are shown the simplified HTML of the "
    "pages the shopper has visited in this session and the actions they took, and you predict "
    "the shopper's next action on the current page.\n"
    "Answer with exactly one JSON object and nothing else, in this form:\n"
    '{"rationale": "<why the shopper does this, in the first person>", '
    '"action": {"type": "<click|type_and_submit|terminate>", "name": "<element name>", '
    '"text": "<text to type>"}}\n'
    'Rules: "click" needs "name"; "type_and_submit" needs "name" and "text"; "terminate" '
    '(the shopper leaves the site) needs neither. "name" is the name attribute of an element '
    "on the current page."
)

QUESTION = "What does the shopper do next? Answer with one JSON object."
TRUNCATION_MARK = "\n[... rest of this page cut to fit the context budget ...]"

Tokenizer = Any  # anything with .encode(text, add_special_tokens=False) -> list[int]


def format_target(rationale: str, action: Mapping[str, Any]) -> str:
    """The assistant message the model is trained to write (and the parser accepts)."""
    return json.dumps(
        {"rationale": rationale, "action": canonical_action(dict(action))}, ensure_ascii=False
    )


def token_counter(tokenizer: Tokenizer | None) -> Callable[[str], int]:
    """Count tokens with ``tokenizer``; without one, estimate 3 characters per token.

    The estimate is deliberately pessimistic (the Shop-R1 BPE averages ~3.5-4 characters per
    token on this HTML), so a budget met by the estimate is met by the real tokenizer too.
    """
    if tokenizer is None:
        return lambda text: (len(text) + 2) // 3
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False))


def _history(pages: Sequence[str], actions: Sequence[str], omitted: int) -> str:
    parts = ["Session so far, oldest page first."]
    if omitted:
        listed = "\n".join(f"Page {i + 1} action: {actions[i]}" for i in range(omitted))
        parts.append(
            f"[The HTML of the {omitted} oldest page(s) is omitted to fit the context budget; "
            f"their actions were:]\n{listed}"
        )
    last = len(pages) - 1
    for i in range(omitted, last):
        parts.append(f"## Page {i + 1}\n{pages[i]}\nAction: {actions[i]}")
    parts.append(f"## Page {last + 1} (current)\n{pages[last]}")
    parts.append(QUESTION)
    return "\n\n".join(parts)


def _latest(pages: Sequence[str], actions: Sequence[str]) -> str:
    done = "\n".join(f"{i + 1}. {a}" for i, a in enumerate(actions)) or "(none)"
    return f"Earlier actions in this session:\n{done}\n\n## Current page\n{pages[-1]}\n\n{QUESTION}"


def _messages(user: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]


def build_messages(
    row: Mapping[str, Any],
    tokenizer: Tokenizer | None = None,
    max_context_tokens: int | None = None,
    latest_only: bool = False,
) -> list[dict[str, str]]:
    """System + user chat messages for one dataset row (see docs/INTERFACES.md for the row).

    ``max_context_tokens`` bounds the tokens of both messages' contents together (leave a few
    tokens for the chat template's markers when you pick it).
    """
    pages, actions = list(row["pages"]), list(row["previous_actions"])
    if not pages or len(actions) != len(pages) - 1:
        raise ValueError(
            f"row {row.get('session_id')}/{row.get('step')}: needs >=1 page and one previous "
            f"action per earlier page, got {len(pages)} pages and {len(actions)} actions"
        )
    if latest_only:
        return _fit_current(_latest, pages, actions, tokenizer, max_context_tokens)
    if max_context_tokens is None:
        return _messages(_history(pages, actions, 0))
    count = token_counter(tokenizer)
    omitted = _fewest_omitted(pages, actions, count, max_context_tokens - count(SYSTEM_PROMPT))
    if omitted is not None:
        return _messages(_history(pages, actions, omitted))
    render = lambda p, a: _history(p, a, len(p) - 1)  # noqa: E731
    return _fit_current(render, pages, actions, tokenizer, max_context_tokens)


def _fewest_omitted(
    pages: Sequence[str], actions: Sequence[str], count: Callable[[str], int], budget: int
) -> int | None:
    """The fewest oldest pages whose HTML must be omitted for the history to fit ``budget``
    tokens; None when even omitting every earlier page is not enough.

    The answer of trying 0, 1, 2, ... omitted pages in turn (each page omitted shortens the
    history), found with a few tokenizations instead of one per page: the history's tokens
    per character give a first guess, then real counts walk to the first omission that fits.
    """
    fits = lambda k: count(_history(pages, actions, k)) <= budget  # noqa: E731
    full = _history(pages, actions, 0)
    tokens = count(full)
    if tokens <= budget:
        return 0
    last = len(pages) - 1
    per_char = tokens / len(full)
    estimate = lambda k: len(_history(pages, actions, k)) * per_char  # noqa: E731
    k = next((k for k in range(1, last) if estimate(k) <= budget), last)
    if fits(k):
        while k > 1 and fits(k - 1):
            k -= 1
        return k
    while k < last:
        k += 1
        if fits(k):
            return k
    return None


def _fit_current(
    render: Callable[[Sequence[str], Sequence[str]], str],
    pages: Sequence[str],
    actions: Sequence[str],
    tokenizer: Tokenizer | None,
    budget: int | None,
) -> list[dict[str, str]]:
    """Render; if over budget, cut the current page's tail (binary search on its length)."""
    user = render(pages, actions)
    if budget is None:
        return _messages(user)
    count = token_counter(tokenizer)
    fixed = count(SYSTEM_PROMPT)
    if fixed + count(user) <= budget:
        return _messages(user)
    current = pages[-1]
    lo, hi = 0, len(current)
    while lo < hi:  # longest prefix of the current page that fits
        mid = (lo + hi + 1) // 2
        cut = [*pages[:-1], current[:mid] + TRUNCATION_MARK]
        if fixed + count(render(cut, actions)) <= budget:
            lo = mid
        else:
            hi = mid - 1
    cut = [*pages[:-1], current[:lo] + TRUNCATION_MARK]
    user = render(cut, actions)
    if fixed + count(user) > budget:
        raise ValueError(f"max_context_tokens={budget} is too small for even an empty page")
    return _messages(user)
