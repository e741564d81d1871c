"""Rationale synthesis against the real vLLM CPU server (tiny model): killed with SIGKILL
after a few rows are cached, rerun, and the finished rows are not asked for again.

The tiny model writes junk, not first-person sentences, so these runs use ``--lenient`` (any
non-empty answer); the strict rule is covered by tests/unit/env_server/test_synthesize.py.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from launch.procs import ManagedProcess

pytestmark = pytest.mark.integration
ROWS = 16


def _input_dir(tmp_path: Path) -> tuple[Path, int]:
    """train + validation splits of simulated rows; all but two have their rationale removed."""
    from env_server.data.dataset import build_dataset, write_jsonl

    rows = build_dataset(num_sessions=8, seed=3)["train"].to_list()[:ROWS]
    for i, row in enumerate(rows):
        if i not in (0, ROWS - 1):  # two rows keep theirs: kept as they are, never asked
            row["rationale"] = ""
    src = tmp_path / "in"
    write_jsonl(rows[:12], src / "train.jsonl")
    write_jsonl(rows[12:], src / "validation.jsonl")
    return src, ROWS - 2


def _cmd(src: Path, out: Path, base_url: str, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "env_server.synthesize",
        "--input",
        str(src),
        "--output",
        str(out),
        "--base-url",
        base_url,
        "--concurrency",
        "2",
        "--max-retries",
        "6",
        "--max-tokens",
        "24",
        "--max-context-chars",
        "1200",
        "--lenient",
        "--temperature",
        "1.0",
        *extra,
    ]


def _cache(out: Path) -> list[dict]:
    path = out / "cache.jsonl"
    if not path.exists():
        return []
    text = path.read_text()
    return [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines()]


def test_synthesis_resumes_after_sigkill(vllm_server, tiny_model_dir, tmp_path: Path) -> None:
    src, to_fill = _input_dir(tmp_path)
    out = tmp_path / "out"
    base_url = f"{vllm_server.base_url}/v1"

    # Run 1: SIGKILL once a few rows are durable in the cache.
    first = ManagedProcess("synth-1", _cmd(src, out, base_url), tmp_path / "synth-1.log").start()
    deadline = time.monotonic() + 180
    try:
        while len(_cache(out)) < 3 and first.alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert first.alive(), (tmp_path / "synth-1.log").read_text()[-2000:]
        first.kill9()
    finally:
        first.stop()
    cached_before = _cache(out)
    ids_before = {e["id"] for e in cached_before}
    assert 3 <= len(ids_before) < to_fill, "the kill should land mid-run"
    assert not (out / "train.jsonl").exists(), "output is only written at the end"

    # Run 2: resumes; only the rows that were not cached are requested.
    second = ManagedProcess("synth-2", _cmd(src, out, base_url), tmp_path / "synth-2.log").start()
    try:
        rc = second.wait_exit()
    finally:
        second.stop()
    log2 = (tmp_path / "synth-2.log").read_text()
    assert rc == 0, log2[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["cached"] == len(ids_before) and summary["existing"] == 2
    assert summary["synthesized"] == to_fill - len(ids_before) and summary["failed"] == 0
    cache = _cache(out)
    assert len(cache) == len({e["id"] for e in cache}) == to_fill  # each row cached once
    asked_now = [e for e in cache if e["run"] == summary["run"]]
    assert not {e["id"] for e in asked_now} & ids_before  # no cached row asked again
    assert summary["requests"] == sum(e["attempts"] for e in asked_now)
    assert (out / "failed.jsonl").read_text() == ""

    # Run 3: everything is cached, so no request at all (the endpoint here is a dead port).
    third = ManagedProcess(
        "synth-3", _cmd(src, out, "http://127.0.0.1:9/v1"), tmp_path / "synth-3.log"
    ).start()
    try:
        assert third.wait_exit() == 0, (tmp_path / "synth-3.log").read_text()[-2000:]
    finally:
        third.stop()
    assert json.loads((out / "summary.json").read_text())["requests"] == 0

    # The output is what the SFT command reads.
    from transformers import AutoTokenizer

    from env_server.data.dataset import load_dataset_dir
    from trainer.sft_data import encode_split

    dsd = load_dataset_dir(out)
    assert len(dsd["train"]) == 12 and len(dsd["validation"]) == ROWS - 12
    assert all(r.strip() for s in ("train", "validation") for r in list(dsd[s]["rationale"]))
    by_id = {e["id"]: e["rationale"] for e in cache}
    from env_server.synthesis.prompt import row_id

    for row in dsd["train"]:
        assert row["rationale"] == by_id.get(row_id(row), row["rationale"])
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert len(encode_split(dsd["train"], tok, 2048, latest_only=False)) == 12
