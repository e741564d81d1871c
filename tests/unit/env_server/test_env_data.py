"""Simulator, corpus, dataset and prompt builder."""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from dataclasses import asdict

import pytest

from env_server.actions import action_from_json
from env_server.data.corpus import iter_corpus_texts
from env_server.data.dataset import build_dataset, load_dataset_dir, save_dataset
from env_server.data.simulator import generate_sessions
from env_server.prompts import SYSTEM_PROMPT, build_messages, format_target
from env_server.reward import ParsedOutput, parse_output, score

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def sessions():
    return generate_sessions(600, seed=0)


def test_simulator_is_deterministic_and_prefix_stable(sessions) -> None:
    again = generate_sessions(50, seed=0)
    assert [asdict(s) for s in again] == [asdict(s) for s in sessions[:50]]
    other = generate_sessions(50, seed=1)
    assert [asdict(s) for s in other] != [asdict(s) for s in again]


def test_simulator_is_fast() -> None:
    t = time.process_time()
    generate_sessions(1000, seed=3)
    # ~2.5 s of CPU; the bound is on this process's CPU time, which a busy box does not stretch
    assert time.process_time() - t < 30


def test_sessions_are_well_formed(sessions) -> None:
    for s in sessions:
        kinds = [st.action["type"] for st in s.steps]
        assert kinds[-1] == "terminate" and "terminate" not in kinds[:-1]
        for st in s.steps:
            names = re.findall(r'name="([^"]+)"', st.page)
            assert len(names) == len(set(names)), f"duplicate element names on a page: {names}"
            if "name" in st.action:  # every action names an element of its own page
                assert st.action["name"] in names, (st.action, st.page)
            assert st.rationale.strip()
            probs = dict(st.alternatives)
            assert sum(probs.values()) == pytest.approx(1.0, abs=1e-3)
            assert json.dumps(st.action) in probs


def test_behaviour_is_stochastic_and_types_balanced(sessions) -> None:
    counts = Counter(st.action["type"] for s in sessions for st in s.steps)
    total = sum(counts.values())
    share = {k: v / total for k, v in counts.items()}
    # Paper-like balance: click and type_and_submit each more frequent than terminate.
    assert share["click"] > share["terminate"] and share["type_and_submit"] > share["terminate"]
    assert all(0.15 < v < 0.5 for v in share.values()), share
    # Several plausible actions: even the best guess is often wrong.
    ceiling = sum(st.alternatives[0][1] for s in sessions for st in s.steps) / total
    assert 0.3 < ceiling < 0.8


def test_corpus_is_deterministic_and_covers_prompts_and_targets() -> None:
    a = list(iter_corpus_texts(num_sessions=30, seed=0))
    assert a == list(iter_corpus_texts(num_sessions=30, seed=0))
    assert SYSTEM_PROMPT in a
    assert any(t.startswith("Session so far") for t in a)
    targets = [t for t in a if t.startswith('{"rationale"')]
    assert targets and all(isinstance(parse_output(t), ParsedOutput) for t in targets)


def test_dataset_splits_by_session_and_round_trips(tmp_path) -> None:
    dsd = build_dataset(num_sessions=200, seed=0)
    ids = {name: set(ds["session_id"]) for name, ds in dsd.items()}
    assert set(dsd) == {"train", "validation", "test"}
    assert not (ids["train"] & ids["validation"] or ids["train"] & ids["test"])
    assert len(ids["validation"]) == 20 and len(ids["test"]) == 20
    for row in dsd["validation"]:
        assert len(row["previous_actions"]) == len(row["pages"]) - 1 == row["step"]
        action = action_from_json(row["action"])
        assert action["type"] == row["action_type"]
        # The SFT target parses and earns the maximum reward against its own gold action.
        r = score(format_target(row["rationale"], action), action)
        assert r.exact_match and r.total >= 0.8
    save_dataset(dsd, tmp_path)
    back = load_dataset_dir(tmp_path)
    for name in dsd:
        assert back[name].to_list() == dsd[name].to_list()


