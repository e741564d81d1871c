"""Rationale synthesis: first-person rationales for sessions that have only actions.

The Shop-R1 paper had a large model write, for every step of real sessions, the shopper's
reason for the next action ("explain why, in one short first-person sentence, without
user-profile information"). This command does the same through any OpenAI-compatible chat
endpoint -- the project's own vLLM server by default, a hosted one by URL and key:

    python -m env_server.synthesize --input sessions.jsonl --output out_dir/ \\
        [--base-url URL] [--api-key KEY] [--model NAME] [--concurrency N] [--max-retries K]

Input: a file of rows in any format ``env_server.data.loaders`` reads (the project's rows,
Shop-R1 style, OPeRA style; ``.jsonl/.json/.csv/.parquet``), or a dataset folder of
``train/validation/test.jsonl``; a missing or empty ``rationale`` marks a row to fill in
(rows that have one are kept as they are unless ``--overwrite-existing``).
Output: ``out_dir/<split>.jsonl`` in the project's row format (what ``python -m trainer sft
--data-dir out_dir`` reads), written atomically at the end; a single input file is split by
session like ``python -m env_server.data``.

Resuming: every accepted rationale is appended to ``out_dir/cache.jsonl`` (one fsync'd line per
row, keyed by a hash of the row's content) before anything else happens, so a run that is
killed at any moment keeps what it finished and a rerun asks only for the rest. Rows that
still fail after ``--max-retries`` are left out of the output and listed, with the reason, in
``out_dir/failed.jsonl``; ``out_dir/summary.json`` has the counts. See docs/SYNTHESIS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import os
import random
import re
import sys
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from settings.ports import VLLM_URL

log = logging.getLogger("env_server.synthesize")

DEFAULT_BASE_URL = f"{VLLM_URL}/v1"
"""The project's vLLM server (``python -m vllm_patching.serve ... --port 9001``)."""

INSTRUCTION = (
    "You explain the behaviour of a real person shopping online. You are shown the pages of "
    "their session so far and the action they take next. Explain why they take this next "
    'action: write their reason in ONE short sentence, in the first person ("I ..."), as '
    "the shopper would think it. Use only what is on the page and what they are looking for; "
    "do not mention any user-profile information (persona, age, gender, income, job, "
    "location). Answer with that one sentence only, no quotes, no preamble."
)
"""The paper's instruction for rationale synthesis (Shop-R1, Sec. 3.1), in our words."""

INSTRUCTION_VERSION = 1
"""Bumped when INSTRUCTION changes; cached rationales from another version are not reused."""


class SynthConfig(BaseModel):
    """Options of ``python -m env_server.synthesize`` (one ``--kebab-case`` flag each)."""

    model_config = ConfigDict(extra="forbid")

    input: Path = Field(description="Rows file (.jsonl/.json/.csv/.parquet) or dataset folder.")
    output: Path = Field(description="Output folder: <split>.jsonl, cache, failures, summary.")
    format: str = Field("auto", description="Input format: auto, rows, shop_r1 or opera.")
    base_url: str = Field(DEFAULT_BASE_URL, description="OpenAI-compatible base URL (with /v1).")
    api_key: str | None = Field(
        None, description="Bearer key for the endpoint (default: $OPENAI_API_KEY, if set)."
    )
    model: str | None = Field(None, description="Model name; default: the first of /models.")
    concurrency: int = Field(4, ge=1, le=256, description="Requests in flight at once.")
    max_retries: int = Field(
        3, ge=0, description="Extra requests per row after a transient error or a bad answer."
    )
    temperature: float = Field(0.7, ge=0, description="Sampling temperature.")
    max_tokens: int = Field(64, ge=1, description="Token budget of one answer.")
    timeout_s: float = Field(120.0, gt=0, description="Timeout of one request (seconds).")
    max_context_chars: int = Field(
        6000, ge=200, description="Characters of the current page's HTML shown to the model."
    )
    max_words: int = Field(40, ge=3, description="Longest accepted rationale (words).")
    lenient: bool = Field(
        False,
        description="Accept any non-empty answer (cleaned, cut to 300 characters) instead of "
        "checking the one-first-person-sentence rule; for tiny test models.",
    )
    overwrite_existing: bool = Field(
        False, description="Also synthesize rows that already have a rationale."
    )
    seed: int = Field(0, description="Seed of the session split of a single input file.")
    val_fraction: float = Field(0.1, ge=0, lt=1, description="Validation share (single file).")
    test_fraction: float = Field(0.1, ge=0, lt=1, description="Test share (single file).")


