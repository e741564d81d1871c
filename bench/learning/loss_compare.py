"""Dr. GRPO vs GSPO vs CISPO on the CPU default (issue 28): one ``launch/run_all.sh --preset
cpu-tiny`` GRPO run per loss (same SFT start, same steps, built-in test evaluation off), then
each final model and the SFT model evaluated greedily on the same validation rows; reward and
exact match with standard errors, paired differences against the SFT model and against Dr.
GRPO (same rows, so each row's difficulty cancels).

    python -m bench.learning.loss_compare --steps 40 --eval-samples 512 --runs-dir /tmp/loss_compare
    python -m bench.learning.loss_compare --report-only --runs-dir /tmp/loss_compare   # tables again

Writes ``docs/results/loss_compare_cpu.json`` and prints the table of
``docs/results/loss_compare_cpu.md`` (the runs' logs stay in ``--runs-dir``). A ``load.log``
there samples the box's load and busiest processes every minute: the box is shared, and what
else ran is part of the result. A run or evaluation already done in ``--runs-dir`` is reused.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from bench.common import RESULTS, machine

METHODS: dict[str, list[str]] = {
    # the cpu-tiny preset as it is: PPO clip 0.2 against the inference logprobs, Dr. GRPO
    # advantages (the preset's scale_advantages: false), token-mean over the step
    "dr_grpo": [],
    # as TRL and verl run GSPO: the ratio against the trainer's own pre-step policy (decoupled:
    # --tis-cap, the inference mismatch corrected by truncated IS), the paper's clip range
    # and per-sequence averaging
    "gspo": [
        "--policy-loss gspo",
        "--loss-aggregation sequence",
        "--clip-low 3e-4",
        "--clip-high 4e-4",
        "--tis-cap 2",
    ],
    # CISPO against the inference logprobs: the clipped, detached weight min(pi / pi_inf, 5)
    # (ScaleRL's epsilon_max 5, no lower bound) on every token's log-likelihood gradient
    "cispo": ["--policy-loss cispo", "--clip-low 1", "--clip-high 4"],
}
MAX_PROMPT, MAX_TOKENS = 928, 96  # the cpu-tiny preset's budgets (rollouts and evaluation)


def _run(argv: list[str], log: Path, env: dict[str, str] | None = None) -> None:
    with open(log, "w") as f:
        rc = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, env=env).returncode
    if rc != 0:
        raise SystemExit(f"{argv[:4]} exited {rc}; read {log}")


def final_model(runs: Path, method: str, steps: int) -> Path:
    """The model folder of a run's last checkpoint (GRPO writes no model outside them)."""
    return runs / method / "trainer" / "checkpoints" / f"step_{steps:06d}" / "model"


def train(method: str, steps: int, runs: Path) -> Path:
    """One GRPO run of ``method``; returns its final model folder."""
    run_dir = runs / method
    final = final_model(runs, method, steps)
    if (final / "model.safetensors").exists():
        return final  # done before (--runs-dir reused)
    if run_dir.exists():  # an earlier attempt that did not finish: start it over
        import shutil

        shutil.rmtree(run_dir)
    args = " ".join(METHODS[method])
    argv = [sys.executable, "-m", "launch.run_all", "--preset", "cpu-tiny", "--training-steps"]
    argv += [str(steps), "--eval-samples", "0", "--run-dir", str(run_dir)]
    argv += [f"--trainer-args={args}"] if args else []
    runs.mkdir(parents=True, exist_ok=True)
    _run(argv, runs / f"{method}.out")
    return final


def evaluate_all(models: dict[str, Path], samples: int, runs: Path) -> dict[str, dict]:
    """Greedy validation metrics of each model, served in turn by one vLLM server of ours
    (mode ``none``: ``/bridge/reload`` loads the next model's weights; the tokenizer is the
    same for all). An evaluation already in ``runs`` is reused."""
    import httpx

    from launch.vllm_server import start_bridge_server
    from settings.paths import DATA_DIR

    out: dict[str, dict] = {}
    todo = {k: v for k, v in models.items() if not (runs / f"eval_{k}" / "metrics.json").exists()}
    server = None
    try:
        for version, (label, model) in enumerate(todo.items(), start=1):
            if server is None:
                token = "loss-compare"
                server = start_bridge_server(
                    model, "none", runs / "vllm_eval.log", token=token, timeout=3600
                )
            else:
                r = httpx.post(
                    f"{server.base_url}/bridge/reload",
                    json={"path": str(model), "version": version},
                    headers={"x-shop-r1-bridge-token": token},
                    timeout=1800,
                )
                r.raise_for_status()
            argv = [sys.executable, "-m", "env_server.evaluate", "--split", "validation"]
            argv += ["--limit", str(samples), "--inference-url", server.base_url]
            argv += ["--data-dir", str(DATA_DIR), "--tokenizer", str(model)]
            argv += ["--max-prompt-tokens", str(MAX_PROMPT), "--max-tokens", str(MAX_TOKENS)]
            argv += ["--out-dir", str(runs / f"eval_{label}")]
            _run(argv, runs / f"eval_{label}.log")
    finally:
        if server is not None:
            server.stop()
    for label in models:
        out[label] = json.loads((runs / f"eval_{label}" / "metrics.json").read_text())
    return out


