"""A run's GRPO checkpoints on held-out steps: the learning curve against the trainer's steps
and its wall time, paired with the run's SFT evaluation.

    flock /tmp/heavy.lock .venv/bin/python -m bench.learning.checkpoints RUN_DIR --steps 10 20

Each checkpoint asked for (``RUN_DIR/trainer/checkpoints/step_N/model``: a whole model; a LoRA
adapter is refused) is served by a vLLM server of its own with every core, as the launcher's
evaluations are (launch/evaluation.py), and answers the rows of the run's SFT evaluation
(``RUN_DIR/eval_sft/metrics.json``: its split, row count and server dtype) greedily with the run's env
config (``config/env.yaml``: tokenizer, budgets, dataset), into ``RUN_DIR/eval_step_N/``.
The table (``RUN_DIR/checkpoints.md``, ``checkpoints.json``) has one line per step, the SFT
model first and the run's own RL evaluation (its last step) where there is one: the trainer's
wall time to that step (``trainer/metrics.jsonl``), exact match, type accuracy, the paper's
mean reward, and the paired differences to the SFT model on the same rows (± SE).
Choosing a run's length on the validation split is what it is for: a run evaluated with
``--eval-split validation`` (no test row is looked at).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from pathlib import Path
from typing import Any

from bench.common import stop_on_sigterm

KEYS = ("exact_match", "type_accuracy", "macro_f1", "mean_reward")


PARTS = ("wait_s", "step_s", "checkpoint_s", "sync_s")
"""What the trainer logs of a step's time: the wait for its batch, the step, its checkpoint and
its weight sync."""


def wall_to_step(run_dir: Path) -> dict[int, float]:
    """Seconds from the trainer's wait for its first batch to the end of each step: the
    metrics' ``time`` stamps, from the first step's stamp less its logged parts."""
    lines = (run_dir / "trainer" / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(x) for x in lines]
    stamps = {int(r["step"]): float(r["time"]) for r in rows if "time" in r}
    if not stamps:
        return {}
    first = next(r for r in rows if int(r["step"]) == min(stamps))
    t0 = stamps[min(stamps)] - sum(float(first.get(k, 0.0)) for k in PARTS)
    return {step: round(t - t0, 1) for step, t in sorted(stamps.items())}


def paired(sft: dict[str, Any], other: dict[str, Any], key: str) -> tuple[float, float]:
    from env_server.eval_stats import paired_difference

    return paired_difference(sft["per_sample"][key], other["per_sample"][key])


def row(label: str, step: int, wall: float | None, m: dict, sft: dict) -> dict[str, Any]:
    out: dict[str, Any] = {"model": label, "step": step, "trainer_wall_s": wall}
    out |= {k: m.get(k) for k in KEYS}
    for key in ("exact", "reward"):
        d, se = paired(sft, m, key)
        out[f"{key}_vs_sft"], out[f"{key}_vs_sft_se"] = d, se
    return out


def table(rows: list[dict[str, Any]], split: str, n: int) -> str:
    head = (
        f"{n} {split} steps, greedy; paired differences to the SFT model on the same rows (± SE)\n\n"
        "| model | GRPO step | trainer wall time | exact match | RL - SFT exact | type acc. "
        "| macro-F1 | mean reward | RL - SFT reward |\n|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        wall = "" if r["trainer_wall_s"] is None else f"{r['trainer_wall_s'] / 60:.1f} min"
        d_exact = f"{100 * r['exact_vs_sft']:+.1f} ± {100 * r['exact_vs_sft_se']:.1f}"
        d_reward = f"{r['reward_vs_sft']:+.1f} ± {r['reward_vs_sft_se']:.1f}"
        if r["step"] == 0:
            d_exact = d_reward = ""
        lines.append(
            f"| {r['model']} | {r['step']} | {wall} | {100 * r['exact_match']:.1f}% | {d_exact} "
            f"| {100 * r['type_accuracy']:.1f}% | {100 * r['macro_f1']:.1f}% "
            f"| {r['mean_reward']:.1f} | {d_reward} |"
        )
    return head + "\n".join(lines) + "\n"


def evaluate_checkpoint(run_dir: Path, step: int, split: str, n: int, dtype: str) -> dict[str, Any]:
    """``step``'s checkpoint on a server of its own with every core, in the SFT evaluation's
    dtype (``dtype``: its ``server_dtype``): its metrics, which name that dtype too."""
    from launch.evaluation import evaluation_argv, record_server_dtype
    from launch.run_plan import RUN_DTYPE
    from launch.threads import available_cores, light_env, plan_threads
    from launch.vllm_server import server_env, start_bridge_server

    model = run_dir / "trainer" / "checkpoints" / f"step_{step:06d}" / "model"
    if not (model / "config.json").is_file():
        raise SystemExit(f"{model}: no whole model there (missing, or a LoRA adapter)")
    env_file = run_dir / "config" / "env.yaml"
    tokenizer = str(_env_value(env_file, "tokenizer"))
    alone = plan_threads(available_cores(), 1).alone_server()
    env = server_env(None, "cpu") | alone
    log = run_dir / f"vllm_eval_step_{step}.log"
    extra = ["--tokenizer", tokenizer] + (["--dtype", dtype] if dtype != RUN_DTYPE else [])
    server = start_bridge_server(model, "none", log, env=env, extra=extra)
    try:
        label = f"step_{step}"
        argv = evaluation_argv(label, server.base_url, n, run_dir, env_file, 0, split)
        with (run_dir / f"eval_{label}.log").open("w") as out:
            subprocess.run(
                argv, check=True, stdout=out, stderr=out, env={**os.environ, **light_env()}
            )
    finally:
        server.stop()
    return record_server_dtype(run_dir / f"eval_{label}" / "metrics.json", dtype)


def _served(metrics: dict[str, Any]) -> tuple[str, int, str]:
    """What an evaluation must share with the SFT one to pair with it: split, rows, dtype."""
    from launch.evaluation import served_as

    split, dtype = served_as(metrics)
    return split, int(metrics["n"]), dtype


def _env_value(env_file: Path, key: str) -> Any:
    import yaml

    return yaml.safe_load(env_file.read_text())["env"][key]


def main() -> None:
    ap = argparse.ArgumentParser(
        "python -m bench.learning.checkpoints",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    ap.add_argument("run_dir", type=Path, help="a launch/run_all.sh run directory")
    ap.add_argument("--steps", type=int, nargs="+", required=True, help="checkpoints to evaluate")
    ap.add_argument(
        "--report",
        action="store_true",
        help="only the table, from the kept files (a step "
        "evaluated before on the same rows is never evaluated again)",
    )
    a = ap.parse_args()
    stop_on_sigterm()
    run = a.run_dir
    sft = json.loads((run / "eval_sft" / "metrics.json").read_text())
    alike = _served(sft)
    split, n, dtype = alike
    walls = wall_to_step(run)
    rows = [row("SFT", 0, None, sft, sft)]
    for step in sorted(a.steps):
        done = run / f"eval_step_{step}" / "metrics.json"
        kept = json.loads(done.read_text()) if done.exists() else None
        if a.report and kept is None:
            raise SystemExit(f"{done}: step {step} was not evaluated (run without --report)")
        if a.report or (kept is not None and _served(kept) == alike):
            m = kept  # evaluated before (an earlier call): not again
        else:
            m = evaluate_checkpoint(run, step, split, n, dtype)
        rows.append(row("GRPO checkpoint", step, walls.get(step), m, sft))
        print(table(rows, split, n), flush=True)
    rl = run / "eval_rl" / "metrics.json"
    if rl.exists():
        m = json.loads(rl.read_text())
        if _served(m) == alike:
            last = max(walls) if walls else -1
            rows.append(row("RL (the run's own evaluation)", last, walls.get(last), m, sft))
    text = table(rows, split, n)
    (run / "checkpoints.md").write_text(text)
    (run / "checkpoints.json").write_text(
        json.dumps({"split": split, "n": n, "rows": rows}, indent=2) + "\n"
    )
    print(text)


if __name__ == "__main__":
    main()