# --- validation ---------------------------------------------------------------------------


class InvalidAnswer(ValueError):
    """An answer that does not meet the rationale rule; the message says which part."""


QUOTES = "\"'`\u201c\u201d\u2018\u2019"
LABEL = re.compile(r"^\s*(rationale|reason|answer|explanation)\s*:\s*", re.IGNORECASE)
THINK = re.compile(r"<think>.*?</think>", re.IGNORECASE | re.DOTALL)
FIRST_PERSON = re.compile(r"\b(I|I'm|I'll|I've|I'd|me|my|mine|myself)\b|\b(?i:me|my|mine)\b")
SENTENCE_BREAK = re.compile(r"[.!?][\"')\]\u201d\u2019]*\s+\S")
PROFILE = re.compile(
    r"\b(profile|persona|demographics?|gender|income|salary|occupation|years old|"
    r"age[sd]? \d+|\d+[- ]year[- ]old)\b|"
    # persona framing ("As a busy parent, I ..."), not "As a result, I ..."
    r"^as an? (?!(result|matter|first|last|quick)\b)[\w -]+,",
    re.IGNORECASE,
)
LENIENT_MAX_CHARS = 300


def _strip_quotes(text: str) -> str:
    while len(text) >= 2 and text[0] in QUOTES and text[-1] in QUOTES:
        text = text[1:-1].strip()
    return text


def clean_rationale(text: str, max_words: int = 40, lenient: bool = False) -> str:
    """The rationale in ``text``, cleaned; raises :class:`InvalidAnswer` if it breaks the rule.

    Rule (strict): one line, one sentence (no ``.``/``!``/``?`` followed by more text), at most
    ``max_words`` words, a first-person word (I, I'm, me, my, ...), and nothing that looks like
    user-profile information (profile, persona, age, gender, income, occupation, or an opening
    "As a ..."). Cleaning: ``<think>`` blocks, a ``Rationale:`` label and surrounding quotes are
    removed and a final period is added. Lenient: any non-empty text, whitespace collapsed,
    cut at a word boundary to 300 characters.
    """
    text = _strip_quotes(LABEL.sub("", THINK.sub("", text or "")).strip())
    if lenient:
        text = " ".join(text.split())
        if len(text) > LENIENT_MAX_CHARS:
            text = text[:LENIENT_MAX_CHARS].rsplit(" ", 1)[0]
        if not text:
            raise InvalidAnswer("empty answer")
        return text
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if not lines:
        raise InvalidAnswer("empty answer")
    if len(lines) > 1:
        raise InvalidAnswer(f"{len(lines)} lines, expected one sentence")
    text = _strip_quotes(" ".join(lines[0].split()))
    words = len(text.split())
    if words > max_words:
        raise InvalidAnswer(f"too long ({words} words > {max_words})")
    if SENTENCE_BREAK.search(text):
        raise InvalidAnswer("more than one sentence")
    if not FIRST_PERSON.search(text):
        raise InvalidAnswer("not in the first person")
    if m := PROFILE.search(text):
        raise InvalidAnswer(f"mentions user-profile information ({m.group(0)!r})")
    return text if text[-1] in ".!?" else text + "."


# --- prompts and row ids --------------------------------------------------------------------


def row_id(row: Mapping[str, Any]) -> str:
    """Stable id of a row: a hash of what the rationale depends on (not of its position)."""
    key = [INSTRUCTION_VERSION, row["session_id"], int(row["step"]), list(row["previous_actions"]),
           row["action"], list(row["pages"])[-1]]  # fmt: skip
    return hashlib.sha256(json.dumps(key, ensure_ascii=False).encode()).hexdigest()[:24]


