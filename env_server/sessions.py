"""Shop-R1 sessions as episodes: a session is one conversation, each page a user turn, each
action (with its rationale) an assistant turn.

In the step form (``env_server.prompts``) every step is its own prompt that repeats the
session's earlier pages, so SFT, vLLM and the trainer compute those pages again for every
step. Here step t's prompt is the conversation up to page t, and its token ids are a prefix
of step t+1's: SFT trains a whole session in one sequence (every assistant turn a target),
and the prefix tree and vLLM's prefix cache compute the shared history once.

Token ids are built turn by turn, never by re-tokenizing the whole conversation: the ids of
step t+1 are step t's ids, the assistant turn's own ids (as the model writes them, then the
end-of-turn token), then the template's text up to the next generation prompt. The rendered
text must grow by exactly that (the template must be append-only for these messages);
otherwise :class:`NotAppendOnly` is raised, never a silently different sequence.

The history the model sees at step t is the paper's context (every earlier page and action)
plus the earlier steps' rationales (the assistant turns are the gold rationale + action).
When it does not fit the prompt budget, the conversation restarts at a later page: its first
user message lists the actions of the pages left out (as the step form does) and holds the
first page kept. The window only moves forward, and it moves to the earliest page that
fits, so every step sees as many pages as fit and the steps of one window share their ids.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from env_server.prompts import TRUNCATION_MARK, format_target

TURNS = "previous_turns"
"""The row key :func:`as_episodes` adds: the gold assistant turns of the session's earlier
steps, oldest first. A row that has it is rendered as a conversation."""

SESSION_SYSTEM_PROMPT = (
    "You simulate a real person shopping online. Each user message is the simplified HTML of "
    "the next page the shopper visits in this session; you answer each page with the "
    "shopper's action on it.\n"
    "Answer with exactly one JSON object and nothing else, in this form:\n"
    '{"rationale": "<why the shopper does this, in the first person>", '
    '"action": {"type": "<click|type_and_submit|terminate>", "name": "<element name>", '
    '"text": "<text to type>"}}\n'
    'Rules: "click" needs "name"; "type_and_submit" needs "name" and "text"; "terminate" '
    '(the shopper leaves the site) needs neither. "name" is the name attribute of an element '
    "on the page of the last user message."
)


class NotAppendOnly(ValueError):
    """The chat template does not render a conversation as its earlier turns plus the new one."""


def gold_turn(row: Mapping[str, Any]) -> str:
    """The assistant turn of a row: its gold rationale and action, as the model writes them."""
    return format_target(row["rationale"], json.loads(row["action"]))


def as_episodes(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Every row with :data:`TURNS`, the gold turns of its session's earlier steps (taken from
    the other rows of the session, which must all be in ``rows``)."""
    turns: dict[str, dict[int, str]] = {}
    for r in rows:
        turns.setdefault(r["session_id"], {})[int(r["step"])] = gold_turn(r)
    out = []
    for r in rows:
        have = turns[r["session_id"]]
        missing = [i for i in range(int(r["step"])) if i not in have]
        if missing:
            raise ValueError(
                f"session {r['session_id']}: step {r['step']} needs the rows of steps "
                f"{missing} for its history, which are not in this split"
            )
        out.append({**r, TURNS: [have[i] for i in range(int(r["step"]))]})
    return out


def end_of_turn(tokenizer: Any) -> tuple[int, str]:
    """The token that closes an assistant turn (``<|im_end|>`` in ChatML, else EOS) and its
    text in a rendered template."""
    tok_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if not isinstance(tok_id, int) or tok_id == tokenizer.unk_token_id:
        tok_id = int(tokenizer.eos_token_id)
    return tok_id, tokenizer.convert_ids_to_tokens(tok_id)


def _page(pages: Sequence[str], i: int) -> str:
    return f"## Page {i + 1}\n{pages[i]}"


def _first_user(pages: Sequence[str], actions: Sequence[str], k: int) -> str:
    if not k:
        return _page(pages, 0)
    listed = "\n".join(f"Page {i + 1} action: {actions[i]}" for i in range(k))
    return (
        f"[The HTML of the {k} oldest page(s) of this session is omitted to fit the context "
        f"budget; their actions were:]\n{listed}\n\n{_page(pages, k)}"
    )


