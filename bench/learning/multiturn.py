"""Does GRPO learn a multi-turn game through this stack? (issue 45 point 5)

    flock /tmp/heavy.lock .venv/bin/python -m bench.learning.multiturn --seed 0 \\
        --out runs/multiturn/seed0 [--steps 30] [--eval-samples 16] [--eval-only]

The unchanged atroposlib env ``examples/atropos_envs/guess_number.py`` (secret in 1..20, up
to 6 guesses, "Higher"/"Lower" replies, every episode one ``ManagedServer`` conversation in
the env's own process) against the stack's own services: the API, a patched vLLM server
(``shared_vllm``) and the GRPO trainer, SmolLM2-135M-Instruct from the instruct model itself.

1. the held-out secrets (5, 10, 15, 20) played ``--eval-samples`` times each by the start
   weights (atroposlib's ``evaluate`` command, the env's own ``evaluate``);
2. ``--steps`` GRPO steps of ``--batch`` episodes (groups of ``--group``, one secret each)
   while the env serves rollouts, each step synced into vLLM;
3. the held-out secrets again, on the weights vLLM serves after the last sync.

Writes into ``--out``: each service's log, the trainer's ``metrics.jsonl``, both
evaluations' ``samples.jsonl``, and ``result.json`` (the before/after comparison stratified by
secret, env_server/verifiers/compare.py; phase times; the machine). Threads as
launch/run_all.sh plans them (launch/threads.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from bench.api.servers import ensure_atropos
from bench.common import REPO, machine, model_dir
from env_server.verifiers.compare import compare, read_episodes, table
from launch.procs import ManagedProcess, tail
from launch.threads import available_cores, plan_threads
from launch.vllm_server import cpu_env, start_bridge_server
from settings.ports import free_port

ENV_SCRIPT = REPO / "examples" / "atropos_envs" / "guess_number.py"
TOKEN = "multiturn-learning"
SERVED = "smol"


def env_config(args: argparse.Namespace, api_url: str, vllm_url: str, evals: Path) -> dict:
    model = str(model_dir("smol"))
    return {
        "env": {
            "rollout_server_url": api_url,
            "tokenizer_name": model,
            "group_size": args.group,
            "max_token_length": args.max_tokens,  # tokens per model turn
            "temperature": args.temperature,
            "eval_samples": args.eval_samples,
            "seed": args.seed,
            "total_steps": 100_000,  # served until stopped: the trainer decides the steps
            "steps_per_eval": 100_000,  # evaluated apart, before and after
            "max_batches_offpolicy": 1,
            "use_wandb": False,
            "wandb_name": "guess_number",
            "data_dir_to_save_evals": str(evals),
        },
        "openai": {
            "base_url": vllm_url + "/v1",
            "api_key": "x",  # atroposlib's client needs one; the server has no --api-key
            "model_name": SERVED,
            "tokenizer_name": model,
            "server_type": "vllm",
            "timeout": 1200,
        },
    }


def evaluate(py: Path, args: argparse.Namespace, urls: tuple[str, str], name: str) -> Path:
    """The env's held-out evaluation on what vLLM serves now; its ``samples.jsonl``."""
    out = args.out / f"eval_{name}"
    cfg = args.out / f"env_eval_{name}.yaml"
    cfg.write_text(yaml.safe_dump(env_config(args, *urls, out)))
    argv = [str(py), str(ENV_SCRIPT), "evaluate", "--config", str(cfg)]
    proc = ManagedProcess(f"eval_{name}", argv, args.out / f"eval_{name}.log", env=args.light)
    rc = proc.run_to_exit(stall=1800, limit=3600)
    if rc != 0 or not (out / "samples.jsonl").exists():
        raise SystemExit(f"evaluation {name} failed ({rc}):\n{tail(proc.log_path)}")
    return out / "samples.jsonl"


