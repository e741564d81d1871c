"""Rationale synthesis against the real vLLM CPU server (tiny model): killed with SIGKILL
after a few rows are cached, rerun, and the finished rows are not asked for again.

The kill lands mid-run for certain, not by timing: the first run reaches vLLM through
``Gate``, a proxy that forwards its requests while fewer than ``KILL_AT`` rows are cached and
holds every later one. Each of the synthesizer's workers caches its row before it asks for the
next, so once every worker waits in the gate nothing more can be cached: the kill comes then,
with ``KILL_AT`` to ``KILL_AT + CONCURRENCY - 1`` rows cached of the 14 to fill.

The tiny model writes junk, not first-person sentences, so these runs use ``--lenient`` (any
non-empty answer); the strict rule is covered by tests/unit/env_server/test_synthesize.py.
"""

from __future__ import annotations

import contextlib
import json
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from launch.procs import ManagedProcess

pytestmark = pytest.mark.integration
ROWS = 16
CONCURRENCY = 2
KILL_AT = 3
"""Rows cached before the gate holds the first run's requests (see the module docstring)."""


class Gate:
    """An HTTP proxy to ``upstream`` (vLLM's ``/v1``) on a port the OS picks: a request goes through
    while ``passes()`` is true, else it waits until ``close``; ``waiting`` counts those held."""

    def __init__(self, upstream: str, passes: Callable[[], bool]) -> None:
        self.waiting = 0
        self._lock, self._release = threading.Lock(), threading.Event()
        gate = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _relay(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.command == "POST" and not passes():
                    with gate._lock:
                        gate.waiting += 1
                    gate._release.wait()
                    with contextlib.suppress(OSError):  # the client is gone by then (killed)
                        self.send_error(503)
                    return
                r = httpx.request(
                    self.command,
                    upstream + self.path.removeprefix("/v1"),
                    content=body,
                    headers={"Content-Type": "application/json"},
                    timeout=600,
                )
                self.send_response(r.status_code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(r.content)))
                self.end_headers()
                self.wfile.write(r.content)

            do_GET = do_POST = _relay

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._release.set()
        self.server.shutdown()
        self.server.server_close()


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
        str(CONCURRENCY),
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

    # Run 1: through the gate; SIGKILL once every worker waits in it (KILL_AT+ rows cached).
    gate = Gate(base_url, lambda: len(_cache(out)) < KILL_AT)
    cmd = [*_cmd(src, out, gate.url), "--timeout-s", "600"]  # a held request does not time out
    first = ManagedProcess("synth-1", cmd, tmp_path / "synth-1.log").start()
    deadline = time.monotonic() + 600  # a hang guard only: the wait ends on the gate's state
    try:
        while gate.waiting < CONCURRENCY and first.alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gate.waiting == CONCURRENCY, (tmp_path / "synth-1.log").read_text()[-2000:]
        first.kill9()
    finally:
        first.stop()
        gate.close()
    cached_before = _cache(out)
    ids_before = {e["id"] for e in cached_before}
    assert KILL_AT <= len(ids_before) <= KILL_AT + CONCURRENCY - 1 < to_fill, len(ids_before)
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
