"""The launcher's thread plan on a small CPU box: where a GRPO step's time goes (trainer compute,
wait for data, sync) under several splits of the cores between vLLM and the trainer.

    flock /tmp/heavy.lock .venv/bin/python -m bench.trainer.thread_plan [--preset cpu-tiny]
        [--plans plan,t2v1,t1v01,t2v01] [--steps 20] [--rounds 2]

Each point is one real ``launch/run_all.sh --training-steps N --eval-samples 0`` (API, patched
vLLM, env service, GRPO trainer; the model, dataset and SFT checkpoint must exist, e.g. from
``make run`` or ``launch/run_all.sh --prepare-only``), with the cores split by environment
variables the launcher keeps when a user sets them (launch/threads.py):

- ``plan``: no variable set, the launcher's own plan;
- ``tXvY``: ``OMP_NUM_THREADS=X`` (the trainer's threads; the API and env get it too, they do
  little arithmetic) and ``VLLM_CPU_OMP_THREADS_BIND=Y`` (vLLM's cores, ``01`` = ``0-1``).

Read from the run's ``trainer/metrics.jsonl``: per step ``step_s`` (trainer compute),
``wait_s`` (waiting for a batch), ``sync_s`` (weight sync + policy version), the wall time
between steps, and GRPO's whole wall time. The first 2 steps are left out of the medians (the
first waits for vLLM's first rollouts). Points are interleaved over ``--rounds``. Results:
docs/results/thread_plan.json under ``<preset>/<plan>``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import REPO, RESULTS, launcher_threads, machine, parse_list, write_result

SKIP = 2


def plan_env(name: str) -> dict[str, str]:
    """``plan`` -> {}; ``t2v01`` -> OMP_NUM_THREADS=2, VLLM_CPU_OMP_THREADS_BIND=0-1."""
    if name == "plan":
        return {}
    if not (name.startswith("t") and "v" in name):
        raise ValueError(f"plan {name!r}: 'plan' or tXvY (X trainer threads, Y vLLM cores)")
    threads, cores = name[1:].split("v")
    bind = "-".join(cores) if len(cores) == 2 else cores
    return {"OMP_NUM_THREADS": threads, "VLLM_CPU_OMP_THREADS_BIND": bind}


def summarize(metrics: list[dict[str, Any]]) -> dict[str, float]:
    steps = [m for m in metrics if "step_s" in m and not m.get("skipped_update")]
    steady = steps[SKIP:] or steps
    walls = [b["time"] - a["time"] for a, b in zip(steps, steps[1:], strict=False)][SKIP - 1 :]
    med = lambda k: statistics.median(m[k] for m in steady)  # noqa: E731
    return {
        "steps": len(steps),
        "compute_s": med("step_s"),
        "wait_s": med("wait_s"),
        "sync_s": med("sync_s"),
        "checkpoint_s": med("checkpoint_s"),
        "step_wall_s": statistics.median(walls) if walls else float("nan"),
        "grpo_wall_s": steps[-1]["time"] - steps[0]["time"] if len(steps) > 1 else float("nan"),
        "staleness_mean": statistics.mean(m.get("staleness_mean", 0.0) for m in steady),
        "score_mean": statistics.mean(m["score_mean"] for m in steady),
    }


def run_point(preset: str, plan: str, steps: int, run_dir: Path) -> dict[str, Any]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND")
    }
    env |= plan_env(plan) | {"SHOP_R1_PROGRESS": "plain", "SHOP_R1_PROGRESS_INTERVAL": "60"}
    argv = ["bash", str(REPO / "launch" / "run_all.sh"), "--preset", preset]
    argv += ["--training-steps", str(steps), "--eval-samples", "0", "--run-dir", str(run_dir)]
    t0 = time.monotonic()
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=3600, check=False)
    wall = time.monotonic() - t0
    if out.returncode != 0:
        raise SystemExit(f"{plan}: run_all failed ({out.returncode}):\n{out.stdout[-3000:]}")
    lines = (run_dir / "trainer" / "metrics.jsonl").read_text().splitlines()
    row = summarize([json.loads(x) for x in lines if x.strip()])
    threads = "[run_all] " + launcher_threads(argv[2:], env) + " (launch/threads.py)"
    return {**row, "run_wall_s": wall, "thread_plan": threads, "env": plan_env(plan)}


def main() -> None:
    ap = argparse.ArgumentParser(
        "python -m bench.trainer.thread_plan",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    ap.add_argument("--preset", default="cpu-tiny")
    ap.add_argument("--plans", default="plan,t2v1,t1v01,t2v01")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS / "thread_plan.json")
    a = ap.parse_args()
    plans = parse_list(a.plans, str)
    for p in plans:
        plan_env(p)  # fail early on a bad name
    rows: dict[str, list[dict[str, Any]]] = {p: [] for p in plans}
    with tempfile.TemporaryDirectory(
        dir=REPO / "runs" if (REPO / "runs").is_dir() else None
    ) as tmp:
        for rnd in range(a.rounds):
            for p in plans:
                r = run_point(a.preset, p, a.steps, Path(tmp) / f"{p}-{rnd}")
                rows[p].append(r)
                print(
                    f"round {rnd} {p}: step wall {r['step_wall_s']:.2f}s = compute "
                    f"{r['compute_s']:.2f} + wait {r['wait_s']:.2f} + sync {r['sync_s']:.2f} "
                    f"(+ checkpoint {r['checkpoint_s']:.2f}); GRPO {r['grpo_wall_s']:.0f}s",
                    flush=True,
                )
    for p, rs in rows.items():
        nums = {
            k: statistics.median(r[k] for r in rs)
            for k in rs[0]
            if isinstance(rs[0][k], float | int)
        }
        row = {
            **nums,
            "rounds": rs,
            "plan": p,
            "env": plan_env(p),
            "thread_plan": rs[0]["thread_plan"],
            "preset": a.preset,
            "steps": a.steps,
            "machine": machine(),
        }
        write_result(a.out, f"{a.preset}/{p}", row)
    print(f"written to {a.out}")


if __name__ == "__main__":
    main()
