"""Evaluate the served model on a verifiers environment's held-out tasks.

    python -m env_server.verifiers.evaluate ENV_ID --env-args '{"split": "test"}' \\
        --inference-url http://127.0.0.1:9001 --samples 1 --temperature 0 --out eval.jsonl

Every task of the (bounded) taskset the env args select runs ``--samples`` episodes with the
train client -- the same renderer and token path the training rollouts take -- against the
server as it is now; the env's own rewards score them. One JSON line per episode
(``task``, ``sample``, ``reward``, ``turns``, ``components``, ``error``), then a
``summary`` line (mean reward, its standard error over tasks, solved share). Run it before
and after training on the same tasks and compare the two files task by task
(``python -m env_server.verifiers.evaluate --compare A B``, env_server/verifiers/compare.py).
Runs in the verifiers venv (re-executed there like ``python -m env_server.verifiers``).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from pydantic import Field

from env_server.verifiers.config import VerifiersConfig
from settings import cli

PROG = "python -m env_server.verifiers.evaluate"


class EvalConfig(VerifiersConfig):
    """The service's environment and sampling fields, plus what an evaluation needs (the
    API fields are unused here)."""

    samples: int = Field(1, ge=1)
    """Episodes per task."""
    out: Path = Path("verifiers_eval.jsonl")
    """Where the episodes and the summary go (JSONL, overwritten)."""
    max_tasks: int | None = Field(None, ge=1)
    """Evaluate only the first N tasks of the taskset (its own order)."""
    wait_for_server_s: float = Field(0.0, ge=0)
    """Seconds to wait for the server's ``/health`` after loading the env (0: it must be up).
    The launcher starts the evaluation while vLLM loads."""


def parse(argv: list[str]) -> EvalConfig:
    args = list(argv)
    if args and not args[0].startswith("-"):
        args = ["--env-id", args[0], *args[1:]]
    return cli.parse(EvalConfig, args, prog=PROG, section="verifiers_eval")


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean reward over episodes, its standard error over the per-task means, solved share
    (reward > 0), and how many episodes failed (scored 0, counted)."""
    by_task: dict[str, list[float]] = {}
    for r in rows:
        by_task.setdefault(str(r["task"]), []).append(float(r["reward"]))
    means = [sum(v) / len(v) for v in by_task.values()]
    n = len(means)
    mean = sum(means) / n if n else 0.0
    var = sum((m - mean) ** 2 for m in means) / (n - 1) if n > 1 else 0.0
    return {
        "tasks": n,
        "episodes": len(rows),
        "reward_mean": mean,
        "reward_se": math.sqrt(var / n) if n else 0.0,
        "solved": sum(r["reward"] > 0 for r in rows) / len(rows) if rows else 0.0,
        "turns_mean": sum(r["turns"] for r in rows) / len(rows) if rows else 0.0,
        "failed": sum(r["error"] is not None for r in rows),
    }


async def evaluate(cfg: EvalConfig) -> dict[str, Any]:

    from env_server.verifiers.proxy import RecordingProxy
    from env_server.verifiers.run import load_env, model_context

    env = load_env(cfg)
    if not env.taskset.bounded:
        raise SystemExit(f"error: {cfg.env_id}'s taskset is unbounded; give --max-tasks")
    if cfg.wait_for_server_s > 0:
        from env_server.inference import wait_ready

        await wait_ready(cfg.inference_url, cfg.wait_for_server_s)
    tasks = list(env.taskset)[: cfg.max_tasks]
    # the service's own path to the server (its proxy adapts vLLM's generate answer for
    # verifiers' renderer) and model context; what the proxy records is dropped per episode
    proxy = RecordingProxy(cfg.inference_url, cfg.request_timeout_s)
    await proxy.start()
    ctx = await model_context(cfg, proxy.url)
    gate = asyncio.Semaphore(cfg.concurrency)

    async def one(i: int, task: Any, sample: int) -> dict[str, Any]:
        async with gate:
            ep = await env.run_episode(task, ctx)
        proxy.forget([], older_than_s=0.0)
        traces = [t for t in ep.traces if t.agent.trainable] or list(ep.traces)
        reward = sum(t.reward for t in traces) / len(traces) if traces and ep.ok else 0.0
        err = None
        if not (ep.ok and all(t.ok for t in traces)):
            last = ep.last_error or next((t.last_error for t in traces if t.last_error), None)
            err = f"{last.type}: {last.message[-300:]}" if last is not None else "failed"
        components: dict[str, float] = {}
        for t in traces:
            for k, r in t.rewards.items():
                if r is not None:
                    components[k] = components.get(k, 0.0) + r.value / len(traces)
        turns = sum(len(t.calls) for t in traces) / len(traces) if traces else 0.0
        return {
            "kind": "episode",
            "task": task.data.idx if task.data.idx is not None else i,
            "sample": sample,
            "reward": reward,
            "turns": turns,
            "components": components,
            "error": err,
        }

    try:
        async with env.serving():
            rows = await asyncio.gather(
                *(one(i, t, s) for i, t in enumerate(tasks) for s in range(cfg.samples))
            )
    finally:
        await proxy.stop()
    summary = {"kind": "summary", "env_id": cfg.env_id, **summarize(list(rows))}
    cfg.out.parent.mkdir(parents=True, exist_ok=True)
    with cfg.out.open("w") as f:
        for r in [*rows, summary]:
            f.write(json.dumps(r) + "\n")
    return summary


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--compare"]:
        if len(args) != 3:
            raise SystemExit(f"usage: {PROG} --compare BEFORE.jsonl AFTER.jsonl")
        from env_server.verifiers.compare import compare, read_episodes

        print(json.dumps(compare(read_episodes(Path(args[1])), read_episodes(Path(args[2])))))
        return
    cfg = parse(args)
    from env_server.verifiers.venv import ensure_venv, venv_environ

    py = ensure_venv()
    if os.path.realpath(sys.prefix) != os.path.realpath(py.parent.parent):
        module = "env_server.verifiers.evaluate"
        os.execve(str(py), [str(py), "-m", module, *args], venv_environ())
    print(json.dumps(asyncio.run(evaluate(cfg))))


if __name__ == "__main__":
    main()
