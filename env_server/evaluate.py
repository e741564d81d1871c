"""Evaluation: exact match, action-type accuracy, macro-F1, per-type table (paper Tables 2-3).

    python -m env_server.evaluate --split test --inference-url http://127.0.0.1:9001
    python -m env_server.evaluate --split test --predictions preds.jsonl

A predictions file has one JSON object per line: ``session_id``, ``step`` and ``completion``
(the model's raw text). With ``--inference-url`` the model is asked greedily (temperature 0).
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
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from env_server.actions import ACTION_TYPES, actions_equal
from env_server.reward import (
    ParsedOutput,
    RewardBreakdown,
    RewardConfig,
    parse_output,
    score,
)

INVALID = "invalid"
"""Predicted label of a completion that fails the format check."""
PROGRESS_LINE = "rows done %d/%d"
"""Logged as completions arrive (about every 2% of the rows); launch/run_all.sh's console
follows it (launch/progress.py)."""
log = logging.getLogger("env_server.evaluate")


def compute_metrics(
    golds: Sequence[Mapping[str, Any]], completions: Sequence[str]
) -> dict[str, Any]:
    """Metrics of raw completions against gold actions (a format failure counts as wrong).

    Macro-F1 averages the F1 of the three action types; an invalid prediction is a false
    negative of its gold type and a false positive of none.
    """
    if len(golds) != len(completions) or not golds:
        raise ValueError(
            f"need as many completions as golds (>0), got {len(completions)}/{len(golds)}"
        )
    labels = [*ACTION_TYPES, INVALID]
    confusion = {g: dict.fromkeys(labels, 0) for g in ACTION_TYPES}
    exact = {t: 0 for t in ACTION_TYPES}
    support = {t: 0 for t in ACTION_TYPES}
    cfg = RewardConfig()
    rewards: list[float] = []
    no_dars: list[float] = []
    hits: list[int] = []
    parts = dict.fromkeys(REWARD_COMPONENTS, 0.0)
    for gold, text in zip(golds, completions, strict=True):
        parsed = parse_output(text)
        pred = parsed.action["type"] if isinstance(parsed, ParsedOutput) else INVALID
        confusion[gold["type"]][pred] += 1
        support[gold["type"]] += 1
        hit = isinstance(parsed, ParsedOutput) and actions_equal(parsed.action, gold)
        exact[gold["type"]] += hit
        hits.append(int(hit))
        r = score(text, dict(gold), cfg)
        rewards.append(r.total)
        split = reward_components(r, gold["type"], cfg)
        no_dars.append(split["no_dars"])
        for k, v in split.items():
            parts[k] += v
    per_type = {}
    for t in ACTION_TYPES:
        tp = confusion[t][t]
        predicted = sum(confusion[g][t] for g in ACTION_TYPES)
        p = tp / predicted if predicted else 0.0
        r = tp / support[t] if support[t] else 0.0
        per_type[t] = {
            "support": support[t],
            "precision": p,
            "recall": r,  # = type accuracy on this type's steps
            "f1": 2 * p * r / (p + r) if p + r else 0.0,
            "exact_match": exact[t] / support[t] if support[t] else 0.0,
        }
    present = [t for t in ACTION_TYPES if support[t]]
    n = len(golds)
    em = sum(hits) / n
    return {
        "n": n,
        "exact_match": em,
        "exact_match_se": math.sqrt(em * (1 - em) / n),
        "exact_match_ci95": list(wilson_interval(sum(hits), n)),
        "type_accuracy": sum(confusion[t][t] for t in ACTION_TYPES) / n,
        "macro_f1": sum(per_type[t]["f1"] for t in present) / len(present),
        "format_rate": 1.0 - sum(confusion[g][INVALID] for g in ACTION_TYPES) / n,
        "mean_reward": sum(rewards) / n,
        "mean_reward_se": standard_error(rewards),
        # The paper's 'binary' ablation reward (1 for an exact action match) is exact match
        # itself; named here so the reward table shows both rewards side by side.
        "binary_reward": em,
        "reward_components": {k: v / n for k, v in parts.items()},
        "per_type": per_type,
        "confusion": {"labels": labels, "matrix": {g: confusion[g] for g in ACTION_TYPES}},
        "per_sample": {"exact": hits, "reward": rewards, "reward_no_dars": no_dars},
    }


REWARD_COMPONENTS = ("format", "type", "attr_presence", "attr_rouge", "dars", "no_dars")
"""Parts of the mean reward in ``metrics["reward_components"]``: ``format`` (0.5), ``type``
(0.3), ``attr_presence`` (name/text given), ``attr_rouge`` (the ROUGE-L credit that DARS does
not scale: a type_and_submit's name), ``dars`` (DARS x ROUGE-L of the hard attribute: a
click's name, a type_and_submit's text) and ``no_dars`` (the total without the DARS part)."""


def reward_components(r: RewardBreakdown, gold_type: str, cfg: RewardConfig) -> dict[str, float]:
    """One completion's reward split into :data:`REWARD_COMPONENTS` (they sum to ``total``,
    ``no_dars`` aside). The hard attribute is the one ``cfg.dars_factor`` scales."""
    dars = r.name_similarity if gold_type == "click" else r.text_similarity
    rouge = r.name_similarity if gold_type == "type_and_submit" else 0.0
    if cfg.mode == "binary":
        dars = rouge = 0.0
    return {
        "format": r.format,
        "type": r.type,
        "attr_presence": r.name + r.text,
        "attr_rouge": rouge,
        "dars": dars,
        "no_dars": r.total - dars,
    }


def standard_error(values: Sequence[float]) -> float:
    """Standard error of the mean (sample standard deviation / sqrt(n)); 0 for n < 2."""
    n = len(values)
    if n < 2:
        return 0.0
    mean = sum(values) / n
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n)


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval of a proportion (95% for z = 1.96); sound near 0 and 1 and for
    small n, where the normal approximation gives bounds outside [0, 1]."""
    if n <= 0 or not 0 <= successes <= n:
        raise ValueError(f"need 0 <= successes <= n and n > 0, got {successes}/{n}")
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def paired_difference(a: Sequence[float], b: Sequence[float]) -> tuple[float, float]:
    """Mean of ``b - a`` over the same rows and its standard error (paired: the rows' own
    difficulty cancels, so this is much tighter than comparing two independent means)."""
    if len(a) != len(b) or not a:
        raise ValueError(f"need two equally long non-empty samples, got {len(a)} and {len(b)}")
    d = [y - x for x, y in zip(a, b, strict=True)]
    return sum(d) / len(d), standard_error(d)


