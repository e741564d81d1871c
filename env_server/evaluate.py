"""Evaluation: exact match, action-type accuracy, macro-F1, per-type table (paper Tables 2-3).

    python -m env_server.evaluate --split test --inference-url http://127.0.0.1:9001
    python -m env_server.evaluate --split test --predictions preds.jsonl

A predictions file has one JSON object per line: ``session_id``, ``step`` and ``completion``
(the model's raw text). With ``--inference-url`` the model is asked greedily (temperature 0), and
each line also holds the ``token_ids`` the server sampled (the text of a token that is not
valid UTF-8 on its own depends on the detokenizer; the ids do not).
Prints the table, writes ``metrics.json``, ``predictions.jsonl`` and ``confusion.png``.

Besides the paper's metrics, ``metrics.json`` splits the mean Shop-R1 reward into its parts
(``reward_components``): with DARS = 1000 one ROUGE-L hit on the hard attribute outweighs
every other credit, so the total alone hides whether format or type improved. It also gives
the paper's ``binary`` reward (1 for an exact action match), standard errors, a 95% Wilson
interval for exact match, and per-sample vectors (``per_sample``: exact, reward, and the
reward without its DARS part) so that two evaluations of the same rows can be compared
pairwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from env_server.eval_stats import compute_metrics, format_table, oracle_exact_match, plot_confusion

if TYPE_CHECKING:
    from env_server.inference import Completion

PROGRESS_LINE = "rows done %d/%d"
"""Logged as completions arrive (about every 2% of the rows); launch/run_all.sh's console
follows it (launch/progress.py)."""
log = logging.getLogger("env_server.evaluate")


CONCURRENCY = 16
"""Requests in flight by default: vLLM batches their decoding (the default run's 512 test rows
took 37-40 s against 76-98 s at 4 on one CPU core, the same answers; docs/BENCHMARKS.md 5c)."""


async def generate_completions(
    rows: Sequence[Mapping[str, Any]],
    client: Any,
    tokenizer: Any,
    max_prompt_tokens: int | None,
    max_tokens: int,
    latest_only: bool = False,
    concurrency: int = CONCURRENCY,
    on_done: Callable[[int, int], None] | None = None,
) -> list[Completion]:
    """Greedy completions of ``rows`` from an :class:`~env_server.inference.InferenceClient`
    (text and token ids); ``on_done(done, total)`` is called as each one arrives."""
    from env_server.rollout import prompt_ids

    sem = asyncio.Semaphore(concurrency)
    done = 0

    async def one(row: Mapping[str, Any]) -> Completion:
        nonlocal done
        async with sem:  # encoded when its turn comes: the first requests go out at once
            ids = prompt_ids(row, tokenizer, max_prompt_tokens, latest_only)
            batch = await client.complete(ids, n=1, max_tokens=max_tokens, temperature=0.0)
        done += 1
        if on_done is not None:
            on_done(done, len(rows))
        return batch.completions[0]

    return list(await asyncio.gather(*(one(r) for r in rows)))


def read_predictions(path: Path, rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """Completions of a predictions file, in the order of ``rows`` (every row must have one)."""
    from env_server.data.loaders import DataFormatError, iter_records

    by_key: dict[tuple[str, int], str] = {}
    for where, rec in iter_records(path):
        if not isinstance(rec.get("completion"), str):
            raise DataFormatError(path, where, "completion", "expected the model's text")
        by_key[(str(rec.get("session_id")), int(rec.get("step", -1)))] = rec["completion"]
    missing = [
        (r["session_id"], r["step"]) for r in rows if (r["session_id"], r["step"]) not in by_key
    ]
    if missing:
        raise ValueError(f"{path}: no prediction for {len(missing)} rows, e.g. {missing[:3]}")
    return [by_key[(r["session_id"], r["step"])] for r in rows]


def log_progress(done: int, total: int) -> None:
    """Log :data:`PROGRESS_LINE` for the first, every ~2% and the last row."""
    if done == 1 or done == total or done % max(1, total // 50) == 0:
        log.info(PROGRESS_LINE, done, total)


async def _predict_with_model(
    args: argparse.Namespace, rows: list[dict[str, Any]]
) -> list[Completion]:
    from transformers import AutoTokenizer

    from env_server.inference import InferenceClient, wait_ready

    client = InferenceClient(args.inference_url, args.model, max_attempts=args.max_attempts)
    try:
        if args.wait_for_server > 0:
            await wait_ready(args.inference_url, args.wait_for_server)
        _, root = await client.discover() if args.model is None else (args.model, None)
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or root)
        return await generate_completions(
            rows,
            client,
            tokenizer,
            args.max_prompt_tokens,
            args.max_tokens,
            args.latest_only,
            args.concurrency,
            on_done=log_progress,
        )
    finally:
        await client.aclose()


def _env_defaults(argv: list[str] | None) -> dict[str, Any]:
    """The rollouts' dataset and budgets from ``--env-config`` (the env's resolved section),
    so an evaluation measures what the run trains on."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--env-config", type=Path, default=None)
    path = pre.parse_known_args(argv)[0].env_config
    if path is None:
        return {}
    from env_server.config import parse_config

    env = parse_config(["--config", str(path)])
    keys = ("data_dir", "tokenizer", "max_prompt_tokens", "max_tokens", "latest_only", "episode")
    return {k: getattr(env, k) for k in keys}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from env_server.config import DEFAULT_MAX_PROMPT_TOKENS
    from env_server.data.dataset import load_or_build
    from env_server.sessions import as_episodes
    from settings.paths import DATA_DIR

    ap = argparse.ArgumentParser(
        "python -m env_server.evaluate",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    ap.add_argument(
        "--data-dir", type=Path, default=DATA_DIR, help="dataset folder (built if missing)"
    )
    ap.add_argument(
        "--num-sessions",
        type=int,
        default=None,
        help="sessions of the dataset (built if missing; default 3000, settings.paths)",
    )
    ap.add_argument("--split", default="test", choices=["train", "validation", "test"])
    ap.add_argument(
        "--limit",
        "--max-eval-samples",
        dest="limit",
        type=int,
        default=None,
        help="evaluate the first N steps only",
    )
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--predictions", type=Path, help="JSONL of session_id, step, completion")
    src.add_argument("--inference-url", help="OpenAI-compatible server to ask (greedy)")
    ap.add_argument("--model", default=None, help="served model name (default: ask the server)")
    ap.add_argument(
        "--tokenizer", default=None, help="tokenizer path (default: the server's model)"
    )
    ap.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=DEFAULT_MAX_PROMPT_TOKENS,
        help="context budget (as the rollouts': keep prompt + completion within "
        "the context the model was trained on)",
    )
    ap.add_argument("--max-tokens", type=int, default=160, help="completion budget")
    ap.add_argument("--latest-only", action="store_true", help="latest page only (Table 5)")
    ap.add_argument(
        "--episode",
        choices=["step", "session"],
        default="step",
        help="prompt form the model was trained in: each step its own prompt, or the session "
        "as one conversation (env_server/sessions.py)",
    )
    ap.add_argument(
        "--concurrency",
        type=int,
        default=CONCURRENCY,
        help=f"requests in flight (default {CONCURRENCY}: vLLM batches their decoding)",
    )
    ap.add_argument("--max-attempts", type=int, default=5, help="tries per request")
    ap.add_argument(
        "--wait-for-server",
        type=float,
        default=0.0,
        help="seconds to wait for the server's /health first (0: it must be up)",
    )
    ap.add_argument("--out-dir", type=Path, default=Path("runs/eval"), help="where outputs go")
    ap.add_argument(
        "--env-config",
        type=Path,
        default=None,
        help="the env service's config file (<run>/config/env.yaml): its data_dir, tokenizer, "
        "max_prompt_tokens and max_tokens are the defaults (flags win)",
    )
    ap.set_defaults(**_env_defaults(argv))
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request is noise

    split = load_or_build(args.data_dir, args.num_sessions)[args.split]
    rows = split.to_list()
    if args.episode == "session":  # histories come from the split's earlier rows
        rows = as_episodes(rows)
    rows = rows[: args.limit]
    token_ids: list[list[int]] | None = None  # a predictions file gives text only
    if args.predictions:
        completions = read_predictions(args.predictions, rows)
    else:
        asked = asyncio.run(_predict_with_model(args, rows))
        completions, token_ids = [c.text for c in asked], [c.token_ids for c in asked]
    m = compute_metrics([json.loads(r["action"]) for r in rows], completions)
    m["oracle_exact_match"] = oracle_exact_match([r["alternatives"] for r in rows])
    m["split"], m["source"] = args.split, str(args.predictions or args.inference_url)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "metrics.json").write_text(json.dumps(m, indent=2) + "\n")
    with (args.out_dir / "predictions.jsonl").open("w") as f:
        for i, (r, c) in enumerate(zip(rows, completions, strict=True)):
            rec: dict[str, Any] = {
                "session_id": r["session_id"],
                "step": r["step"],
                "completion": c,
            }
            if token_ids is not None:
                rec["token_ids"] = token_ids[i]
            f.write(json.dumps(rec) + "\n")
    plot_confusion(m, args.out_dir / "confusion.png")
    print(format_table(m))
    print(f"wrote {args.out_dir}/metrics.json, predictions.jsonl, confusion.png", file=sys.stderr)
    return m


if __name__ == "__main__":
    main()