def build_request_messages(row: Mapping[str, Any], max_context_chars: int) -> list[dict[str, str]]:
    """System (the instruction) + user (earlier actions, current page, the next action)."""
    page = list(row["pages"])[-1]
    if len(page) > max_context_chars:
        page = page[:max_context_chars] + "\n[... rest of the page cut ...]"
    earlier = list(row["previous_actions"])[-10:]
    history = "\n".join(f"{i + 1}. {a}" for i, a in enumerate(earlier)) or "(none)"
    user = (
        f"Earlier actions in this session (most recent last):\n{history}\n\n"
        f"Current page (simplified HTML):\n{page}\n\n"
        f"The shopper's next action: {row['action']}\n\n"
        "Why does the shopper take this action? One short first-person sentence."
    )
    return [{"role": "system", "content": INSTRUCTION}, {"role": "user", "content": user}]


# --- the cache --------------------------------------------------------------------------------


class Cache:
    """Append-only JSONL of finished rows, one fsync'd line each; tolerant of a torn last line.

    A kill can land in the middle of a write: the torn line is cut off on open (it never
    finished, so its row is simply asked again), and later lines start on a fresh line.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.entries: dict[str, dict[str, Any]] = {}
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():
            self._load()
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def _load(self) -> None:
        data = self.path.read_bytes()
        good = data[: data.rfind(b"\n") + 1]
        if len(good) != len(data):
            log.warning("cache %s ends in a torn line (killed mid-write); dropping it", self.path)
            with open(self.path, "r+b") as f:
                f.truncate(len(good))
        for n, line in enumerate(good.decode("utf-8").splitlines(), start=1):
            try:
                entry = json.loads(line)
                self.entries[str(entry["id"])] = entry
            except (json.JSONDecodeError, KeyError, TypeError):
                log.warning("cache %s line %d is not a cache entry; ignored", self.path, n)

    def add(self, entry: dict[str, Any]) -> None:
        self._file.write(json.dumps(entry, ensure_ascii=False) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        self.entries[str(entry["id"])] = entry

    def close(self) -> None:
        self._file.close()


# --- the endpoint ------------------------------------------------------------------------------


class RequestFailed(RuntimeError):
    """A request the endpoint refused for good (4xx other than 429)."""


def _transient(exc: BaseException) -> bool:
    from env_server.inference import is_transient

    return is_transient(exc)


@dataclass
class Outcome:
    rationale: str | None
    attempts: int
    reason: str = ""


class Synthesizer:
    """Asks the endpoint for one row's rationale, validating and retrying."""

    def __init__(self, cfg: SynthConfig) -> None:
        import httpx

        self.cfg = cfg
        key = cfg.api_key or os.environ.get("OPENAI_API_KEY")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.http = httpx.AsyncClient(
            base_url=cfg.base_url.rstrip("/"),
            headers=headers,
            timeout=httpx.Timeout(cfg.timeout_s, connect=10.0),
        )
        self.model = cfg.model
        self.requests = 0

    async def aclose(self) -> None:
        await self.http.aclose()

    async def discover(self) -> str:
        """The model to ask: ``--model``, else the first one the endpoint lists."""
        if self.model:
            return self.model
        from env_server.inference import with_retries

        async def ask() -> str:
            r = await self.http.get("/models")
            r.raise_for_status()
            return str(r.json()["data"][0]["id"])

        self.model = await with_retries(
            f"GET {self.cfg.base_url}/models", ask, max_attempts=self.cfg.max_retries + 3
        )
        return self.model

    async def _ask(self, messages: list[dict[str, str]]) -> str:
        body = {"model": self.model, "messages": messages, "max_tokens": self.cfg.max_tokens,
                "temperature": self.cfg.temperature, "n": 1}  # fmt: skip
        self.requests += 1
        r = await self.http.post("/chat/completions", json=body)
        if 400 <= r.status_code < 500 and r.status_code != 429:
            raise RequestFailed(f"HTTP {r.status_code}: {r.text[:300]}")
        r.raise_for_status()
        choice = r.json()["choices"][0]
        return str((choice.get("message") or {}).get("content") or "")

    async def rationale(self, row: Mapping[str, Any]) -> Outcome:
        """Up to ``1 + max_retries`` requests; transient errors back off, bad answers re-ask."""
        messages = build_request_messages(row, self.cfg.max_context_chars)
        reason = ""
        attempts = 0
        for attempt in range(self.cfg.max_retries + 1):
            attempts = attempt + 1
            try:
                answer = await self._ask(messages)
                return Outcome(clean_rationale(answer, self.cfg.max_words, self.cfg.lenient),
                               attempts)  # fmt: skip
            except InvalidAnswer as e:
                reason = f"invalid answer: {e}"
            except RequestFailed as e:
                return Outcome(None, attempts, str(e))
            except Exception as e:
                if not _transient(e):
                    return Outcome(None, attempts, f"{type(e).__name__}: {e}")
                reason = f"{type(e).__name__}: {e}"
                await asyncio.sleep(min(10.0, 0.5 * 2**attempt) * random.uniform(0.8, 1.2))
            log.debug("row %s/%s attempt %d: %s", row["session_id"], row["step"], attempts, reason)
        return Outcome(None, attempts, reason)