def oracle_exact_match(alternatives: Sequence[str]) -> float | None:
    """Expected exact match of the best possible predictor on simulated data (else None).

    The simulated shopper draws each gold action from a known distribution; always naming the
    most likely action is right with probability max_a p(a). Real data carries no such bound.
    """
    probs = [json.loads(a) for a in alternatives]
    if not probs or any(not p for p in probs):
        return None
    return sum(p[0][1] for p in probs) / len(probs)


def format_table(m: Mapping[str, Any]) -> str:
    """The paper-style table: overall metrics, then one line per action type."""
    lines = [
        f"steps {m['n']}  exact match {100 * m['exact_match']:.2f}%  "
        f"type accuracy {100 * m['type_accuracy']:.2f}%  macro-F1 {100 * m['macro_f1']:.2f}%  "
        f"valid format {100 * m['format_rate']:.1f}%  mean reward {m['mean_reward']:.2f}",
    ]
    if "exact_match_ci95" in m:
        lo, hi = m["exact_match_ci95"]
        parts = "  ".join(f"{k} {v:.3f}" for k, v in m["reward_components"].items())
        lines += [
            f"exact match 95% CI [{100 * lo:.1f}%, {100 * hi:.1f}%]  mean reward "
            f"{m['mean_reward']:.2f} +- {m['mean_reward_se']:.2f} (SE)",
            f"reward parts: {parts}",
        ]
    lines.append(
        f"{'type':<16}{'support':>8}{'exact':>9}{'type acc':>10}{'precision':>11}{'F1':>8}"
    )
    for t, r in m["per_type"].items():
        lines.append(
            f"{t:<16}{r['support']:>8}{100 * r['exact_match']:>8.2f}%{100 * r['recall']:>9.2f}%"
            f"{100 * r['precision']:>10.2f}%{100 * r['f1']:>7.2f}%"
        )
    if m.get("oracle_exact_match") is not None:
        lines.append(
            f"(best reachable exact match on this simulated split: "
            f"{100 * m['oracle_exact_match']:.2f}%)"
        )
    return "\n".join(lines)


def plot_confusion(m: Mapping[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = m["confusion"]["labels"]
    golds = list(m["confusion"]["matrix"])
    grid = [[m["confusion"]["matrix"][g][p] for p in labels] for g in golds]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.imshow(grid, cmap="Blues")
    ax.set_xticks(range(len(labels)), labels, rotation=20)
    ax.set_yticks(range(len(golds)), golds)
    ax.set_xlabel("predicted type")
    ax.set_ylabel("gold type")
    top = max(max(r) for r in grid) or 1
    for i, row in enumerate(grid):
        for j, v in enumerate(row):
            color = "white" if v > top / 2 else "black"  # readable on dark cells
            ax.text(j, i, str(v), ha="center", va="center", color=color)
    ax.set_title(f"Action types (exact match {100 * m['exact_match']:.1f}%)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


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
) -> list[str]:
    """Greedy completions of ``rows`` from an :class:`~env_server.inference.InferenceClient`;
    ``on_done(done, total)`` is called as each one arrives."""
    from env_server.rollout import prompt_ids

    sem = asyncio.Semaphore(concurrency)
    done = 0

    async def one(row: Mapping[str, Any]) -> str:
        nonlocal done
        async with sem:  # encoded when its turn comes: the first requests go out at once
            ids = prompt_ids(row, tokenizer, max_prompt_tokens, latest_only)
            batch = await client.complete(ids, n=1, max_tokens=max_tokens, temperature=0.0)
        done += 1
        if on_done is not None:
            on_done(done, len(rows))
        return batch.completions[0].text

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


async def _predict_with_model(args: argparse.Namespace, rows: list[dict[str, Any]]) -> list[str]:
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
    if args.predictions:
        completions = read_predictions(args.predictions, rows)
    else:
        completions = asyncio.run(_predict_with_model(args, rows))
    m = compute_metrics([json.loads(r["action"]) for r in rows], completions)
    m["oracle_exact_match"] = oracle_exact_match([r["alternatives"] for r in rows])
    m["split"], m["source"] = args.split, str(args.predictions or args.inference_url)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "metrics.json").write_text(json.dumps(m, indent=2) + "\n")
    with (args.out_dir / "predictions.jsonl").open("w") as f:
        for r, c in zip(rows, completions, strict=True):
            f.write(
                json.dumps({"session_id": r["session_id"], "step": r["step"], "completion": c})
                + "\n"
            )
    plot_confusion(m, args.out_dir / "confusion.png")
    print(format_table(m))
    print(f"wrote {args.out_dir}/metrics.json, predictions.jsonl, confusion.png", file=sys.stderr)
    return m


if __name__ == "__main__":
    main()
