"""Shop-R1 sessions as episodes (env_server/sessions.py, issue 46 point 1): step t's prompt is a
prefix of step t+1's inside a window, every prompt fits its budget, the text is what the chat
template renders, a template that is not append-only is refused, and SFT trains every step's
gold turn exactly once, on the very prompt ids the env samples that step from."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from env_server.config import EnvConfig
from env_server.data.dataset import build_dataset
from env_server.rollout import prompt_ids
from env_server.service import cycle_rows
from env_server.sessions import (
    TURNS,
    NotAppendOnly,
    as_episodes,
    end_of_turn,
    gold_turn,
    session_prompt_ids,
    windows,
)
from trainer.sft_data import LazySplit, encode_session

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def sessions() -> dict[str, list[dict[str, Any]]]:
    rows = as_episodes(build_dataset(num_sessions=40, seed=0)["train"].to_list())
    out: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        out.setdefault(r["session_id"], []).append(r)
    return {k: sorted(v, key=lambda r: r["step"]) for k, v in out.items()}


def _steps_of(found: list) -> Iterator[tuple[int, Any]]:
    """(step, its window's conversation) for every step of a session."""
    first = 0
    for _, end, conv in found:
        for step in range(first, end + 1):
            yield step, conv
        first = end + 1


@pytest.mark.parametrize("budget", [None, 1500, 700])
def test_each_step_is_a_prefix_of_its_window_and_fits(tok, sessions, budget) -> None:
    rebased = 0
    for rows in sessions.values():
        last = rows[-1]
        found = windows(tok, last["pages"], last["previous_actions"], last[TURNS], budget)
        starts = [k for k, _, _ in found]
        assert starts == sorted(starts)  # a window never moves back
        rebased += len(found) - 1
        for step, conv in _steps_of(found):
            ids = session_prompt_ids(rows[step], tok, budget)
            assert ids == prompt_ids(rows[step], tok, budget, latest_only=False)
            assert conv.ids[: len(ids)] == ids
            if budget is not None:
                assert len(ids) <= budget
    if budget is None:
        assert rebased == 0
    else:
        assert rebased > 0  # the budget is tight enough to move windows


def test_ids_spell_what_the_template_renders(tok, sessions) -> None:
    rows = max(sessions.values(), key=len)
    last = rows[-1]
    (_, _, conv), *_ = windows(tok, last["pages"], last["previous_actions"], last[TURNS], None)
    text = tok.apply_chat_template(conv.messages, add_generation_prompt=True, tokenize=False)
    assert tok.decode(conv.ids) == text
    # the history's assistant turns are the gold rationale + action of the earlier steps
    assistant = [m["content"] for m in conv.messages if m["role"] == "assistant"]
    assert assistant == [gold_turn(r) for r in rows[:-1]]
    assert len(rows) >= 3


def test_a_template_that_is_not_append_only_is_refused(tiny_model_dir: Path, sessions) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    # drops every assistant turn but the last one, as templates that strip earlier reasoning do
    tok.chat_template = (
        "{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}"
        "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    rows = next(v for v in sessions.values() if len(v) >= 2)
    assert len(session_prompt_ids(rows[0], tok, None)) > 0  # one page: nothing to append to
    with pytest.raises(NotAppendOnly, match="not append-only"):
        session_prompt_ids(rows[1], tok, None)
    with pytest.raises(NotAppendOnly):
        encode_session(rows, tok, 4096)


@pytest.mark.parametrize("max_seq_len", [4096, 1200])
def test_sft_trains_each_step_once_on_the_prompt_the_env_samples_from(
    tok, sessions, max_seq_len
) -> None:
    eot, _ = end_of_turn(tok)
    windows_seen = 0
    for rows in itertools.islice(sessions.values(), 25):
        examples = encode_session(rows, tok, max_seq_len)
        assert examples is not None
        windows_seen += len(examples)
        targets = []  # (example, start, end) of every trained turn, in order
        for i, ex in enumerate(examples):
            assert len(ex.tokens) <= max_seq_len and len(ex.loss_mask) == len(ex.tokens)
            pos = 0
            for on, run in itertools.groupby(ex.loss_mask):
                n = len(list(run))
                if on:
                    targets.append((i, pos, pos + n))
                pos += n
        assert len(targets) == len(rows)  # every step trained exactly once
        budget = max_seq_len - max(len(tok(gold_turn(r))["input_ids"]) + 1 for r in rows)
        for row, (i, a, b) in zip(rows, targets, strict=True):
            tokens = examples[i].tokens
            assert tokens[a:b] == [*tok(gold_turn(row), add_special_tokens=False)["input_ids"], eot]
            assert tokens[:a] == session_prompt_ids(row, tok, budget)
    if max_seq_len == 1200:
        assert windows_seen > 25  # some sessions needed more than one window


def test_lazy_split_by_session_reads_whole_sessions(tok) -> None:
    split = build_dataset(num_sessions=40, seed=0)["train"]
    lazy = LazySplit(split, tok, 4096, latest_only=False, episode="session")
    assert len(lazy) == len(set(split["session_id"]))
    examples = lazy.take(list(range(len(lazy))))
    assert sum(sum(e.loss_mask) > 0 for e in examples) == len(examples)
    assert len(lazy.first(3)) == 3
    with pytest.raises(ValueError, match="latest_only"):
        LazySplit(split, tok, 4096, latest_only=True, episode="session")


def test_a_session_missing_a_step_is_a_clear_error() -> None:
    rows = build_dataset(num_sessions=12, seed=0)["train"].to_list()
    sid = next(r["session_id"] for r in rows if r["step"] == 2)
    holed = [r for r in rows if not (r["session_id"] == sid and r["step"] == 1)]
    with pytest.raises(ValueError, match=f"session {sid}: step 2 needs the rows of steps \\[1\\]"):
        as_episodes(holed)


def test_sampling_by_session_draws_each_session_whole_and_in_order() -> None:
    rows = build_dataset(num_sessions=20, seed=0)["train"].to_list()
    drawn = list(itertools.islice(cycle_rows(rows, seed=3, by_session=True), len(rows)))
    assert sorted((r["session_id"], r["step"]) for r in drawn) == sorted(
        (r["session_id"], r["step"]) for r in rows
    )
    runs = [list(g) for _, g in itertools.groupby(drawn, key=lambda r: r["session_id"])]
    assert len(runs) == len({r["session_id"] for r in rows})  # each session in one run
    assert all([r["step"] for r in run] == list(range(len(run))) for run in runs)
    # the step form's order is unchanged by the new option
    plain = list(itertools.islice(cycle_rows(rows, seed=3), len(rows)))
    assert plain == list(itertools.islice(cycle_rows(rows, seed=3, by_session=False), len(rows)))


def test_latest_only_and_session_episodes_are_refused_together() -> None:
    with pytest.raises(ValueError, match="latest_only"):
        EnvConfig(latest_only=True, episode="session")
    row = as_episodes(build_dataset(num_sessions=12, seed=0)["train"].to_list())[0]
    with pytest.raises(ValueError, match="latest_only"):
        prompt_ids(row, None, None, latest_only=True)