# --- input / output -----------------------------------------------------------------------------


def load_input(cfg: SynthConfig) -> dict[str, list[dict[str, Any]]]:
    """Rows per split (a folder keeps its splits; a file is split by session)."""
    from env_server.data.dataset import SPLITS, split_by_session
    from env_server.data.loaders import load_rows, load_user_data

    src = cfg.input
    if src.is_dir():
        found = {s: src / f"{s}.jsonl" for s in SPLITS if (src / f"{s}.jsonl").exists()}
        if not found:
            raise FileNotFoundError(f"no train/validation/test .jsonl files in {src}")
        return {s: load_rows(p, allow_missing_rationale=True).to_list() for s, p in found.items()}
    ds = load_user_data(src, cfg.format, allow_missing_rationale=True)
    dsd = split_by_session(ds, cfg.seed, cfg.val_fraction, cfg.test_fraction)
    return {s: d.to_list() for s, d in dsd.items() if len(d)}


def write_outputs(
    out: Path, rows: dict[str, list[dict[str, Any]]], failed: list[dict[str, Any]],
    summary: dict[str, Any],
) -> dict[str, int]:  # fmt: skip
    """Each split atomically (temp file + rename); empty splits are not written."""
    from env_server.data.dataset import write_jsonl

    written = {}
    for split, split_rows in rows.items():
        if split_rows:
            written[split] = write_jsonl(split_rows, out / f"{split}.jsonl")
        elif (out / f"{split}.jsonl").exists():
            (out / f"{split}.jsonl").unlink()  # a stale file from an earlier input
    write_jsonl(failed, out / "failed.jsonl")
    tmp = out / ".summary.json.tmp"
    tmp.write_text(json.dumps({**summary, "written": written}, indent=1) + "\n")
    os.replace(tmp, out / "summary.json")
    return written


# --- the run ------------------------------------------------------------------------------------


async def synthesize(cfg: SynthConfig) -> dict[str, Any]:
    """Fill in every missing rationale; returns the summary (also in ``summary.json``)."""
    t0 = time.monotonic()
    splits = load_input(cfg)
    cfg.output.mkdir(parents=True, exist_ok=True)
    cache = Cache(cfg.output / "cache.jsonl")
    run_id = uuid.uuid4().hex[:12]
    todo: list[tuple[str, str, dict[str, Any]]] = []  # (split, id, row)
    counts = {"rows": 0, "existing": 0, "cached": 0, "synthesized": 0, "failed": 0}
    for split, rows in splits.items():
        for row in rows:
            counts["rows"] += 1
            rid = row_id(row)
            if row["rationale"].strip() and not cfg.overwrite_existing:
                counts["existing"] += 1
            elif rid in cache.entries:
                counts["cached"] += 1
            else:
                todo.append((split, rid, row))
    unique = {rid: row for _, rid, row in todo}  # the same step twice is asked once
    log.info("%d rows: %d have a rationale, %d cached, %d to synthesize (%d unique)",
             counts["rows"], counts["existing"], counts["cached"], len(todo), len(unique))  # fmt: skip
    failures: dict[str, Outcome] = {}
    synth = Synthesizer(cfg)
    try:
        if unique:
            model = await synth.discover()
            log.info("asking %s (model %r), %d at a time", cfg.base_url, model, cfg.concurrency)
            await _run_all(synth, cache, unique, failures, run_id, cfg.concurrency)
    finally:
        await synth.aclose()
        cache.close()
    out_rows: dict[str, list[dict[str, Any]]] = {s: [] for s in splits}
    failed_rows = []
    for split, rows in splits.items():
        for row in rows:
            rid = row_id(row)
            if row["rationale"].strip() and not cfg.overwrite_existing:
                out_rows[split].append(row)
            elif rid in cache.entries:
                out_rows[split].append({**row, "rationale": cache.entries[rid]["rationale"]})
            else:
                o = failures.get(rid, Outcome(None, 0, "not attempted"))
                failed_rows.append({"id": rid, "split": split, "session_id": row["session_id"],
                                    "step": row["step"], "attempts": o.attempts,
                                    "reason": o.reason})  # fmt: skip
    counts["synthesized"] = sum(1 for _, rid, _ in todo if rid in cache.entries)
    counts["failed"] = len(failed_rows)
    summary = {"run": run_id, **counts, "requests": synth.requests, "model": synth.model,
               "base_url": cfg.base_url, "seconds": round(time.monotonic() - t0, 2)}  # fmt: skip
    write_outputs(cfg.output, out_rows, failed_rows, summary)
    return summary


