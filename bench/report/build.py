"""Tables and plots of the results pages (docs/results/*.md, linked from docs/BENCHMARKS.md)
from the JSON results under docs/results/.

    .venv/bin/python -m bench.report.build      # no measurement: reads JSON, writes PNG + tables

Each table is written between ``<!-- table:NAME -->`` and ``<!-- /table:NAME -->`` markers in
whichever of those pages holds them (the prose around them is left alone); plots go to
docs/results/*.png. A result file that does not exist yet leaves its table with a "not
measured" line. The tables
and plots: bench/report/api.py, bench/report/rollout.py, bench/report/trainer.py (shared:
bench/report/shared.py); the bridge summary is here.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from bench.common import RESULTS
from bench.report.api import api_extra_tables, api_plot, api_tables
from bench.report.rollout import rollout_plot, rollout_table
from bench.report.trainer import (
    breakdown_plot,
    breakdown_table,
    precision_table,
    step_plot,
    step_table,
)


def load(name: str) -> dict[str, Any]:
    path = RESULTS / name
    return json.loads(path.read_text()) if path.exists() else {}


def _mode_memcpy_floor(mode: dict[str, Any], res: dict[str, Any]) -> float:
    """The memcpy floor of the run that measured ``mode`` (bench/sync/bridge_sync.py keeps each
    mode's floors; older results have the model's only)."""
    return mode.get("floors", {}).get("memcpy_s", res.get("memcpy_s", float("nan")))


def bridge_summary(d: dict[str, Any]) -> str:
    if not d:
        return "_no bridge results yet (docs/results/bridge_bench.json)_"
    rows = [
        "| model | mode | sync median ms | server pause median ms | memcpy floor ms |",
        "|---|---|---|---|---|",
    ]
    for name, res in d.items():
        if not isinstance(res, dict) or "modes" not in res:
            continue
        for m in res["modes"]:
            med = m.get("median", {})
            pause = med.get("server_pause_s")
            rows.append(
                f"| {name} ({m.get('params', res.get('params', 0)) / 1e6:.0f}M) | {m.get('label')} | "
                f"{1e3 * med.get('sync_s', float('nan')):.0f} | "
                f"{'-' if pause is None else f'{1e3 * pause:.0f}'} | "
                f"{1e3 * _mode_memcpy_floor(m, res):.1f} |"
            )
    return "\n".join(rows)


# -- document -----------------------------------------------------------------------------


def _marker(name: str) -> re.Pattern[str]:
    return re.compile(rf"(<!-- table:{name} -->\n).*?(<!-- /table:{name} -->)", re.S)


def fill(doc: str, name: str, body: str) -> str:
    """``doc`` with the table between ``name``'s markers replaced by ``body`` (unchanged
    where it has no such markers)."""
    return _marker(name).sub(lambda m: m.group(1) + body.rstrip() + "\n" + m.group(2), doc)


def fill_pages(pages: Iterable[Path], tables: dict[str, str]) -> list[Path]:
    """Every table written into the page that holds its markers; the pages changed. A table
    no page has markers for is named on stderr."""
    found: set[str] = set()
    changed = []
    for page in pages:
        old = page.read_text()
        new = old
        for name, body in tables.items():
            if _marker(name).search(new):
                found.add(name)
                new = fill(new, name, body)
        if new != old:
            page.write_text(new)
            changed.append(page)
    for name in sorted(set(tables) - found):
        print(f"warning: no <!-- table:{name} --> markers in any page", file=sys.stderr)
    return changed


def main() -> None:
    ap = argparse.ArgumentParser(
        "python -m bench.report.build",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    ap.add_argument(
        "--pages",
        type=Path,
        nargs="*",
        default=None,
        help="markdown files with table markers (default: docs/results/*.md)",
    )
    args = ap.parse_args()
    api, ro = load("api_compare.json"), load("rollout_overhead.json")
    tb, ts = load("trainer_breakdown.json"), load("trainer_step.json")
    api_plot(api, RESULTS / "api_compare.png")
    rollout_plot(ro, RESULTS / "rollout_overhead.png")
    breakdown_plot(tb, RESULTS / "trainer_breakdown.png")
    step_plot(ts, RESULTS / "trainer_step.png")
    api_main, api_sweep = api_tables(api)
    api_status_env, api_profile = api_extra_tables(api)
    tables = {
        "api": api_main,
        "api_sweep": api_sweep,
        "api_status_env": api_status_env,
        "api_profile": api_profile,
        "rollout": rollout_table(ro),
        "breakdown": breakdown_table(tb),
        "step": step_table(ts),
        "precision": precision_table(load("trainer_precision.json")),
        "bridge": bridge_summary(load("bridge_bench.json")),
    }
    pages = args.pages if args.pages is not None else sorted(RESULTS.glob("*.md"))
    changed = fill_pages(pages, tables)
    print(f"updated {len(changed)} page(s) {[str(p) for p in changed]} and the plots in {RESULTS}")
    if tb:  # the figure the issue sets a target for
        for k, p in sorted(tb.items()):
            print(f"{k}: wait {100 * p['steady']['wait_frac']:.1f}% of trainer wall time")
    if ro:
        print(
            "rollout overhead median:",
            f"{100 * statistics.median(p['overhead'] for p in ro.values()):+.1f}%",
        )


if __name__ == "__main__":
    main()