@dataclass
class Conversation:
    """One window of a session as token ids, grown turn by turn (see the module's text)."""

    tokenizer: Any
    messages: list[dict[str, str]]
    text: str = ""
    ids: list[int] = field(default_factory=list)
    targets: list[tuple[int, int]] = field(default_factory=list)
    """``[start, end)`` of every assistant turn in ``ids`` (its tokens and the end of turn)."""

    @classmethod
    def start(cls, tokenizer: Any, first_user: str) -> Conversation:
        msgs = [
            {"role": "system", "content": SESSION_SYSTEM_PROMPT},
            {"role": "user", "content": first_user},
        ]
        conv = cls(tokenizer, msgs)
        conv.text = conv._render(msgs)
        conv.ids = conv._encode(conv.text)
        return conv

    def _render(self, msgs: list[dict[str, str]]) -> str:
        return self.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def answer(self, turn: str) -> tuple[list[int], list[tuple[int, int]]]:
        """The ids with assistant ``turn`` and its end of turn appended (an SFT sequence's end),
        and every target span."""
        eot, _ = end_of_turn(self.tokenizer)
        ids = [*self.ids, *self._encode(turn), eot]
        return ids, [*self.targets, (len(self.ids), len(ids))]

    def extend(self, turn: str, user: str) -> Conversation:
        """The conversation with assistant ``turn`` and the next ``user`` page appended."""
        _, eot_text = end_of_turn(self.tokenizer)
        msgs = [
            *self.messages,
            {"role": "assistant", "content": turn},
            {"role": "user", "content": user},
        ]
        text = self._render(msgs)
        head = self.text + turn + eot_text
        if not text.startswith(head):
            raise NotAppendOnly(
                "the chat template does not render a session as its earlier turns plus the new "
                "one (it is not append-only for these messages), so a session's steps cannot "
                "share their tokens: use the step form (episode: step)"
            )
        ids, targets = self.answer(turn)
        ids += self._encode(text[len(head) :])
        return Conversation(self.tokenizer, msgs, text, ids, targets)


def _window(
    tokenizer: Any,
    pages: Sequence[str],
    actions: Sequence[str],
    turns: Sequence[str],
    k: int,
    t: int,
) -> Conversation:
    """The conversation of pages ``k..t`` (the earlier ones' actions listed first)."""
    conv = Conversation.start(tokenizer, _first_user(pages, actions, k))
    for i in range(k + 1, t + 1):
        conv = conv.extend(turns[i - 1], _page(pages, i))
    return conv


def _cut_current(
    tokenizer: Any, pages: Sequence[str], actions: Sequence[str], budget: int
) -> Conversation:
    """Only the current page, its tail cut to fit ``budget`` (binary search on its length)."""
    t = len(pages) - 1

    def fit(n: int) -> Conversation:
        cut = [*pages[:t], pages[t][:n] + TRUNCATION_MARK]
        return Conversation.start(tokenizer, _first_user(cut, actions, t))

    lo, hi = 0, len(pages[t])
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(fit(mid).ids) <= budget:
            lo = mid
        else:
            hi = mid - 1
    conv = fit(lo)
    if len(conv.ids) > budget:
        raise ValueError(f"a prompt budget of {budget} tokens is too small for even an empty page")
    return conv


def windows(
    tokenizer: Any,
    pages: Sequence[str],
    actions: Sequence[str],
    turns: Sequence[str],
    budget: int | None,
) -> list[tuple[int, int, Conversation]]:
    """The session's windows ``(first page, last page, conversation up to the last page)``,
    each step's prompt at most ``budget`` tokens (None: one window). A window moves to the
    earliest page at which the current step fits, and never back; a page too long even alone
    is cut (its window then ends there)."""
    out: list[tuple[int, int, Conversation]] = []
    k, conv, cut = 0, None, False
    for t in range(len(pages)):
        if conv is not None and not cut:
            grown = conv.extend(turns[t - 1], _page(pages, t))
            if budget is None or len(grown.ids) <= budget:
                conv = grown
                continue
        if conv is not None:
            out.append((k, t - 1, conv))
        first = out[-1][0] + 1 if out else 0
        conv, cut = None, False
        for j in range(first, t + 1):
            cand = _window(tokenizer, pages, actions, turns, j, t)
            if budget is None or len(cand.ids) <= budget:
                k, conv = j, cand
                break
        if conv is None:
            k, conv, cut = t, _cut_current(tokenizer, pages[: t + 1], actions, budget), True
    assert conv is not None
    out.append((k, len(pages) - 1, conv))
    return out


def session_prompt_ids(row: Mapping[str, Any], tokenizer: Any, budget: int | None) -> list[int]:
    """Step ``row['step']``'s prompt ids: the conversation up to its page, within ``budget``."""
    pages, actions, turns = list(row["pages"]), list(row["previous_actions"]), list(row[TURNS])
    if not pages or len(actions) != len(pages) - 1 or len(turns) != len(actions):
        raise ValueError(
            f"row {row.get('session_id')}/{row.get('step')}: needs one previous action and one "
            f"previous turn per earlier page, got {len(pages)} pages, {len(actions)} actions "
            f"and {len(turns)} turns"
        )
    return windows(tokenizer, pages, actions, turns, budget)[-1][2].ids
