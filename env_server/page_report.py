"""Where exact match and the paper's reward come from, page by page (simulated Shop-R1 only).

    python -m env_server.page_report runs/X/eval_sft/predictions.jsonl runs/X/eval_rl/predictions.jsonl
    python -m env_server.page_report --oracle            # what the best policies could reach

The simulated shopper draws every gold action from a known distribution (each row's
``alternatives``), so on this data two questions have exact answers:

- ``--oracle``: what a policy that knew the shopper's distribution would score if it named,
  on every row, the most likely action (the exact-match optimum) or the action of highest
  expected reward (the reward optimum, for the paper's reward and for a training variant).
  Where the two optima differ, a policy cannot raise exact match and the reward together.
- the predictions files: for each page kind, how many rows a model matched exactly, how many
  earned DARS credit, and how many of its clicks name an element that is not on the page at
  all (a model that cannot copy a name from the page cannot learn to pick the right one).

The page kind is read off the simulator's HTML (``env_server.data.pages``); rows of other
data count as ``other``.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from env_server.eval_stats import reward_components
from env_server.reward import ParsedOutput, RewardConfig, parse_output, score

PAGE_KINDS = ("home", "results", "product", "cart", "checkout", "confirmation", "other")
"""Page kinds in report order (``other``: a page the simulator did not render)."""

_ELEMENT = re.compile(r'name="([^"]+)"')


def page_kind(html: str) -> str:
    """The simulator page ``html`` is (by the elements only that page has)."""
    names = set(_ELEMENT.findall(html))
    if "place_order" in names:
        return "checkout"
    if "proceed_to_checkout" in names:
        return "cart"
    if "add_to_cart" in names:
        return "product"
    if "<h1>Results for " in html:
        return "results"
    if "<h1>Thank you! Order #" in html:
        return "confirmation"
    if "<h2>Today's deals</h2>" in html:
        return "home"
    return "other"


def _completion_text(action: Mapping[str, Any]) -> str:
    return json.dumps({"rationale": "-", "action": dict(action)})


def prediction_breakdown(
    rows: Sequence[Mapping[str, Any]], completions: Sequence[str]
) -> dict[str, Counter[str]]:
    """Per page kind: ``rows``, ``exact``, ``dars_hits`` (rows with DARS credit under the
    paper's reward), ``reward`` (its sum), ``invalid``, ``pred_<type>`` counts and
    ``click_off_page`` (clicks naming an element the page does not have)."""
    if len(rows) != len(completions):
        raise ValueError(f"{len(completions)} completions for {len(rows)} rows")
    cfg = RewardConfig()
    out: dict[str, Counter[str]] = {k: Counter() for k in PAGE_KINDS}
    for row, text in zip(rows, completions, strict=True):
        html = row["pages"][-1]
        c = out[page_kind(html)]
        gold = json.loads(row["action"])
        r = score(text, gold, cfg)
        c["rows"] += 1
        c["exact"] += r.exact_match
        c["reward"] += r.total
        c["dars_hits"] += reward_components(r, gold["type"], cfg)["dars"] > 0
        if not r.valid:
            c["invalid"] += 1
            continue
        c[f"pred_{r.pred_type}"] += 1
        if r.pred_type == "click":
            name = parse_output(text).action["name"]  # type: ignore[union-attr]  # valid
            c["click_off_page"] += name not in _ELEMENT.findall(html)
    return {k: c for k, c in out.items() if c["rows"]}


def oracle_policies(
    rows: Sequence[Mapping[str, Any]], train_reward: RewardConfig | None = None
) -> dict[str, dict[str, tuple[float, float, int]]]:
    """Expected (exact matches, paper reward, rows) per page kind (and ``all``) of three
    policies that know each row's gold distribution: ``exact_optimal`` (the most likely
    action), ``reward_optimal`` (highest expected paper reward) and ``train_optimal``
    (highest expected ``train_reward``, default the paper's ``no_dars`` ablation)."""
    paper = RewardConfig()
    train = train_reward or RewardConfig.variant("no_dars")
    totals: dict[str, dict[str, list[float]]] = {
        p: {} for p in ("exact_optimal", "reward_optimal", "train_optimal")
    }
    for row in rows:
        alts = [(json.loads(a), p) for a, p in json.loads(row["alternatives"])]
        if not alts:
            raise ValueError(f"row {row.get('session_id')}/{row.get('step')}: no alternatives")
        cands = []
        for action, prob in alts:
            text = _completion_text(action)
            paper_r = sum(q * score(text, g, paper).total for g, q in alts)
            train_r = sum(q * score(text, g, train).total for g, q in alts)
            cands.append((prob, paper_r, train_r))
        picks = {
            "exact_optimal": max(cands, key=lambda c: c[0]),
            "reward_optimal": max(cands, key=lambda c: c[1]),
            "train_optimal": max(cands, key=lambda c: c[2]),
        }
        kind = page_kind(row["pages"][-1])
        for policy, (prob, paper_r, _) in picks.items():
            for key in (kind, "all"):
                acc = totals[policy].setdefault(key, [0.0, 0.0, 0])
                acc[0] += prob
                acc[1] += paper_r
                acc[2] += 1
    return {p: {k: (v[0], v[1], int(v[2])) for k, v in d.items()} for p, d in totals.items()}


def format_breakdown(name: str, b: Mapping[str, Counter[str]]) -> str:
    lines = [
        f"### {name}",
        "",
        "| page | rows | exact | DARS hits | mean reward | invalid | click / type / terminate "
        "| clicks naming no element of the page |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for kind, c in b.items():
        types = f"{c['pred_click']} / {c['pred_type_and_submit']} / {c['pred_terminate']}"
        lines.append(
            f"| {kind} | {c['rows']} | {c['exact']} | {c['dars_hits']} | "
            f"{c['reward'] / c['rows']:.1f} | {c['invalid']} | {types} | {c['click_off_page']} |"
        )
    total = sum(b.values(), Counter())
    lines.append(
        f"| **all** | {total['rows']} | {total['exact']} ({100 * total['exact'] / total['rows']:.1f}%)"
        f" | {total['dars_hits']} | {total['reward'] / total['rows']:.1f} | {total['invalid']} | "
        f"{total['pred_click']} / {total['pred_type_and_submit']} / {total['pred_terminate']} | "
        f"{total['click_off_page']} |"
    )
    return "\n".join(lines)


def format_oracle(o: Mapping[str, Mapping[str, tuple[float, float, int]]]) -> str:
    kinds = [k for k in (*PAGE_KINDS, "all") if k in o["exact_optimal"]]
    head = " | ".join(kinds)
    lines = [
        f"| policy (expected exact matches / mean paper reward) | {head} |",
        "|---|" + "---|" * len(kinds),
    ]
    for policy, d in o.items():
        cells = [f"{d[k][0]:.1f} / {d[k][1] / d[k][2]:.0f}" for k in kinds]
        lines.append(f"| {policy} | " + " | ".join(cells) + " |")
    lines.append("| rows | " + " | ".join(str(o["exact_optimal"][k][2]) for k in kinds) + " |")
    return "\n".join(lines)


def compare_pages(rows: Sequence[Mapping[str, Any]], runs: Mapping[str, Sequence[str]]) -> str:
    """Exact match per page kind for several models on the same rows (``runs``: label ->
    completions), and the share of each model's results-page clicks that name an element on
    the page: a markdown table."""
    b = {label: prediction_breakdown(rows, completions) for label, completions in runs.items()}
    kinds = [k for k in PAGE_KINDS if any(k in v for v in b.values())]
    lines = ["| page | rows | " + " | ".join(f"{label} exact" for label in b) + " |"]
    lines.append("|---|---|" + "---|" * len(b))
    for kind in kinds:
        n = next(v[kind]["rows"] for v in b.values() if kind in v)
        cells = [f"{v[kind]['exact']} ({100 * v[kind]['exact'] / n:.1f}%)" for v in b.values()]
        lines.append(f"| {kind} | {n} | " + " | ".join(cells) + " |")
    clicks = []
    for label, v in b.items():
        c = v.get("results", Counter())
        on = c["pred_click"] - c["click_off_page"]
        share = f"{100 * on / c['pred_click']:.1f}%" if c["pred_click"] else "undefined"
        clicks.append(f"{label} {on} of {c['pred_click']} ({share})")
    lines.append("")
    lines.append("Results-page clicks that name an element on the page: " + "; ".join(clicks))
    return "\n".join(lines)


ACTION_TYPES = ("click", "type_and_submit", "terminate")


def _predicted_type(text: str) -> str:
    parsed = parse_output(text)
    return parsed.action["type"] if isinstance(parsed, ParsedOutput) else "invalid"


def change_counts(
    rows: Sequence[Mapping[str, Any]],
    before: Sequence[str],
    after: Sequence[str],
    labels: tuple[str, str] = ("SFT", "RL"),
) -> tuple[dict[tuple[str, str], Counter[str]], dict[str, Counter[str]]]:
    """Per (gold action type, page kind): rows, each model's exact matches, rows gained and
    lost by the second; and per model, the action types it predicts where the shopper leaves
    (gold ``terminate``)."""
    if not len(rows) == len(before) == len(after):
        raise ValueError(f"{len(before)} and {len(after)} completions for {len(rows)} rows")
    a, b = labels
    cells: dict[tuple[str, str], Counter[str]] = {}
    leaves: dict[str, Counter[str]] = {a: Counter(), b: Counter()}
    for row, x, y in zip(rows, before, after, strict=True):
        gold = json.loads(row["action"])
        c = cells.setdefault((gold["type"], page_kind(row["pages"][-1])), Counter())
        ex, ey = (
            score(x, gold, RewardConfig()).exact_match,
            score(y, gold, RewardConfig()).exact_match,
        )
        c["rows"] += 1
        c[a] += ex
        c[b] += ey
        c["gained"] += ey and not ex
        c["lost"] += ex and not ey
        if gold["type"] == "terminate":
            leaves[a][_predicted_type(x)] += 1
            leaves[b][_predicted_type(y)] += 1
    return cells, leaves


def what_changed(
    rows: Sequence[Mapping[str, Any]],
    before: Sequence[str],
    after: Sequence[str],
    labels: tuple[str, str] = ("SFT", "RL"),
) -> str:
    """Where the second model gained and lost exact matches against the first on the same
    rows, per gold action type and page kind (rows gained, lost, net), then what each predicts
    where the shopper leaves (gold ``terminate``): a markdown table and a line."""
    a, b = labels
    cells, leaves = change_counts(rows, before, after, labels)
    order = {k: i for i, k in enumerate((*ACTION_TYPES, *PAGE_KINDS))}
    lines = [
        f"| gold action | page | rows | {a} exact | {b} exact | gained | lost | net |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (kind, page), c in sorted(
        cells.items(), key=lambda kv: (order.get(kv[0][0], 99), order.get(kv[0][1], 99))
    ):
        lines.append(
            f"| {kind} | {page} | {c['rows']} | {c[a]} | {c[b]} | {c['gained']} | {c['lost']} "
            f"| {c['gained'] - c['lost']:+d} |"
        )
    total = sum(cells.values(), Counter())
    lines.append(
        f"| **all** | | {total['rows']} | {total[a]} | {total[b]} | {total['gained']} | "
        f"{total['lost']} | {total['gained'] - total['lost']:+d} |"
    )
    n = sum(leaves[a].values())
    if n:
        said = "; ".join(
            f"{label} " + ", ".join(f"{t} {v[t]}" for t in (*ACTION_TYPES, "invalid") if v[t])
            for label, v in leaves.items()
        )
        lines += ["", f"Where the shopper leaves ({n} rows, gold terminate), predicted: {said}."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    from env_server.data.dataset import load_or_build
    from env_server.evaluate import read_predictions
    from settings.paths import DATA_DIR

    ap = argparse.ArgumentParser(
        "python -m env_server.page_report",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    ap.add_argument("predictions", nargs="*", type=Path, help="predictions.jsonl of evaluations")
    ap.add_argument("--oracle", action="store_true", help="also the oracle policies' table")
    ap.add_argument("--data-dir", type=Path, default=DATA_DIR, help="dataset folder")
    ap.add_argument("--split", default="test", choices=["train", "validation", "test"])
    ap.add_argument("--limit", type=int, default=512, help="first N steps (as run_all's eval)")
    ap.add_argument(
        "--num-sessions", type=int, default=None, help="sessions if it must build (default 3000)"
    )
    args = ap.parse_args(argv)
    if not args.predictions and not args.oracle:
        ap.error("give predictions files, --oracle, or both")
    rows = load_or_build(args.data_dir, args.num_sessions)[args.split].to_list()[: args.limit]
    if args.oracle:
        print(format_oracle(oracle_policies(rows)), end="\n\n")
    runs = {str(path): read_predictions(path, rows) for path in args.predictions}
    for label, completions in runs.items():
        print(format_breakdown(label, prediction_breakdown(rows, completions)))
        print()
    if len(runs) > 1:  # side by side on the same rows
        print(compare_pages(rows, runs))


if __name__ == "__main__":
    main()