async def _run_all(
    synth: Synthesizer, cache: Cache, unique: dict[str, dict[str, Any]],
    failures: dict[str, Outcome], run_id: str, concurrency: int,
) -> None:  # fmt: skip
    queue: asyncio.Queue[tuple[str, dict[str, Any]]] = asyncio.Queue()
    for item in unique.items():
        queue.put_nowait(item)
    done = 0
    last_log = time.monotonic()

    async def worker() -> None:
        nonlocal done, last_log
        while True:
            try:
                rid, row = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            o = await synth.rationale(row)
            if o.rationale is not None:
                # Durable before anything else: a kill after this line keeps the row.
                cache.add({"id": rid, "rationale": o.rationale, "model": synth.model,
                           "attempts": o.attempts, "run": run_id, "time": round(time.time(), 3),
                           "session_id": row["session_id"], "step": row["step"]})  # fmt: skip
            else:
                failures[rid] = o
                log.warning("row %s/%s failed after %d request(s): %s", row["session_id"],
                            row["step"], o.attempts, o.reason)  # fmt: skip
            done += 1
            if time.monotonic() - last_log > 10:
                log.info("%d/%d rows done, %d failed", done, len(unique), len(failures))
                last_log = time.monotonic()

    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(unique)))))


def summary_line(s: Mapping[str, Any]) -> str:
    return (
        f"synthesis: {s['rows']} rows -> {s['synthesized']} synthesized now, {s['cached']} from "
        f"the cache, {s['existing']} kept, {s['failed']} failed ({s['requests']} requests, "
        f"{s['seconds']:.1f}s)"
    )


def parse_args(argv: list[str] | None = None) -> SynthConfig:
    """One flag per :class:`SynthConfig` field (settings/cli.py), validated (a bad value:
    argparse's error naming it, exit 2)."""
    from settings.cli import add_config_flags, flag_values

    p = argparse.ArgumentParser(
        prog="python -m env_server.synthesize", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    add_config_flags(p, SynthConfig, files=False)
    try:
        return SynthConfig.model_validate(flag_values(SynthConfig, p.parse_args(argv)))
    except Exception as e:  # pydantic ValidationError: say which flag, exit 2
        p.error(str(e))
        raise  # unreachable


def main(argv: list[str] | None = None) -> int:
    import httpx

    cfg = parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request is noise
    try:
        summary = asyncio.run(synthesize(cfg))
    except (FileNotFoundError, ValueError) as e:  # bad input: DataFormatError names the row
        print(f"error: {e}", file=sys.stderr)
        return 2
    except httpx.HTTPError as e:  # the endpoint never answered /models; nothing was lost
        print(f"error: cannot use {cfg.base_url}: {type(e).__name__}: {e}", file=sys.stderr)
        return 3
    print(summary_line(summary))
    if summary["failed"]:
        print(f"{summary['failed']} row(s) failed; see {cfg.output / 'failed.jsonl'} "
              "(rerun to retry them; finished rows come from the cache)", file=sys.stderr)  # fmt: skip
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
