"""Does SFT on whole sessions learn at least as well as SFT on single steps? (issue 46, point 1)

Two SFTs of SmolLM2-135M-Instruct from the same start with the same seed, then greedy
answers of each to the same validation steps, paired row by row:

- ``step``: the cpu-smol recipe as it is (recipes/smollm2-135m-instruct/shop-r1/sft.yaml):
  30 steps of 8 prompts, 1,024-token sequences (older pages dropped past 896 prompt tokens);
- ``session``: the same recipe with ``--episode session``: 36 steps of 2 whole sessions at
  4,096 tokens (each page a user turn, each earlier action and rationale an assistant turn),
  about the same number of gold turns trained (72 sessions of ~3.3 steps against 240 steps).

Each model is evaluated in the form it was trained in (``env_server.evaluate --episode``):
the step form sees at most 896 prompt tokens, the session form its whole session so far.
Settings are chosen on nothing here: the validation split only reads out the comparison.
Writes ``<out>/<form>/`` (the SFT's log and model, ``eval/metrics.json``,
``eval/predictions.jsonl``), ``<out>/times.json`` and ``<out>/result.json``; ``--report``
rebuilds the table from those files.

  python -m bench.learning.sft_forms --out docs/results/sft_forms/seed0
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from bench.common import REPO, machine, model_dir
from env_server.eval_stats import paired_difference
from launch.procs import ManagedProcess, tail
from launch.threads import available_cores, light_env
from launch.vllm_server import cpu_env, start_bridge_server

RECIPE = REPO / "recipes/smollm2-135m-instruct/shop-r1/sft.yaml"
COMPLETION_TOKENS = 128  # the recipe's: prompt budget + completion = the SFT sequence length
FORMS: dict[str, dict] = {
    "step": {"flags": [], "seq_len": 1024},
    "session": {
        "flags": ["--episode", "session", "--batch-size", "2", "--micro-batch-size", "2"],
        "seq_len": 4096,
        "steps": 36,
    },
}
METRICS = (
    ("exact", "exact match", 100, " points"),
    ("reward", "mean reward", 1, ""),
    ("reward_no_dars", "reward without DARS", 1, ""),
)
AGGREGATES = (
    ("type_accuracy", "type accuracy"),
    ("macro_f1", "macro-F1"),
    ("format_rate", "format"),
)


def sft(args: argparse.Namespace, form: str) -> float:
    """Train ``form``'s SFT model into ``<out>/<form>/model``; its wall seconds."""
    spec, out = FORMS[form], args.out / form
    argv = [sys.executable, "-m", "trainer", "sft", "--recipe", str(RECIPE)]
    argv += ["--save-path", str(out / "model"), "--seed", str(args.seed)]
    argv += ["--max-seq-len", str(spec["seq_len"]), *spec["flags"]]
    if "steps" in spec:
        argv += ["--training-steps", str(spec["steps"])]
    cores = available_cores()
    env = {**os.environ, "OMP_NUM_THREADS": str(len(cores)), "HF_HUB_OFFLINE": "1"}
    t = time.monotonic()
    proc = ManagedProcess(f"sft-{form}", argv, out / "sft.log", env=env).start()
    rc = proc.wait_exit(stall=3600, limit=6 * 3600)
    if rc != 0:
        raise SystemExit(f"the {form} SFT exited {rc}:\n{tail(proc.log_path)}")
    return time.monotonic() - t