class WordTokenizer:
    """One token per whitespace-separated word: makes budgets easy to reason about."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [0] * len(text.split())


def _long_row():
    dsd = build_dataset(num_sessions=60, seed=0)
    return max(dsd["train"], key=lambda r: len(r["pages"]))


def test_prompt_whole_session_and_latest_only() -> None:
    row = _long_row()
    n = len(row["pages"])
    assert n >= 4
    system, user = build_messages(row)
    assert system["role"] == "system" and user["role"] == "user"
    assert all(p in user["content"] for p in row["pages"])
    assert all(a in user["content"] for a in row["previous_actions"])
    assert f"## Page {n} (current)" in user["content"]
    latest = build_messages(row, latest_only=True)[1]["content"]
    assert row["pages"][-1] in latest and row["pages"][0] not in latest
    assert all(a in latest for a in row["previous_actions"])


def test_prompt_budget_drops_oldest_pages_first_and_says_so() -> None:
    row = _long_row()
    tok = WordTokenizer()
    full = sum(len(m["content"].split()) for m in build_messages(row))
    budget = full - len(row["pages"][0].split()) // 2  # just too small for every page
    system, user = build_messages(row, tokenizer=tok, max_context_tokens=budget)
    text = user["content"]
    assert len(system["content"].split()) + len(text.split()) <= budget
    assert "1 oldest page(s) is omitted" in text
    assert row["pages"][0] not in text and row["pages"][1] in text and row["pages"][-1] in text
    assert f"Page 1 action: {row['previous_actions'][0]}" in text


def test_prompt_budget_cuts_the_current_page_last() -> None:
    row = _long_row()
    tok = WordTokenizer()
    budget = len(SYSTEM_PROMPT.split()) + 120
    text = build_messages(row, tokenizer=tok, max_context_tokens=budget)[1]["content"]
    assert len(SYSTEM_PROMPT.split()) + len(text.split()) <= budget
    assert "cut to fit the context budget" in text
    assert "omitted to fit" in text
    with pytest.raises(ValueError, match="too small"):
        build_messages(row, tokenizer=tok, max_context_tokens=10)


def test_prompt_budget_with_the_real_bpe_tokenizer() -> None:
    from trainer.tiny_model import train_tokenizer

    tok = train_tokenizer(iter_corpus_texts(num_sessions=40, seed=0), 2048)
    row = _long_row()
    msgs = build_messages(row, tokenizer=tok, max_context_tokens=600)
    used = sum(len(tok.encode(m["content"], add_special_tokens=False)) for m in msgs)
    assert used <= 600
    # Without a tokenizer the estimate is pessimistic: the real count stays within budget.
    est = build_messages(row, max_context_tokens=600)
    assert sum(len(tok.encode(m["content"], add_special_tokens=False)) for m in est) <= 600


def test_fewest_omitted_pages_equals_trying_each_in_turn() -> None:
    """The search for the most pages that fit (a guess from characters, then real counts)
    answers what trying 0, 1, 2, ... omitted pages in turn answers, at every budget from
    "everything fits" down to "not even the current page": with the real BPE, whose tokens
    per character vary page by page, so the guess is often off."""
    from env_server.prompts import _fewest_omitted, _history, token_counter
    from trainer.tiny_model import train_tokenizer

    count = token_counter(train_tokenizer(iter_corpus_texts(num_sessions=40, seed=0), 2048))
    dsd = build_dataset(num_sessions=60, seed=0)
    rows = sorted(dsd["train"], key=lambda r: len(r["pages"]))[-12:]  # the longest sessions
    checked = set()
    for row in rows:
        pages, actions = row["pages"], row["previous_actions"]
        sizes = [count(_history(pages, actions, k)) for k in range(len(pages))]
        for budget in sorted({*sizes, *(n - 1 for n in sizes), sizes[0] + 5, sizes[-1] // 2}):
            scan = next((k for k, n in enumerate(sizes) if n <= budget), None)
            assert _fewest_omitted(pages, actions, count, budget) == scan, (row["step"], budget)
            checked.add(scan)
    assert None in checked and 0 in checked and len(checked) > 5  # every kind of answer


def test_build_messages_rejects_misaligned_rows() -> None:
    with pytest.raises(ValueError, match="previous action"):
        build_messages({"pages": ["<p>a</p>", "<p>b</p>"], "previous_actions": []})
