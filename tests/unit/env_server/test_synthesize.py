"""Rationale synthesis pieces without a server: the answer rule, the cache, row ids, input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from env_server.synthesis.cache import Cache
from env_server.synthesis.config import SynthConfig
from env_server.synthesis.prompt import build_request_messages, row_id
from env_server.synthesis.rule import InvalidAnswer, clean_rationale
from env_server.synthesize import load_input

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        ('"I want a cheaper one, so I search again."', "I want a cheaper one, so I search again."),
        ("Rationale: I like the reviews", "I like the reviews."),
        ("<think>hmm</think> My cart is ready, so checkout", "My cart is ready, so checkout."),
        ("As a result, I will buy it now.", "As a result, I will buy it now."),
        ("The $12.99 price suits me.", "The $12.99 price suits me."),
    ],
)
def test_strict_rule_accepts_and_cleans(answer: str, expected: str) -> None:
    assert clean_rationale(answer) == expected


@pytest.mark.parametrize(
    ("answer", "reason"),
    [
        ("", "empty"),
        ("   \n  ", "empty"),
        ("I click it.\nThen I pay.", "lines"),
        ("I click it. Then I pay.", "more than one sentence"),
        ("The shopper opens the product page.", "first person"),
        ("As a busy parent, I want the fast option.", "profile"),
        ("I am 35 years old so I pick this.", "profile"),
        ("Given my profile I pick this.", "profile"),
        ("I " + "really " * 45 + "want it.", "too long"),
    ],
)
def test_strict_rule_rejects(answer: str, reason: str) -> None:
    with pytest.raises(InvalidAnswer, match=reason):
        clean_rationale(answer)


def test_lenient_accepts_anything_non_empty() -> None:
    assert clean_rationale('  "junk \n tokens"  ', lenient=True) == "junk tokens"
    assert len(clean_rationale("word " * 200, lenient=True)) <= 300
    with pytest.raises(InvalidAnswer):
        clean_rationale("''", lenient=True)


def test_cache_survives_a_torn_last_line(tmp_path: Path) -> None:
    path = tmp_path / "cache.jsonl"
    path.write_text(
        json.dumps({"id": "a", "rationale": "I x."})
        + "\n"
        + json.dumps({"id": "b", "rationale": "I y."})
        + "\n"
        + '{"id": "c", "ratio'  # killed mid-write
    )
    cache = Cache(path)
    assert set(cache.entries) == {"a", "b"}
    cache.add({"id": "c", "rationale": "I z."})
    cache.close()
    lines = path.read_text().splitlines()
    assert [json.loads(x)["id"] for x in lines] == ["a", "b", "c"]
    assert set(Cache(path).entries) == {"a", "b", "c"}


def _row(**kw) -> dict:
    row = {
        "session_id": "s1",
        "step": 1,
        "pages": ["<p>home</p>", "<p>results</p>" * 500],
        "previous_actions": ['{"type": "click", "name": "search"}'],
        "rationale": "",
        "action": '{"name": "buy_now", "type": "click"}',
    }
    return {**row, **kw}


def test_row_id_depends_on_content_not_rationale() -> None:
    assert row_id(_row()) == row_id(_row(rationale="I buy."))
    assert row_id(_row()) != row_id(_row(step=2))
    msgs = build_request_messages(_row(), max_context_chars=300)
    assert msgs[0]["role"] == "system" and "first person" in msgs[0]["content"]
    assert "buy_now" in msgs[1]["content"] and "rest of the page cut" in msgs[1]["content"]
    assert len(msgs[1]["content"]) < 1000


def test_input_rows_without_rationale(tmp_path: Path) -> None:
    src = tmp_path / "sessions.jsonl"
    rows = [
        {
            "session_id": f"s{i}",
            "context": "<button name='buy'>Buy</button>",
            "action": {"type": "click", "name": "buy"},
            **({"rationale": "I buy."} if i else {}),
        }
        for i in range(10)
    ]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    splits = load_input(SynthConfig(input=src, output=tmp_path / "out"))
    got = [r for s in splits.values() for r in s]
    assert len(got) == 10 and sum(not r["rationale"] for r in got) == 1
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"session_id": "s", "context": "<p/>", "action": {}}) + "\n")
    with pytest.raises(ValueError, match="line 1"):
        load_input(SynthConfig(input=bad, output=tmp_path / "out"))
