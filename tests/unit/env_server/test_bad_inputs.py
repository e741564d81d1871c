"""Bad inputs: a catalogue of malformed model outputs (each a format failure: reward 0 and a
reason, under every reward variant, never an exception), random text (hypothesis), huge
outputs in bounded time, and malformed dataset rows (an error naming file, line and field).

The cases the parser suite (test_env_reward.py) already pins with their exact reasons are not
repeated here; this file covers the kinds of damage a sampling model or a user file produces.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from env_server.data.loaders import DataFormatError, load_user_data
from env_server.reward import FormatFailure, ParsedOutput, RewardConfig, parse_output, score

pytestmark = pytest.mark.unit

CLICK = {"type": "click", "name": "add_to_cart"}
GOOD = '{"rationale": "I want it.", "action": {"type": "click", "name": "add_to_cart"}}'
TERM = '"action": {"type": "terminate"}'


def _obj(rationale: str = '"r"', action: str = '{"type": "terminate"}') -> str:
    return '{"rationale": ' + rationale + ', "action": ' + action + "}"


MALFORMED: dict[str, str] = {
    # empty / not JSON at all
    "empty": "",
    "whitespace only": " \n\t ",
    "prose": "I would click the add to cart button because it is cheap.",
    "prose then json": "Answer: " + GOOD,
    "think tag first": "<think>hmm</think>" + GOOD,
    "markdown fence": "```json\n" + GOOD + "\n```",
    "plain fence": "```\n" + GOOD + "```",
    "json string literal": json.dumps(GOOD),
    "json null": "null",
    "json number": "42",
    "json array of the object": "[" + GOOD + "]",
    "python dict (single quotes)": "{'rationale': 'r', 'action': {'type': 'terminate'}}",
    "unquoted keys": '{rationale: "r", action: {type: "terminate"}}',
    "trailing comma": '{"rationale": "r", ' + TERM + ",}",
    "comment inside": '{"rationale": "r", /* why */ ' + TERM + "}",
    "leading BOM": "\ufeff" + GOOD,
    "leading NUL": "\x00" + GOOD,
    "leading no-break space": "\u00a0" + GOOD,
    # truncated (the completion budget ran out)
    "truncated after brace": "{",
    "truncated in a key": '{"rationale": "r", "act',
    "truncated after colon": '{"rationale": "r", "action":',
    "truncated in the action": '{"rationale": "r", "action": {"type": "cli',
    "truncated before last brace": GOOD[:-1],
    "truncated rationale": '{"rationale": "I want',
    "huge truncated rationale": '{"rationale": "' + "x" * 300_000,
    # more than one object / trailing text
    "two objects": GOOD + GOOD,
    "two objects, newline": GOOD + "\n" + GOOD,
    "eos marker after": GOOD + "<|im_end|>",
    "explanation after": GOOD + "\nThis is my answer.",
    # duplicate keys
    "duplicate rationale": '{"rationale": "a", "rationale": "b", ' + TERM + "}",
    "duplicate via unicode escape": '{"rationale": "a", "\\u0072ationale": "b", ' + TERM + "}",
    "duplicate action": '{"rationale": "r", ' + TERM + ", " + TERM + "}",
    "duplicate action attribute": _obj(action='{"type": "click", "name": "a", "name": "b"}'),
    # missing / extra keys
    "empty object": "{}",
    "no action": '{"rationale": "r"}',
    "no rationale": "{" + TERM + "}",
    "extra top-level key": '{"rationale": "r", ' + TERM + ', "confidence": 0.9}',
    "keys in another case": '{"Rationale": "r", "Action": {"type": "terminate"}}',
    "extra action attribute": _obj(action='{"type": "click", "name": "a", "id": 3}'),
    "click without name": _obj(action='{"type": "click"}'),
    "type_and_submit without text": _obj(action='{"type": "type_and_submit", "name": "s"}'),
    "terminate with a name": _obj(action='{"type": "terminate", "name": "x"}'),
    # wrong types
    "rationale number": _obj(rationale="3"),
    "rationale null": _obj(rationale="null"),
    "rationale list": _obj(rationale='["r"]'),
    "rationale object": _obj(rationale='{"t": "r"}'),
    "rationale NaN": _obj(rationale="NaN"),
    "action string": _obj(action='"click add_to_cart"'),
    "action null": _obj(action="null"),
    "action list": _obj(action='[{"type": "terminate"}]'),
    "type list": _obj(action='{"type": ["click"], "name": "a"}'),
    "type object": _obj(action='{"type": {"k": 1}, "name": "a"}'),
    "type null": _obj(action='{"type": null}'),
    # unknown action type
    "unknown type scroll": _obj(action='{"type": "scroll"}'),
    "type in upper case": _obj(action='{"type": "CLICK", "name": "a"}'),
    "type with spaces": _obj(action='{"type": " click ", "name": "a"}'),
    "type empty": _obj(action='{"type": ""}'),
    # non-string attribute values
    "name number": _obj(action='{"type": "click", "name": 5}'),
    "name bool": _obj(action='{"type": "click", "name": true}'),
    "name list": _obj(action='{"type": "click", "name": ["a"]}'),
    "name object": _obj(action='{"type": "click", "name": {"a": 1}}'),
    "name Infinity": _obj(action='{"type": "click", "name": Infinity}'),
    "name with 5000 digits": _obj(action='{"type": "click", "name": 1' + "0" * 5000 + "}"),
    "text number": _obj(action='{"type": "type_and_submit", "name": "s", "text": 5}'),
    "terminate text 0": _obj(action='{"type": "terminate", "text": 0}'),
    "terminate name false": _obj(action='{"type": "terminate", "name": false}'),
    # unicode and control characters
    "raw control char in rationale": _obj(rationale='"a\x01b"'),
    "raw newline in rationale": _obj(rationale='"a\nb"'),
    "escaped NUL in rationale": _obj(rationale='"a\\u0000b"'),
    "escaped bell in name": _obj(action='{"type": "click", "name": "add\\u0007cart"}'),
    "escaped DEL in name": _obj(action='{"type": "click", "name": "add\\u007fcart"}'),
    "lone surrogate rationale": _obj(rationale='"ok \\ud800"'),
    "only a lone surrogate": _obj(rationale='"\\ud800"'),
    "lone surrogate in name": _obj(action='{"type": "click", "name": "a\\udc00"}'),
    "zero-width-space rationale": _obj(rationale='"\u200b"'),
    "zero-width-space name": _obj(action='{"type": "click", "name": "\u200b\u200b"}'),
    "ideographic-space name": _obj(action='{"type": "click", "name": "\u3000"}'),
    "empty text": _obj(action='{"type": "type_and_submit", "name": "s", "text": "  "}'),
    # nested garbage
    "nested garbage attribute": _obj(action='{"type": "click", "name": "a", "x": [[{"y": {}}]]}'),
    "deep nesting": _obj(action="[" * 5000 + "]" * 5000),
    "deep nesting, unclosed": "{" * 100_000,
    "object as key": '{{"rationale": "r"}: 1}',
}


@pytest.mark.parametrize("text", MALFORMED.values(), ids=list(MALFORMED))
def test_malformed_output_is_a_format_failure(text: str) -> None:
    parsed = parse_output(text)
    assert isinstance(parsed, FormatFailure), parsed
    assert parsed.reason.strip()
    for variant in ("full", "binary", "no_dars", "no_format"):
        r = score(text, CLICK, RewardConfig.variant(variant))
        assert r.total == 0.0 and not r.valid and not r.exact_match, (variant, r)
        assert r.failure == parsed.reason
        assert all(v == 0.0 for k, v in r.metrics().items()), r.metrics()


def test_catalogue_reasons_are_specific() -> None:
    """A few reasons that say exactly what went wrong (for the logs and the metrics)."""
    why = {k: parse_output(v).reason for k, v in MALFORMED.items()}  # type: ignore[union-attr]
    assert "text after" in why["two objects"]
    assert "duplicate" in why["duplicate via unicode escape"]
    assert "U+0000" in why["escaped NUL in rationale"]
    assert "U+D800" in why["lone surrogate rationale"]
    assert "U+DC00" in why["lone surrogate in name"]
    assert "invisible" in why["zero-width-space name"]
    assert "scroll" in why["unknown type scroll"]
    assert "unknown action key" in why["nested garbage attribute"]


def test_valid_unicode_and_escapes_are_still_accepted() -> None:
    for text in [
        _obj(rationale='"Ich möchte \\"leise\\" Kopfhörer ✓ 😀\\n\\tsecond line"'),
        _obj(action='{"type": "click", "name": "produkt_ärger_日本"}'),
        _obj(rationale='"\\u00e9t\\u00e9"'),  # escaped letters are fine
    ]:
        assert isinstance(parse_output(text), ParsedOutput), parse_output(text)


@pytest.mark.parametrize("size", [1_000_000, 2_000_000])
def test_huge_outputs_are_scored_in_bounded_time(size: int) -> None:
    """Well-formed but huge: still scored (valid) without blowing up; garbage: a failure.
    The bound is on this process's CPU time, not the wall clock: a quadratic scorer would
    take minutes of CPU, while a busy box only makes the wall clock longer (35 s of wall time
    was seen under two other jobs)."""
    t0 = time.process_time()
    big = _obj(rationale=json.dumps("x" * size), action=json.dumps(CLICK))
    assert score(big, CLICK).total == pytest.approx(1001.0)
    name = _obj(action=json.dumps({"type": "click", "name": "y " * (size // 2)}))
    r = score(name, CLICK)
    assert r.valid and r.name_similarity == 0.0  # presence credit only: ROUGE-L ~ 0
    assert score("x" * size, CLICK).total == 0.0
    assert time.process_time() - t0 < 30.0


@settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)
@given(
    st.one_of(
        st.text(),
        st.text(alphabet='{}[]":,\\ artionlcky_x0\n\u0000\ud800', max_size=120),
        st.builds(
            lambda a, b: GOOD[:a] + b + GOOD[a:], st.integers(0, len(GOOD)), st.text(max_size=3)
        ),
    )
)
def test_random_text_never_raises_and_failures_score_zero(text: str) -> None:
    parsed = parse_output(text)
    r = score(text, CLICK)
    if isinstance(parsed, FormatFailure):
        assert r.total == 0.0 and r.failure == parsed.reason and parsed.reason
    else:  # accepted only if it really is one clean object with the two keys
        obj = json.loads(text)
        assert set(obj) == {"rationale", "action"} and r.valid


# ----------------------------------------------------------------------------- dataset rows

ROW = {
    "session_id": "s",
    "step": 1,
    "pages": ["<p>a</p>", "<p>b</p>"],
    "previous_actions": ['{"type": "click", "name": "a"}'],
    "rationale": "r",
    "action": '{"type": "terminate"}',
}
SHOP = {"context": "<p>x</p>", "rationale": "r", "action": {"type": "terminate"}}


def _write(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.mark.parametrize(
    ("row", "field"),
    [
        ({**ROW, "step": "two"}, "step"),
        ({**ROW, "step": [1]}, "step"),
        ({**ROW, "step": 1.5}, "step"),
        ({**ROW, "step": True}, "step"),
        ({**ROW, "alternatives": [["x", 1.0]]}, "alternatives"),
        ({**ROW, "alternatives": "{not json"}, "alternatives"),
        ({**ROW, "pages": "<p>a</p>"}, "pages"),
        ({**ROW, "pages": [1, 2]}, "pages"),
        ({**ROW, "session_id": None}, "session_id"),
        ({**ROW, "session_id": 7}, "session_id"),
        ({**ROW, "rationale": None}, "rationale"),
        ({**ROW, "action": '{"type": "click", "name": ""}'}, "action.name"),
        ({**ROW, "action": 5}, "action"),
        ({**ROW, "previous_actions": ["{oops"]}, "previous_actions[0]"),
        ({**SHOP, "step": "x"}, "step"),
        ({**SHOP, "context": ""}, "context"),
        ({**SHOP, "context": ["<p>a</p>", 3]}, "context"),
        ({**SHOP, "previous_actions": "click"}, "previous_actions"),
        ({**SHOP, "action": {"type": "type_and_submit", "name": "s"}}, "action.text"),
    ],
)
def test_malformed_dataset_row_names_file_line_and_field(tmp_path: Path, row: dict, field: str):
    good = SHOP if "context" in row else ROW
    path = _write(tmp_path / "data.jsonl", [good, "", row])  # a blank line is skipped, counted
    with pytest.raises(DataFormatError) as e:
        load_user_data(path)
    assert (e.value.path, e.value.where, e.value.field) == (str(path), "line 3", field)
    assert str(e.value).startswith(f"{path}:line 3: field '{field}': ")


def test_undecodable_and_non_object_lines(tmp_path: Path) -> None:
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(json.dumps(SHOP).encode() + b"\n" + b'{"context": "caf\xe9"}\n')
    with pytest.raises(DataFormatError, match=r"latin1\.jsonl:line 2: field '<row>': not UTF-8"):
        load_user_data(path)
    for bad, problem in [("[1, 2]", "expected a JSON object"), ('{"a": ', "invalid JSON")]:
        path = _write(tmp_path / "x.jsonl", [SHOP, bad])
        with pytest.raises(DataFormatError, match=rf"x\.jsonl:line 2: field '<row>': {problem}"):
            load_user_data(path, fmt="shop_r1")


def test_csv_rows_are_named_by_row_number(tmp_path: Path) -> None:
    path = tmp_path / "opera.csv"
    path.write_text(
        "session_id,step,action_type,simplified_html,rationale,target_name\n"
        "s1,0,click,<p>a</p>,why,buy\n"
        "s1,1,hover,<p>b</p>,why,buy\n"
    )
    with pytest.raises(DataFormatError) as e:
        load_user_data(path, fmt="opera")
    assert (e.value.where, e.value.field) == ("row 2", "action_type.type")
    assert "hover" in str(e.value)