def evaluate(args: argparse.Namespace, form: str) -> float:
    """Greedy answers of ``form``'s model to the first ``--limit`` validation steps; seconds."""
    out, seq_len = args.out / form, FORMS[form]["seq_len"]
    cores = available_cores()
    threads = {"VLLM_CPU_OMP_THREADS_BIND": f"{cores[0]}-{cores[-1]}"}
    threads["OMP_NUM_THREADS"] = str(len(cores))
    t = time.monotonic()
    server = start_bridge_server(
        out / "model",
        "none",
        out / "vllm.log",
        served_model_name="smol",
        extra=["--max-model-len", str(seq_len), "--tokenizer", str(model_dir("smol"))],
        env={**cpu_env(None), **threads},
        timeout=1800,
    )
    try:
        argv = [sys.executable, "-m", "env_server.evaluate", "--split", "validation"]
        argv += ["--limit", str(args.limit), "--inference-url", server.base_url]
        argv += ["--episode", form, "--max-tokens", str(COMPLETION_TOKENS)]
        argv += ["--max-prompt-tokens", str(seq_len - COMPLETION_TOKENS)]
        argv += ["--tokenizer", str(model_dir("smol")), "--out-dir", str(out / "eval")]
        env = {**os.environ, **light_env(), "HF_HUB_OFFLINE": "1"}
        proc = ManagedProcess(f"eval-{form}", argv, out / "eval.log", env=env).start()
        rc = proc.wait_exit(stall=1800, limit=4 * 3600)
        if rc != 0:
            raise SystemExit(f"the {form} evaluation exited {rc}:\n{tail(proc.log_path)}")
    finally:
        server.stop()
    return time.monotonic() - t


def report(args: argparse.Namespace) -> int:
    """``result.json`` and the paired table (session - step) from the run's files."""
    m = {f: json.loads((args.out / f / "eval" / "metrics.json").read_text()) for f in FORMS}
    times_path = args.out / "times.json"
    times = json.loads(times_path.read_text()) if times_path.exists() else {}
    n = len(m["step"]["per_sample"]["exact"])
    lines = [f"validation, first {n} steps, greedy; session - step, paired on the same rows", ""]
    lines += ["| metric | step | session | session - step (SE, z) |", "|---|---|---|---|"]
    result: dict = {"machine": machine(), "seed": args.seed, "rows": n, "times_s": times}
    for key, label, scale, unit in METRICS:
        a, b = m["step"]["per_sample"].get(key), m["session"]["per_sample"].get(key)
        if not a or not b:
            continue
        d, se = paired_difference(a, b)
        z = f", {d / se:+.1f}" if se else ""
        mean_a, mean_b = scale * sum(a) / len(a), scale * sum(b) / len(b)
        lines.append(
            f"| {label} | {mean_a:.2f} | {mean_b:.2f} | {scale * d:+.2f}{unit} "
            f"({scale * se:.2f}{z}) |"
        )
        result[key] = {"step": mean_a, "session": mean_b, "diff": scale * d, "se": scale * se}
    for key, label in AGGREGATES:
        a, b = m["step"][key], m["session"][key]
        lines.append(f"| {label} | {a:.3f} | {b:.3f} | {b - a:+.3f} (unpaired) |")
        result[key] = {"step": a, "session": b}
    (args.out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    print("\n".join(lines))
    print(json.dumps(times))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        "python -m bench.learning.sft_forms",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--limit", type=int, default=256, help="validation steps to answer")
    p.add_argument("--forms", default="step,session", help="which to run (comma-separated)")
    p.add_argument("--report", action="store_true", help="the table of a finished --out")
    args = p.parse_args(argv)
    args.out = args.out.resolve()
    if args.report:
        return report(args)
    times_path = args.out / "times.json"
    times = json.loads(times_path.read_text()) if times_path.exists() else {}
    for form in args.forms.split(","):
        if form not in FORMS:
            p.error(f"--forms: {form!r} is not one of {sorted(FORMS)}")
        (args.out / form).mkdir(parents=True, exist_ok=True)
        if not (args.out / form / "model" / "config.json").exists():
            times[f"{form}_sft_s"] = sft(args, form)
        times[f"{form}_eval_s"] = evaluate(args, form)
        times_path.write_text(json.dumps(times, indent=2) + "\n")
    if all((args.out / f / "eval" / "metrics.json").exists() for f in FORMS):
        return report(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
