"""Shop-R1 rows -> SFT examples: chat-templated prompt (masked) + rationale/action JSON target.

The prompt is the session so far; when it does not fit ``max_seq_len`` next to the target,
``env_server.prompts.build_messages`` drops whole pages from the oldest end (the context is
left-truncated page by page, so no page is cut in half and the latest page always stays).
"""

from __future__ import annotations

import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

# Rollouts and SFT must tokenize prompts identically: one function serves both.
from env_server.rollout import prompt_ids
from env_server.sessions import NotAppendOnly, end_of_turn

log = logging.getLogger(__name__)


@dataclass
class SftExample:
    tokens: list[int]
    loss_mask: list[int]
    """1 on target tokens (rationale/action JSON and the closing end-of-turn token)."""
    prompt_len: int


def load_or_build_dataset(data_dir: str | Path, num_sessions: int | None) -> Any:
    """The dataset at ``data_dir``; generated (deterministically, with the data seed
    ``settings.paths.DATA_SEED``, not the SFT's) and saved first if missing."""
    from env_server.data.dataset import load_or_build

    return load_or_build(data_dir, num_sessions=num_sessions)


def end_of_turn_id(tokenizer: Any) -> int:
    """The token that closes the assistant turn (``<|im_end|>`` for ChatML), i.e. the EOS:
    the one the session form ends its turns with (``env_server.sessions.end_of_turn``)."""
    return end_of_turn(tokenizer)[0]


def encode_example(
    row: dict[str, Any], tokenizer: Any, max_seq_len: int, latest_only: bool = False
) -> SftExample | None:
    """One training example, or None when even the shortest context does not fit."""
    from env_server.prompts import format_target

    target = format_target(row["rationale"], json.loads(row["action"]))
    target_ids = tokenizer(target, add_special_tokens=False)["input_ids"]
    target_ids = [*target_ids, end_of_turn_id(tokenizer)]
    budget = max_seq_len - len(target_ids)
    if budget <= 0:
        return None
    try:
        p_ids = prompt_ids(row, tokenizer, budget, latest_only)
    except ValueError:  # build_messages: the budget cannot hold even the current page's frame
        return None
    if len(p_ids) > budget:
        return None
    return SftExample(p_ids + target_ids, [0] * len(p_ids) + [1] * len(target_ids), len(p_ids))


def encode_split(
    rows: Any, tokenizer: Any, max_seq_len: int, latest_only: bool
) -> list[SftExample]:
    """Every row's example, in row order, rows that do not fit left out (with a warning).

    Rows are encoded on as many threads as torch may use: the fast tokenizer releases the GIL
    while it encodes, which is most of the time here (1.9x on 2 cores; the examples are the
    same as one thread's, tests/unit/trainer/test_sft_data.py)."""
    encode = partial(
        encode_example, tokenizer=tokenizer, max_seq_len=max_seq_len, latest_only=latest_only
    )
    with ThreadPoolExecutor(_workers()) as pool:
        examples = [ex for ex in pool.map(encode, rows) if ex is not None]
    skipped = len(rows) - len(examples)
    if skipped:
        log.warning(
            "%d of %d rows do not fit max_seq_len=%d even with the shortest context; left out",
            skipped,
            len(rows),
            max_seq_len,
        )
    if not examples:
        raise ValueError(f"no example fits max_seq_len={max_seq_len}")
    return examples


def encode_session(
    rows: list[dict[str, Any]], tokenizer: Any, max_seq_len: int
) -> list[SftExample] | None:
    """A session's examples (``episode: session``): the session as one conversation, one
    sequence per window of it (``env_server.sessions.windows``), every step's assistant turn a
    target in the window its prompt is in; None when even one page does not fit."""
    from env_server.sessions import gold_turn, windows

    rows = sorted(rows, key=lambda r: int(r["step"]))
    if [int(r["step"]) for r in rows] != list(range(len(rows))):
        raise ValueError(
            f"session {rows[0]['session_id']}: steps {[r['step'] for r in rows]} are "
            "not 0, 1, ...: a session needs all its rows"
        )
    turns = [gold_turn(r) for r in rows]
    longest = max(len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in turns) + 1
    last = rows[-1]
    try:
        found = windows(
            tokenizer, last["pages"], last["previous_actions"], turns[:-1], max_seq_len - longest
        )
    except NotAppendOnly:
        raise
    except ValueError:  # the budget cannot hold even one page's frame
        return None
    out, first = [], 0
    for k, end, conv in found:
        ids, spans = conv.answer(turns[end])
        mask = [0] * len(ids)
        for step, (a, b) in enumerate(spans, start=k):
            if step >= first:  # a step trains in the window its own prompt is in
                mask[a:b] = [1] * (b - a)
        out.append(SftExample(ids, mask, mask.index(1)))
        first = end + 1
    return out


