"""Evaluation CLI against the real vLLM CPU server with the tiny model."""

from __future__ import annotations

import json

import pytest

from env_server.evaluate import main as evaluate_main

pytestmark = pytest.mark.integration


def test_evaluate_cli_prints_paper_table(vllm_server, tmp_path, capsys) -> None:
    out = tmp_path / "eval"
    m = evaluate_main(
        [
            "--data-dir",
            str(tmp_path / "data"),
            "--num-sessions",
            "200",
            "--split",
            "test",
            "--limit",
            "12",
            "--inference-url",
            vllm_server.base_url,
            "--max-tokens",
            "32",
            "--max-prompt-tokens",
            "1024",
            "--out-dir",
            str(out),
        ]
    )
    table = capsys.readouterr().out
    assert "exact match" in table and "macro-F1" in table
    for kind in ("click", "type_and_submit", "terminate"):
        assert kind in table
    saved = json.loads((out / "metrics.json").read_text())
    assert saved["n"] == 12 and saved["exact_match"] == m["exact_match"]
    assert 0.0 < saved["oracle_exact_match"] < 1.0
    assert (out / "confusion.png").stat().st_size > 1000
    preds = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert len(preds) == 12 and all(isinstance(p["completion"], str) for p in preds)
    assert all(p["token_ids"] and all(isinstance(t, int) for t in p["token_ids"]) for p in preds)

    # The predictions file it wrote evaluates to the same numbers without the server.
    again = evaluate_main(
        [
            "--data-dir",
            str(tmp_path / "data"),
            "--split",
            "test",
            "--limit",
            "12",
            "--predictions",
            str(out / "predictions.jsonl"),
            "--out-dir",
            str(tmp_path / "e2"),
        ]
    )
    assert again["exact_match"] == m["exact_match"] and again["confusion"] == m["confusion"]
