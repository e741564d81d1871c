"""Where a command's CPU time goes, by kind of process (issue 48 point 5).

The test suite starts hundreds of processes (vLLM servers and their engine cores, trainers,
env services, verifiers' episode programs, atroposlib envs); ``/usr/bin/time`` counts only
the ones their parents waited for, and pytest's durations are wall time. This runs a command
(by default the README's ``bash tests/run.sh``) and, every ``--interval`` seconds, reads every
process's user + system CPU time (psutil), then sums per kind (``KINDS``: matched on the
command line, first match wins). A process that existed before the command counts only what
it used after. What the sampling misses (a process's last interval, processes that live less
than one) is reported as the gap to the box's busy time (``/proc/stat``), so the table says
how much it covers.

  python -m bench.suite.cpu_by_process --out /tmp/suite_cpu.json            # the suite
  python -m bench.suite.cpu_by_process --out X.json -- bash tests/run.sh -m unit
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import psutil

from bench.common import machine
from launch.procs import ManagedProcess

KINDS: list[tuple[str, tuple[str, ...]]] = [
    ("forked-server template", ("multiprocessing.forkserver",)),  # its preloads name vLLM
    ("vLLM engine core", ("EngineCore",)),
    ("vLLM API server", ("vllm_patching.serve", "vllm.entrypoints")),
    ("verifiers episode program", ("verifiers/runtimes/scripts",)),
    ("verifiers env service", ("env_server.verifiers",)),
    ("evaluation", ("env_server.evaluate",)),
    ("Shop-R1 env service, dataset", ("env_server",)),
    ("trainer", ("-m trainer", "trainer.", "fsdp_worker.py", "torch.distributed.run")),
    ("batching API", ("-m api",)),
    ("atroposlib envs and trainers", ("atropos",)),
    ("launcher", ("run_all", "-m launch", "launch.")),
    ("pytest workers (the tests' own code)", ("sys.stdin.readline", "pytest", "execnet")),
    ("install", ("pip", "/uv", "compileall")),
    ("Chromium (report page test)", ("chrom",)),
]
"""(kind, substrings of the command line or process name); the first kind that matches."""
TOP_MIN_S = 0.5
"""The result lists every process that used at least this much CPU, most first."""


def kind_of(cmdline: list[str], name: str) -> str:
    if not cmdline:
        return "kernel threads"
    text = " ".join(cmdline) + " " + name
    for kind, needles in KINDS:
        if any(n in text for n in needles):
            return kind
    return f"other: {Path(cmdline[0]).name}"


def busy_cpu_s() -> float:
    """CPU-seconds the box has spent not idle since boot, all cores (``/proc/stat``)."""
    t = psutil.cpu_times()
    return sum(t) - t.idle - t.iowait


def sample(procs: dict[tuple[int, float], dict], before: bool = False) -> None:
    """Every process's CPU used so far (``used``) into ``procs``; ``before``: the sample
    taken before the command starts, whose processes count only what they use from then on."""
    for p in psutil.process_iter(["pid", "cmdline", "name", "create_time"]):
        try:
            t = p.cpu_times()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        cpu = t.user + t.system
        entry = procs.setdefault((p.info["pid"], p.info["create_time"]), {})
        entry.setdefault("base", cpu if before else 0.0)
        cmdline = p.info["cmdline"] or []
        if cmdline or "kind" not in entry:  # the latest: a fork of a template renames itself
            entry["kind"] = kind_of(cmdline, p.info["name"] or "")
            entry["cmd"] = " ".join(cmdline or [p.info["name"] or ""])[:200]
        entry["used"] = cpu - entry["base"]


def measure(argv: list[str], log: Path, interval: float) -> dict:
    procs: dict[tuple[int, float], dict] = {}
    sample(procs, before=True)
    busy0, t0 = busy_cpu_s(), time.monotonic()
    run = ManagedProcess("measured", argv, log).start()
    try:
        while run.alive():
            sample(procs)
            time.sleep(interval)
        rc = run.popen.wait() if run.popen else None
    finally:
        run.stop()
    wall, busy = time.monotonic() - t0, busy_cpu_s() - busy0
    kinds: dict[str, dict] = {}
    for p in procs.values():
        k = kinds.setdefault(p["kind"], {"cpu_s": 0.0, "processes": 0})
        k["cpu_s"] += p["used"]
        k["processes"] += p["used"] > 0.05
    attributed = sum(k["cpu_s"] for k in kinds.values())
    top = sorted((p for p in procs.values() if p["used"] >= TOP_MIN_S), key=lambda p: -p["used"])
    return {
        "machine": machine(),
        "command": argv,
        "exit_code": rc,
        "wall_s": round(wall, 1),
        "busy_cpu_s": round(busy, 1),
        "cores_busy": round(busy / wall / psutil.cpu_count(), 3),
        "attributed_cpu_s": round(attributed, 1),
        "interval_s": interval,
        "kinds": {
            k: {"cpu_s": round(v["cpu_s"], 1), "processes": v["processes"]}
            for k, v in sorted(kinds.items(), key=lambda kv: -kv[1]["cpu_s"])
        },
        "processes": [
            {"kind": p["kind"], "cpu_s": round(p["used"], 1), "cmd": p["cmd"]} for p in top
        ],
    }


def table(result: dict) -> str:
    busy = result["busy_cpu_s"]
    rows = ["| kind of process | processes | CPU-s | share of busy |", "|---|---|---|---|"]
    for kind, v in result["kinds"].items():
        if v["cpu_s"] >= 1:
            rows.append(
                f"| {kind} | {v['processes']} | {v['cpu_s']:.0f} | {v['cpu_s'] / busy:.1%} |"
            )
    gap = busy - result["attributed_cpu_s"]
    rows.append(f"| not sampled (short-lived, last interval) | | {gap:.0f} | {gap / busy:.1%} |")
    head = (
        f"wall {result['wall_s']:.0f} s, box busy {busy:.0f} CPU-s "
        f"({result['cores_busy']:.1%} of {psutil.cpu_count()} cores), exit {result['exit_code']}"
    )
    return head + "\n\n" + "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        "python -m bench.suite.cpu_by_process",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    ap.add_argument("--out", type=Path, required=True, help="result JSON")
    ap.add_argument("--interval", type=float, default=1.0, help="seconds between samples")
    ap.add_argument(
        "command", nargs="*", default=["bash", "tests/run.sh"], help="after --; the suite if none"
    )
    args = ap.parse_args(argv)
    result = measure(args.command, args.out.with_suffix(".log"), args.interval)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(table(result))
    return 0 if result["exit_code"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