class LazySplit:
    """A split's rows, each encoded the first time a batch asks for it: a run reads a fraction
    of a large split (the default SFT, 3,600 of 9,365 training rows), so encoding the whole
    split up front was most of its start-up. A batch's rows are encoded on as many threads as
    :func:`encode_split` uses, and each result is kept. Indices are rows, not examples: a row
    that cannot fit is ``None`` (warned about once), and :meth:`take` skips it.

    ``episode="session"``: indices are sessions (in the order their first row appears), each
    encoded by :func:`encode_session` into one example per window."""

    def __init__(
        self,
        rows: Any,
        tokenizer: Any,
        max_seq_len: int,
        latest_only: bool,
        episode: str = "step",
        stratify: str = "none",
    ) -> None:
        self.rows, self.max_seq_len, self.episode = rows, max_seq_len, episode
        self.stratify = stratify
        self._labels: list[str] | None = None
        self._order: tuple[int, int, list[int]] | None = None  # (seed, epoch, order) last drawn
        self.units: list[list[int]] | None = None
        if stratify not in ("none", "action_type"):
            raise ValueError(f"stratify: {stratify!r} is not 'none' or 'action_type'")
        if episode == "session":
            if latest_only:
                raise ValueError(
                    "latest_only shows one page; it does not apply to episode: session"
                )
            if stratify != "none":
                raise ValueError(
                    "stratify: action_type balances steps; a session holds steps of every "
                    "type, so it does not apply to episode: session"
                )
            ids = (
                rows["session_id"]
                if hasattr(rows, "column_names")
                else [r["session_id"] for r in rows]
            )
            sessions: dict[str, list[int]] = {}
            for i, sid in enumerate(ids):
                sessions.setdefault(sid, []).append(i)
            self.units = list(sessions.values())
            self._encode = partial(encode_session, tokenizer=tokenizer, max_seq_len=max_seq_len)
        else:
            one = partial(
                encode_example,
                tokenizer=tokenizer,
                max_seq_len=max_seq_len,
                latest_only=latest_only,
            )
            self._encode = lambda row: None if (ex := one(row)) is None else [ex]
        self._done: dict[int, list[SftExample] | None] = {}
        self.skipped: list[int] = []  # rows (sessions) drawn so far that cannot fit, in order

    def __len__(self) -> int:
        return len(self.rows) if self.units is None else len(self.units)

    def _unit(self, i: int) -> Any:
        return self.rows[i] if self.units is None else [self.rows[j] for j in self.units[i]]

    def take(self, indices: list[int]) -> list[SftExample]:
        """The examples of rows (sessions) ``indices`` that fit, in that order."""
        todo = [i for i in dict.fromkeys(indices) if i not in self._done]
        units = [self._unit(i) for i in todo]
        with ThreadPoolExecutor(_workers()) as pool:
            encoded = list(pool.map(self._encode, units))
        for i, ex in zip(todo, encoded, strict=True):
            if ex is None:
                self.skipped.append(i)
                what = "row" if self.units is None else "session"
                log.warning("%s %d does not fit max_seq_len=%d; skipped", what, i, self.max_seq_len)
            self._done[i] = ex
        return [ex for i in indices for ex in self._done[i] or []]

    def order(self, seed: int, epoch: int) -> list[int]:
        """The rows (sessions) of an epoch in the order a run draws them: shuffled
        (:func:`epoch_order`), or with ``stratify: action_type`` shuffled within each action
        type and interleaved so that every batch holds the types in the split's proportions
        (:func:`stratified_order`). A pure function of (seed, epoch) either way, so the last
        one is kept: a run asks for it at every batch."""
        if self._order is not None and self._order[:2] == (seed, epoch):
            return self._order[2]
        if self.stratify == "none":
            order = epoch_order(len(self), seed, epoch)
        else:
            if self._labels is None:
                rows = self.rows
                self._labels = list(
                    rows["action_type"]
                    if hasattr(rows, "column_names")
                    else [r["action_type"] for r in rows]
                )
            order = stratified_order(self._labels, seed, epoch)
        self._order = (seed, epoch, order)
        return order

    def first(self, n: int) -> list[SftExample]:
        """The first ``n`` examples that fit (held-out losses read these)."""
        out: list[SftExample] = []
        start = 0
        while len(out) < n and start < len(self):
            stop = min(len(self), start + n - len(out))
            out += self.take(list(range(start, stop)))
            start = stop
        return out[:n]


def _workers() -> int:
    """Encoding threads: as many as torch may use, on the CPUs this process may run on."""
    return max(1, min(torch.get_num_threads(), len(os.sched_getaffinity(0))))


def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    """The shuffled example order of an epoch: a pure function of (seed, epoch), so a resumed
    run sees exactly the order the uninterrupted run would have."""
    g = torch.Generator().manual_seed(seed * 100_003 + epoch)
    return torch.randperm(n, generator=g).tolist()


def stratified_order(labels: list[str], seed: int, epoch: int) -> list[int]:
    """Indices ``0..len(labels)-1`` shuffled as :func:`epoch_order` shuffles them, then dealt
    so that every prefix holds each label in its share of the whole, to within one: at each
    position the label furthest behind its share comes next (ties: the label first in sorted
    order), with that label's indices in shuffled order. A batch of the order then has the
    split's mix of labels, whichever rows the seed draws."""
    queues: dict[str, list[int]] = {}
    for i in epoch_order(len(labels), seed, epoch):
        queues.setdefault(labels[i], []).append(i)
    names = sorted(queues)
    share = {k: len(queues[k]) / len(labels) for k in names}
    taken = dict.fromkeys(names, 0)
    out: list[int] = []
    for pos in range(1, len(labels) + 1):
        left = [k for k in names if taken[k] < len(queues[k])]
        k = max(left, key=lambda k: (pos * share[k] - taken[k], -names.index(k)))
        out.append(queues[k][taken[k]])
        taken[k] += 1
    return out
