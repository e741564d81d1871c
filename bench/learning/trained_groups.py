"""Which rows did a GRPO run train on, and how did its samples' action types move there?
(issue 46, point 4: over-clicking where the shopper leaves)

Reads a Shop-R1 run's ``env_metrics.jsonl`` (one line per scored group: its training row,
the policy version that sampled it, whether it was pushed or dropped as constant, and the
share of its samples whose action type was the shopper's, ``type_match``) and the train
split's gold actions. Prints, per gold action type, the groups sampled in the first and
the second half of the run's policy versions (how many of them were pushed, the rest dropped
as constant) and their mean ``type_match`` in each half. A share falling on the rows whose
gold is ``terminate`` is the policy learning to act where the shopper leaves.

  python -m bench.learning.trained_groups RUN_DIR [RUN_DIR ...] [--data artifacts/data/shop_r1]

Step episodes only (``env.episode: step``, a row per group).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from settings import paths


def gold_types(data_dir: Path) -> dict[tuple[str, int], str]:
    """(session id, step) -> the shopper's action type, over the train split."""
    from env_server.data.dataset import load_or_build

    rows = load_or_build(data_dir)["train"].to_list()
    return {(str(r["session_id"]), r["step"]): json.loads(r["action"])["type"] for r in rows}


def trained_groups(run_dir: Path, gold: dict[tuple[str, int], str]) -> dict[str, Any]:
    """Per gold action type and half of the run's policy versions [first, second]: ``groups``
    sampled, ``pushed`` of them (the rest dropped as constant) and ``type_match``, the mean
    share of their samples with the shopper's action type (over every group sampled; None
    where none); ``halves_split_at`` the first policy version of the second half."""
    groups = []
    for line in (run_dir / "env_metrics.jsonl").read_text().splitlines():
        g = json.loads(line)
        if g.get("kind") != "group":
            continue
        row = g.get("row", {})
        if "step" not in row:
            raise SystemExit(f"{run_dir}: a group without a row step (session episodes?): {row}")
        key = (str(row["session_id"]), row["step"])
        if key not in gold:
            raise SystemExit(f"{run_dir}: row {key} is not in the train split given (--data)")
        groups.append((gold[key], g))
    if not groups:
        raise SystemExit(f"{run_dir}: no scored group in env_metrics.jsonl")
    split_at = (1 + max(g["policy_version"] for _, g in groups)) // 2 or 1
    out: dict[str, Any] = {}
    for kind, g in groups:
        o = out.setdefault(kind, {"groups": [0, 0], "pushed": [0, 0], "matched": [0.0, 0.0]})
        half = int(g["policy_version"] >= split_at)
        o["groups"][half] += 1
        o["pushed"][half] += bool(g["pushed"])
        o["matched"][half] += g["type_match"]
    for o in out.values():
        matched = o.pop("matched")
        o["type_match"] = [m / n if n else None for m, n in zip(matched, o["groups"], strict=True)]
    return {"halves_split_at": split_at, "by_gold_type": dict(sorted(out.items()))}


def table(run_dir: Path, result: dict[str, Any]) -> str:
    """The markdown table of :func:`trained_groups`."""
    s = result["halves_split_at"]
    head = (
        f"| gold action | groups (pushed), v0-{s - 1} | type match | groups (pushed), v{s}+ "
        "| type match |"
    )
    lines = [f"{run_dir}:", "", head, "|---|---|---|---|---|"]
    for kind, o in result["by_gold_type"].items():
        cells = [kind]
        for half in (0, 1):
            m = o["type_match"][half]
            cells += [
                f"{o['groups'][half]} ({o['pushed'][half]})",
                "-" if m is None else f"{m:.2f}",
            ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        "python -m bench.learning.trained_groups",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    p.add_argument("runs", type=Path, nargs="+", help="run folders holding env_metrics.jsonl")
    p.add_argument("--data", type=Path, default=paths.DATA_DIR, help="the dataset the runs used")
    p.add_argument("--json", type=Path, help="also write every run's numbers here")
    args = p.parse_args(argv)
    gold = gold_types(args.data)
    results = {str(run): trained_groups(run, gold) for run in args.runs}
    print("\n\n".join(table(Path(run), r) for run, r in results.items()))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
