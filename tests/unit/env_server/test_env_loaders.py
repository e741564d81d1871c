"""Loaders for user data: Shop-R1 JSONL, OPeRA-style action rows, our own rows."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from env_server.data.loaders import MISSING_PAGE, DataFormatError, load_user_data
from env_server.prompts import build_messages

pytestmark = pytest.mark.unit


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


SHOP_R1_ROW = {
    "context": "<html><input name='search_input'/></html>",
    "previous_actions": [{"type": "click", "name": "nav_shoes"}],
    "rationale": "I want running shoes.",
    "action": {"type": "type_and_submit", "name": "search_input", "text": "running shoes"},
}

OPERA_ROWS = [
    {
        "session_id": "s1",
        "step": 2,
        "action_type": "terminate",
        "simplified_html": "<p>c</p>",
        "rationale": "Done.",
        "input_text": None,
    },
    {
        "session_id": "s1",
        "step": 0,
        "action_type": "input",
        "simplified_html": "<p>a</p>",
        "rationale": "Search.",
        "input_text": "desk lamp",
        "target_name": "search_input",
    },
    {
        "session_id": "s1",
        "step": 1,
        "action_type": "click",
        "simplified_html": "<p>b</p>",
        "rationale": "Looks good.",
        "target_name": "product_lumio_a1",
    },
    {
        "session_id": 7,
        "step": 0,
        "action_type": "click",
        "simplified_html": "<p>x</p>",
        "rationale": "Hm.",
        "name": "deal_x",
    },
]


def test_shop_r1_rows_keep_actions_aligned(tmp_path: Path) -> None:
    ds = load_user_data(write_jsonl(tmp_path / "d.jsonl", [SHOP_R1_ROW]))
    row = ds[0]
    assert row["pages"] == [MISSING_PAGE, SHOP_R1_ROW["context"]]
    assert json.loads(row["previous_actions"][0]) == {"type": "click", "name": "nav_shoes"}
    assert json.loads(row["action"])["text"] == "running shoes"
    assert row["action_type"] == "type_and_submit"
    assert SHOP_R1_ROW["context"] in build_messages(row)[1]["content"]


def test_opera_rows_become_sessions_in_step_order(tmp_path: Path) -> None:
    ds = load_user_data(write_jsonl(tmp_path / "opera.jsonl", OPERA_ROWS))
    s1 = [r for r in ds if r["session_id"] == "s1"]
    assert [r["step"] for r in s1] == [0, 1, 2]
    last = s1[-1]
    assert last["pages"] == ["<p>a</p>", "<p>b</p>", "<p>c</p>"]
    assert [json.loads(a)["type"] for a in last["previous_actions"]] == ["type_and_submit", "click"]
    assert json.loads(s1[0]["action"]) == {
        "type": "type_and_submit",
        "name": "search_input",
        "text": "desk lamp",
    }
    assert last["action"] == '{"type": "terminate"}'
    assert any(r["session_id"] == "7" for r in ds)


def test_opera_rows_from_csv(tmp_path: Path) -> None:
    path = tmp_path / "opera.csv"
    fields = [
        "session_id",
        "step",
        "action_type",
        "simplified_html",
        "rationale",
        "input_text",
        "target_name",
    ]
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for r in OPERA_ROWS[:3]:
            w.writerow({k: r.get(k) for k in fields})
    ds = load_user_data(path, fmt="opera")
    assert len(ds) == 3 and ds[2]["action_type"] == "terminate"


@pytest.mark.parametrize(
    ("row", "field", "fmt"),
    [
        ({**SHOP_R1_ROW, "action": {"type": "click"}}, "action.name", "shop_r1"),
        ({**SHOP_R1_ROW, "action": {"type": "hover", "name": "x"}}, "action.type", "shop_r1"),
        ({**SHOP_R1_ROW, "action": "{not json"}, "action", "shop_r1"),
        ({**SHOP_R1_ROW, "rationale": ""}, "rationale", "shop_r1"),
        ({**SHOP_R1_ROW, "context": 5}, "context", "shop_r1"),
        (
            {**SHOP_R1_ROW, "previous_actions": [{"type": "click"}]},
            "previous_actions[0].name",
            "shop_r1",
        ),
        ({**OPERA_ROWS[1], "action_type": "scroll"}, "action_type.type", "opera"),
        ({**OPERA_ROWS[1], "input_text": ""}, "action_type.text", "opera"),
        (
            {k: v for k, v in OPERA_ROWS[1].items() if k != "simplified_html"},
            "simplified_html",
            "opera",
        ),
    ],
)
def test_malformed_row_names_file_line_and_field(tmp_path: Path, row: dict, field: str, fmt: str):
    good = SHOP_R1_ROW if fmt == "shop_r1" else OPERA_ROWS[2]
    path = write_jsonl(tmp_path / "bad.jsonl", [good, row])
    with pytest.raises(DataFormatError) as e:
        load_user_data(path, fmt=fmt)
    assert e.value.where == "line 2" and e.value.field == field
    assert str(path) in str(e.value) and "line 2" in str(e.value)


def test_invalid_json_line_and_unknown_format(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "x.jsonl", [SHOP_R1_ROW, "{oops"])
    with pytest.raises(DataFormatError, match=r"x\.jsonl:line 2: field '<row>': invalid JSON"):
        load_user_data(path)
    other = write_jsonl(tmp_path / "y.jsonl", [{"foo": 1}])
    with pytest.raises(DataFormatError, match="unknown format"):
        load_user_data(other)
    txt = tmp_path / "z.txt"
    txt.write_text("a")
    with pytest.raises(ValueError, match="unsupported file type"):
        load_user_data(txt, fmt="opera")


def test_own_rows_are_validated(tmp_path: Path) -> None:
    row = {
        "session_id": "s",
        "step": 1,
        "pages": ["<p>a</p>", "<p>b</p>"],
        "previous_actions": [],
        "rationale": "r",
        "action": '{"type": "terminate"}',
    }
    with pytest.raises(DataFormatError, match="previous_actions"):
        load_user_data(write_jsonl(tmp_path / "rows.jsonl", [row]))
    row["previous_actions"] = ['{"type": "click", "name": "a"}']
    ds = load_user_data(write_jsonl(tmp_path / "rows.jsonl", [row]))
    assert ds[0]["alternatives"] == "[]" and ds[0]["action_type"] == "terminate"


def test_convert_cli_splits_user_data_by_session(tmp_path: Path, capsys) -> None:
    from env_server.data.__main__ import main
    from env_server.data.dataset import load_dataset_dir

    rows = []
    for s in range(30):
        for step, kind in enumerate(("input", "click", "terminate")):
            rows.append(
                {
                    "session_id": f"u{s}",
                    "step": step,
                    "action_type": kind,
                    "simplified_html": f"<p>{s}-{step}</p>",
                    "rationale": "why",
                    "input_text": "lamp",
                    "target_name": "search_input",
                }
            )
    src = write_jsonl(tmp_path / "opera.jsonl", rows)
    main(["convert", "--input", str(src), "--out", str(tmp_path / "data")])
    summary = json.loads(capsys.readouterr().out)
    assert summary["train"]["sessions"] == 24 and summary["test"]["sessions"] == 3
    assert summary["train"]["best_reachable_exact_match"] is None  # real data: no known bound
    dsd = load_dataset_dir(tmp_path / "data")
    seen = [set(ds["session_id"]) for ds in dsd.values()]
    assert sum(len(s) for s in seen) == len(set().union(*seen)) == 30
    assert sum(len(ds) for ds in dsd.values()) == 90