def _load_sampler(path: Path, stop: threading.Event) -> None:
    """Every minute: load average and the busiest processes (what else ran on the box)."""
    with open(path, "a", buffering=1) as f:
        while not stop.is_set():
            top = subprocess.run(
                ["ps", "-eo", "pcpu,nice,etime,args", "--sort=-pcpu"],
                capture_output=True,
                text=True,
            ).stdout.splitlines()[1:6]
            f.write(json.dumps({"t": time.time(), "load": os.getloadavg(), "top": top}) + "\n")
            stop.wait(60)


def _paired(a: list[float], b: list[float]) -> dict[str, float]:
    from env_server.eval_stats import paired_difference

    mean, se = paired_difference(a, b)
    return {"mean": mean, "se": se}


def summarise(metrics: dict[str, dict], runs: Path) -> dict[str, Any]:
    sft = metrics["sft"]["per_sample"]
    base = metrics["dr_grpo"]["per_sample"]
    rows = {}
    for label, m in metrics.items():
        ps = m["per_sample"]
        trainer = runs / label / "trainer" / "metrics.jsonl"
        steps = [json.loads(x) for x in trainer.read_text().splitlines()] if label != "sft" else []
        rows[label] = {
            "exact_match": m["exact_match"],
            "exact_match_se": m["exact_match_se"],
            "mean_reward": m["mean_reward"],
            "mean_reward_se": m["mean_reward_se"],
            "format_rate": m["format_rate"],
            "type_accuracy": m["type_accuracy"],
            "vs_sft": {k: _paired(sft[k], ps[k]) for k in ("exact", "reward")},
            "vs_dr_grpo": {k: _paired(base[k], ps[k]) for k in ("exact", "reward")},
            "train": _train_stats(steps),
        }
    return rows


def _train_stats(steps: list[dict]) -> dict[str, float]:
    if not steps:
        return {}
    last = steps[-len(steps) // 4 :]  # the last quarter of the run

    def mean(key: str, rows: list[dict]) -> float:
        vals = [r[key] for r in rows if key in r]
        return sum(vals) / len(vals) if vals else float("nan")

    return {
        "steps": len(steps),
        "score_mean_last_quarter": mean("score_mean", last),
        "clip_fraction_mean": mean("clip_fraction", steps),
        "mismatch_kl_mean": mean("mismatch_kl", steps),
        "kl_last": steps[-1].get("kl", float("nan")),
        "step_s_median": sorted(r["step_s"] for r in steps)[len(steps) // 2],
    }


def table(rows: dict[str, Any], n: int) -> str:
    lines = [
        f"| loss | exact match (n = {n}) | vs SFT (paired) | vs Dr. GRPO (paired) | mean reward "
        "| vs SFT (paired) | vs Dr. GRPO (paired) | format | type acc. |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for label, r in rows.items():
        em, rw = r["vs_sft"]["exact"], r["vs_sft"]["reward"]
        bem, brw = r["vs_dr_grpo"]["exact"], r["vs_dr_grpo"]["reward"]
        lines.append(
            f"| {label} | {100 * r['exact_match']:.1f}% ± {100 * r['exact_match_se']:.1f} "
            f"| {100 * em['mean']:+.1f} ± {100 * em['se']:.1f} "
            f"| {100 * bem['mean']:+.1f} ± {100 * bem['se']:.1f} "
            f"| {r['mean_reward']:.1f} ± {r['mean_reward_se']:.1f} "
            f"| {rw['mean']:+.1f} ± {rw['se']:.1f} | {brw['mean']:+.1f} ± {brw['se']:.1f} "
            f"| {100 * r['format_rate']:.1f}% | {100 * r['type_accuracy']:.1f}% |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(
        "python -m bench.learning.loss_compare",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    ap.add_argument("--steps", type=int, default=40, help="GRPO steps per run")
    ap.add_argument("--eval-samples", type=int, default=512, help="validation rows evaluated")
    ap.add_argument("--runs-dir", type=Path, default=Path("runs/loss_compare"))
    ap.add_argument("--methods", default=",".join(METHODS), help="comma-separated")
    ap.add_argument("--report-only", action="store_true", help="tables from finished runs")
    args = ap.parse_args()
    from settings.paths import SFT_MODEL_DIR

    runs, methods = args.runs_dir, args.methods.split(",")
    runs.mkdir(parents=True, exist_ok=True)
    stop = threading.Event()
    sampler = threading.Thread(target=_load_sampler, args=(runs / "load.log", stop), daemon=True)
    sampler.start()
    t0 = time.time()
    try:
        if not args.report_only:
            for m in methods:
                train(m, args.steps, runs)
        models = {"sft": SFT_MODEL_DIR, **{m: final_model(runs, m, args.steps) for m in methods}}
        metrics = evaluate_all(models, args.eval_samples, runs)
    finally:
        stop.set()
    rows = summarise(metrics, runs)
    result = {
        "machine": machine(),
        "steps": args.steps,
        "eval_samples": args.eval_samples,
        "methods": {m: METHODS[m] for m in methods},
        "wall_s": time.time() - t0,
        "results": rows,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "loss_compare_cpu.json").write_text(json.dumps(result, indent=1))
    print(table(rows, args.eval_samples))


if __name__ == "__main__":
    main()
