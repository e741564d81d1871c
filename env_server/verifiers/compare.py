"""Before vs after on a verifiers env's held-out tasks: the one statistic both the launcher's
``eval_verifiers.md`` and ``python -m env_server.verifiers.evaluate --compare A B`` report.

Both evaluations sample several episodes of the same tasks. Tasks differ in difficulty, so
the difference is stratified by task: per task, after's mean minus before's, averaged over
the tasks both evaluated; its standard error adds each task's two-sample variance
(``var_before / n_before + var_after / n_after``, sample variances) and divides by the number
of tasks. Task difficulty cancels (as in a paired test), and every episode's own sampling
noise counts (as in a two-sample test), without needing many tasks: 4 held-out tasks with
16 episodes a side give a usable SE where a test paired by task would have 3 degrees of
freedom. Pure Python: the launcher imports it without verifiers installed.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

Row = Mapping[str, Any]

METRICS: dict[str, Callable[[Row], float]] = {
    "reward": lambda r: float(r["reward"]),
    "solved": lambda r: float(r["solved"] if "solved" in r else r["reward"] > 0),
    "turns": lambda r: float(r["turns"]),
}
"""What is compared, read off one episode row (``solved``: the row's own ``solved`` where the
env writes one, else a reward above 0 -- wrong for an env that pays partial credit, which
should then write ``solved``)."""


def read_episodes(path: Path) -> list[dict[str, Any]]:
    """The episode rows of an evaluation's JSONL (its summary line left out)."""
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return [r for r in rows if r.get("kind") == "episode"]


def _by_task(rows: Sequence[Row]) -> dict[str, list[Row]]:
    out: dict[str, list[Row]] = {}
    for r in rows:
        out.setdefault(str(r["task"]), []).append(r)
    return out


def _mean_var(xs: list[float]) -> tuple[float, float]:
    m = sum(xs) / len(xs)
    return m, sum((x - m) ** 2 for x in xs) / (len(xs) - 1)


def compare(before: Sequence[Row], after: Sequence[Row]) -> dict[str, Any]:
    """After - before per metric (``before``, ``after``, ``difference``, ``se``, ``z``),
    stratified by task over the tasks both evaluated with at least 2 episodes a side;
    ``episodes`` counts what each side contributed, ``failed`` the episodes that errored
    (scored 0, counted in)."""
    a, b = _by_task(before), _by_task(after)
    common = sorted(k for k in set(a) & set(b) if len(a[k]) >= 2 and len(b[k]) >= 2)
    if not common:
        raise ValueError(
            "no task was evaluated with at least 2 episodes on both sides "
            f"({len(a)} tasks before, {len(b)} after): evaluate with --samples >= 2"
        )
    k = len(common)
    out: dict[str, Any] = {
        "tasks": k,
        "episodes": [sum(len(a[t]) for t in common), sum(len(b[t]) for t in common)],
        "failed": [sum(r["error"] is not None for t in common for r in s[t]) for s in (a, b)],
    }
    for name, value in METRICS.items():
        m0 = m1 = var = 0.0
        for t in common:
            x0, v0 = _mean_var([value(r) for r in a[t]])
            x1, v1 = _mean_var([value(r) for r in b[t]])
            m0, m1 = m0 + x0 / k, m1 + x1 / k
            var += v0 / len(a[t]) + v1 / len(b[t])
        se, diff = math.sqrt(var) / k, m1 - m0
        z = diff / se if se > 0 else (math.copysign(math.inf, diff) if diff else 0.0)
        out[name] = {"before": m0, "after": m1, "difference": diff, "se": se, "z": z}
    return out


def table(result: Mapping[str, Any], note: str) -> str:
    """The before/after table in Markdown."""
    lines = [
        "| held-out | before | after | after - before | SE | z |",
        "|---|---|---|---|---|---|",
    ]
    labels = {
        "reward": "mean episode reward",
        "solved": "solved share",
        "turns": "model turns per episode",
    }
    for key, label in labels.items():
        r = result[key]
        lines.append(
            f"| {label} | {r['before']:.3f} | {r['after']:.3f} | {r['difference']:+.3f} "
            f"| {r['se']:.3f} | {r['z']:+.1f} |"
        )
    n0, n1 = result["episodes"]
    f0, f1 = result["failed"]
    return (
        "\n".join(lines)
        + f"\n\n{result['tasks']} held-out tasks, {n0} / {n1} episodes ({f0} / {f1} failed; "
        "difference stratified by task). " + note + "\n"
    )
