"""What every table and plot of ``bench/report/build.py`` shares: the plotting backend and the note
on the machine the results were measured on (docs/results/*.md).
"""

from __future__ import annotations

from typing import Any


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (no display), imported on first use."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def load_note(points: list[dict[str, Any]], locked: bool = True) -> str:
    """One line on the machine and its load average during the runs of ``points``."""
    loads = [p["machine"]["loadavg"][0] for p in points if "machine" in p]
    loads += [
        p[k]["loadavg"][0] for p in points for k in ("machine_before", "machine_after") if k in p
    ]
    if not loads:
        return ""
    m = next((p.get("machine") or p.get("machine_before") for p in points), {})
    flags = m.get("bf16_flags")
    cpu = m.get("cpu", "?") + (
        f"; bf16 flags: {' '.join(flags) or 'none'}" if flags is not None else ""
    )
    return (
        f"Machine: {m.get('cpus')} CPUs ({cpu}), {m.get('mem_gib', '?')} GiB; "
        f"1-min load average during the runs {min(loads):.1f}..{max(loads):.1f} "
        + (
            "(shared box; everything ran under `flock /tmp/heavy.lock`)."
            if locked
            else "(shared box; not under the heavy-job lock: the wall times include waiting for "
            "a core, the CPU seconds much less so)."
        )
    )
