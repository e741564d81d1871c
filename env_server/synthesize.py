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
import json
import logging
import os
import sys
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from env_server.synthesis.cache import Cache
from env_server.synthesis.config import SynthConfig
from env_server.synthesis.endpoint import Outcome, Synthesizer
from env_server.synthesis.prompt import row_id

log = logging.getLogger("env_server.synthesize")


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
    out: Path,
    rows: dict[str, list[dict[str, Any]]],
    failed: list[dict[str, Any]],
    summary: dict[str, Any],
) -> dict[str, int]:
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
    log.info(
        "%d rows: %d have a rationale, %d cached, %d to synthesize (%d unique)",
        counts["rows"],
        counts["existing"],
        counts["cached"],
        len(todo),
        len(unique),
    )
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
                failed_rows.append(
                    {
                        "id": rid,
                        "split": split,
                        "session_id": row["session_id"],
                        "step": row["step"],
                        "attempts": o.attempts,
                        "reason": o.reason,
                    }
                )
    counts["synthesized"] = sum(1 for _, rid, _ in todo if rid in cache.entries)
    counts["failed"] = len(failed_rows)
    summary = {
        "run": run_id,
        **counts,
        "requests": synth.requests,
        "model": synth.model,
        "base_url": cfg.base_url,
        "seconds": round(time.monotonic() - t0, 2),
    }
    write_outputs(cfg.output, out_rows, failed_rows, summary)
    return summary


async def _run_all(
    synth: Synthesizer,
    cache: Cache,
    unique: dict[str, dict[str, Any]],
    failures: dict[str, Outcome],
    run_id: str,
    concurrency: int,
) -> None:
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
                cache.add(
                    {
                        "id": rid,
                        "rationale": o.rationale,
                        "model": synth.model,
                        "attempts": o.attempts,
                        "run": run_id,
                        "time": round(time.time(), 3),
                        "session_id": row["session_id"],
                        "step": row["step"],
                    }
                )
            else:
                failures[rid] = o
                log.warning(
                    "row %s/%s failed after %d request(s): %s",
                    row["session_id"],
                    row["step"],
                    o.attempts,
                    o.reason,
                )
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
        prog="python -m env_server.synthesize",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_flags(p, SynthConfig, files=False)
    try:
        return SynthConfig.model_validate(flag_values(p.parse_args(argv)))
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
        print(
            f"{summary['failed']} row(s) failed; see {cfg.output / 'failed.jsonl'} "
            "(rerun to retry them; finished rows come from the cache)",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