def trainer_argv(args: argparse.Namespace, api_url: str, vllm_url: str) -> list[str]:
    return [
        sys.executable,
        *("-m", "trainer", "grpo", "--model-name", str(model_dir("smol"))),
        *("--save-path", str(args.out / "trainer"), "--api-url", api_url),
        *("--weight-bridge-mode", "shared_vllm", "--inference-url", vllm_url),
        *("--bridge-token", TOKEN, "--device", "cpu", "--precision", "auto"),
        *("--training-steps", str(args.steps), "--batch-size", str(args.batch)),
        *("--lr", str(args.lr), "--kl-beta", "0", "--temperature", str(args.temperature)),
        *("--seed", str(args.seed), "--lease-seconds", "1800", "--wait-timeout", "1800"),
        *("--save-every", str(args.steps), "--keep-checkpoints", "1", "--no-tensorboard"),
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        "python -m bench.learning.multiturn",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--eval-samples", type=int, default=16)
    p.add_argument("--eval-only", action="store_true", help="the start weights' evaluation only")
    p.add_argument("--report", action="store_true", help="result.json of a finished --out")
    args = p.parse_args(argv)
    args.out = args.out.resolve()
    if args.report:
        times = args.out / "times.json"
        return report(args, json.loads(times.read_text()) if times.exists() else {})
    args.out.mkdir(parents=True, exist_ok=True)
    plan = plan_threads(available_cores(), 1)
    print(f"[multiturn] {plan.describe()}", flush=True)
    args.light = {**os.environ, **plan.light_env, "HF_HUB_OFFLINE": "1"}
    py = ensure_atropos()
    times: dict[str, float] = {}
    procs: list[ManagedProcess] = []
    vllm = None
    t0 = time.monotonic()
    try:
        api_port = free_port()
        api_url = f"http://127.0.0.1:{api_port}"
        api_argv = [sys.executable, "-m", "api", "--port", str(api_port)]
        api_argv += ["--db-path", str(args.out / "api.sqlite")]
        api = ManagedProcess("api", api_argv, args.out / "api.log", env=args.light)
        procs.append(api.start())
        api.wait_http(api_url + "/health", timeout=300)
        vllm = start_bridge_server(
            model_dir("smol"),
            "shared_vllm",
            args.out / "vllm.log",
            token=TOKEN,
            served_model_name=SERVED,
            env={**cpu_env(TOKEN), **plan.for_server(0)},
            timeout=1800,
        )
        urls = (api_url, vllm.base_url)
        times["start_s"] = time.monotonic() - t0
        t = time.monotonic()
        evaluate(py, args, urls, "before")
        times["eval_before_s"] = time.monotonic() - t
        if args.eval_only:
            rows = read_episodes(args.out / "eval_before" / "samples.jsonl")
            print(json.dumps(compare(rows, rows)["reward"]))
            return 0
        t = time.monotonic()
        trainer_env = {**os.environ, **plan.trainer_env}
        trainer = ManagedProcess(
            "trainer", trainer_argv(args, *urls), args.out / "trainer.log", env=trainer_env
        )
        procs.append(trainer.start())
        cfg = args.out / "env_serve.yaml"
        cfg.write_text(yaml.safe_dump(env_config(args, *urls, args.out / "eval_serve")))
        serve = [str(py), str(ENV_SCRIPT), "serve", "--config", str(cfg)]
        env = ManagedProcess("env", serve, args.out / "env.log", env=args.light)
        procs.append(env.start())
        rc = trainer.wait_exit(stall=1800, limit=4 * 3600)
        if rc != 0:
            raise SystemExit(f"the trainer exited {rc}:\n{tail(trainer.log_path)}")
        times["train_s"] = time.monotonic() - t
        env.stop()
        t = time.monotonic()
        evaluate(py, args, urls, "after")
        times["eval_after_s"] = time.monotonic() - t
        (args.out / "times.json").write_text(json.dumps(times) + "\n")
    finally:
        for proc in reversed(procs):
            proc.stop()
        if vllm is not None:
            vllm.stop()
    return report(args, times)


def report(args: argparse.Namespace, times: dict[str, float]) -> int:
    """``result.json`` and the before/after table from the run's files."""
    before = args.out / "eval_before" / "samples.jsonl"
    after = args.out / "eval_after" / "samples.jsonl"
    result = compare(read_episodes(before), read_episodes(after))
    metrics = (args.out / "trainer" / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(x) for x in metrics if x.strip()]
    report: dict[str, Any] = {
        "args": {k: v for k, v in vars(args).items() if k not in ("light", "out")},
        "comparison": result,
        "times": times,
        "steps": [
            {
                k: s.get(k)
                for k in (
                    "step",
                    "score_mean",
                    "turns_mean",
                    "tokens",
                    "wait_s",
                    "step_s",
                    "sync_s",
                )
            }
            for s in steps
        ],
        "machine": machine(),
    }
    (args.out / "result.json").write_text(json.dumps(report, indent=2) + "\n")
    note = f"seed {args.seed}, {args.steps} steps of {args.batch} episodes."
    print(table(result, note), flush=True)
    print(json.dumps(times), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
