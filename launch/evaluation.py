"""The evaluations of ``launch/run_all.sh``: ``python -m env_server.evaluate`` on the test
split (``launch.eval_split``) against a vLLM server, once before GRPO (the SFT model) and once
after (the trainer's final weights, :func:`evaluate_rl`, which writes the run's ``eval.md``
with launch/eval_table.py's comparison of the two).

On the CPU a run's evaluations get a server of their own (:func:`evaluation_server`,
``launch.eval_server``): nothing else computes while one runs, so that server has every core,
where the run's servers have their share of the thread plan (on 2 cores: one). Its answers are
the same (fp32 greedy decoding does not depend on the thread count) and come sooner: SmolLM2
answered 128 validation steps in 187 s on 2 cores against 302 s on one
(docs/results/eval_server.md). Both serve in the dtype the trainer computed in
(``launch.eval_dtype``): bf16 on a CPU with native bf16, ~1.5x sooner again. Otherwise (CUDA,
a few steps, ``--eval-server run``) the run's first server answers both, the RL evaluation with
the weights the trainer synced last.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from env_server.config import EnvConfig
from launch.eval_table import eval_table
from launch.follow import eval_source
from launch.procs import ManagedProcess
from launch.run_plan import RUN_DTYPE, RunPlan, own_eval_server, vllm_extra
from launch.supervisor import PY, ServiceFailed, Stack, finish_step, start_step
from launch.threads import light_env

if TYPE_CHECKING:
    from launch.run_config import RunConfig
    from launch.vllm_server import BridgeServer


def final_model(save_path: str | Path, steps: int) -> Path | None:
    """The trainer's weights after its last step (``steps``), servable as they are: its last
    checkpoint's ``model/`` export (the trainer checkpoints its last step whatever
    ``save_every``). None where there is none, or it holds a LoRA adapter (not a whole model)."""
    from trainer.checkpoint_files import checkpoint_step, latest_checkpoint, missing_parts

    last = latest_checkpoint(save_path)
    if last is None or missing_parts(last) or checkpoint_step(last) != steps:
        return None
    model = last / "model"
    return model if (model / "config.json").is_file() else None


@contextmanager
def evaluation_server(
    cfg: RunConfig, plan: RunPlan, vllm_file: Path, stack: Stack, model: str | Path, label: str
) -> Iterator[str]:
    """A vLLM server for one evaluation, ``vllm_eval_<label>``: ``model`` (the run's model's
    tokenizer) in bridge mode none, the run's vLLM file and flags, every core of the launcher
    (``ThreadPlan.alone_server``). Yields its URL; it is stopped after, by its PID."""
    from launch.vllm_server import server_env, spawn_bridge_server

    name = f"vllm_eval_{label}"
    env = server_env(plan.bridge_token, "cpu") | plan.threads.alone_server()
    extra = ["--config", str(vllm_file), *vllm_extra(cfg), "--tokenizer", str(cfg.model)]
    if plan.eval_dtype is not None:  # the last --dtype is vLLM's
        extra += ["--dtype", plan.eval_dtype]
    timeout = cfg.launch.health_timeout
    log = plan.run_dir / f"{name}.log"
    server = spawn_bridge_server(
        model,
        "none",
        log,
        token=plan.bridge_token,
        extra=extra,
        timeout=timeout,
        env=env,
        name=name,
    )
    stack.add(server.proc)
    threads = env.get("OMP_NUM_THREADS", "vLLM's own")
    where = (
        f" on cores {env['VLLM_CPU_OMP_THREADS_BIND']}"
        if "VLLM_CPU_OMP_THREADS_BIND" in env
        else ""
    )
    dtype = f", {plan.eval_dtype}" if plan.eval_dtype else ""
    print(
        f"[run_all] {label.upper()} evaluation on a vLLM server of its own ({name}, pid "
        f"{server.proc.pid}): {threads} thread(s){where}{dtype} (launch.eval_server, "
        "launch.eval_dtype)",
        flush=True,
    )
    try:
        try:
            server.wait(timeout)
        except (RuntimeError, TimeoutError) as e:
            raise ServiceFailed(f"{name} did not come up: {e}") from e
        yield server.base_url
    finally:
        stack.stop(name)


def evaluate(
    label: str,
    vllm_url: str,
    samples: int,
    run_dir: Path,
    env_file: Path,
    split: str = "test",
    dtype: str | None = None,
) -> dict:
    """Evaluate the first ``samples`` steps of ``split`` greedily on ``vllm_url`` into
    ``run_dir/eval_<label>/`` with the rollouts' tokenizer, budgets and dataset (``env_file``:
    the env service's config, ``<run>/config/env.yaml``); return its ``metrics.json``, which
    also names the server's dtype (``dtype``; None: the run's servers')."""
    argv = evaluation_argv(label, vllm_url, samples, run_dir, env_file, split=split)
    return finish_evaluation(start_evaluation(label, run_dir, argv), dtype)


def evaluation_argv(
    label: str,
    vllm_url: str,
    samples: int,
    run_dir: Path,
    env_file: Path,
    wait_s: float = 0,
    split: str = "test",
) -> list[str]:
    """The command line of :func:`evaluate`: with ``wait_s`` it may start before the server
    is up (it loads its libraries, data and tokenizer meanwhile, then waits for ``/health``)."""
    argv = [PY, "-m", "env_server.evaluate", "--env-config", str(env_file)]
    argv += ["--split", split, "--limit", str(samples), "--inference-url", vllm_url]
    return argv + ["--out-dir", str(run_dir / f"eval_{label}"), "--wait-for-server", f"{wait_s:g}"]


def start_evaluation(label: str, run_dir: Path, argv: list[str]) -> ManagedProcess:
    """:func:`evaluate`, started (``argv``: :func:`evaluation_argv`'s): work that overlaps
    another's; :func:`finish_evaluation` waits for it."""
    return start_step(
        f"eval_{label}", argv, run_dir / f"eval_{label}.log", {**os.environ, **light_env()}
    )


def finish_evaluation(proc: ManagedProcess, dtype: str | None = None) -> dict:
    """Wait for an evaluation :func:`start_evaluation` started; its ``metrics.json``, with the
    server's dtype added as ``server_dtype`` (``dtype``; None: :data:`RUN_DTYPE`), so that a
    resumed run and bench.learning.checkpoints pair only evaluations served alike."""
    label = proc.name.removeprefix("eval_")
    finish_step(proc, f"evaluate {label.upper()}", eval_source(proc.log_path))
    return record_server_dtype(proc.log_path.parent / proc.name / "metrics.json", dtype)


def record_server_dtype(path: Path, dtype: str | None) -> dict:
    """An evaluation's ``metrics.json`` (``path``) with its server's dtype added as
    ``server_dtype`` (None: :data:`RUN_DTYPE`), written back; the metrics."""
    metrics = json.loads(path.read_text()) | {"server_dtype": dtype or RUN_DTYPE}
    path.write_text(json.dumps(metrics, indent=2) + "\n")
    return metrics


def served_as(metrics: dict) -> tuple[str, str]:
    """(split, server dtype) of an evaluation's metrics: what it must share with another to
    pair with it (evaluations from before ``server_dtype``: the run's servers')."""
    return metrics.get("split", "test"), metrics.get("server_dtype", RUN_DTYPE)


def pages_table(run_dir: Path, samples: int, env_cfg: EnvConfig, split: str = "test") -> str:
    """Exact match per page kind of the SFT and the RL evaluation on the same rows, and
    the share of results-page clicks that name an element on the page (markdown)."""
    from env_server.data.dataset import load_or_build
    from env_server.evaluate import read_predictions
    from env_server.page_report import compare_pages, what_changed

    rows = load_or_build(Path(env_cfg.data_dir))[split].to_list()[:samples]
    runs = {
        label.upper(): read_predictions(run_dir / f"eval_{label}" / "predictions.jsonl", rows)
        for label in ("sft", "rl")
    }
    changed = what_changed(rows, runs["SFT"], runs["RL"])
    return f"{compare_pages(rows, runs)}\n\nWhat RL changed, per gold action and page:\n\n{changed}"


def eval_samples(cfg: RunConfig) -> int:
    """Test rows of the SFT-vs-RL evaluation: Shop-R1's, none without its env."""
    return cfg.launch.eval_samples if cfg.launch.shop_r1_env else 0


def evaluate_rl(
    cfg: RunConfig,
    plan: RunPlan,
    server: BridgeServer,
    files: dict[str, Path],
    stack: Stack,
    sft: dict[str, Any],
) -> None:
    """The trainer's final weights against the SFT model: eval.md. A server of their own with
    every core loads them from the trainer's last checkpoint (``launch.eval_server``; not a
    LoRA adapter), or ``server`` answers with the weights the trainer synced last."""
    samples, model, save = eval_samples(cfg), cfg.model, cfg.trainer.grpo.save_path
    split, env_file = cfg.launch.eval_split, files["env"]
    health = httpx.get(f"{server.base_url}/bridge/health", timeout=10).json()
    version = f"weight version {health.get('weight_version')}, mode {cfg.weight_bridge_mode}"
    final = final_model(save, cfg.trainer.grpo.training_steps)
    if own_eval_server(cfg, plan.device) and final is not None:
        with evaluation_server(cfg, plan, files["vllm"], stack, final, "rl") as url:
            rl = evaluate("rl", url, samples, plan.run_dir, env_file, split, plan.eval_dtype)
        dtype = f" in {plan.eval_dtype}" if plan.eval_dtype else ""
        how = f"loaded from {final} by an evaluation server{dtype} (the run's servers: {version})"
    else:
        rl = evaluate("rl", server.base_url, samples, plan.run_dir, env_file, split)
        how = f"as served by vLLM after the last sync ({version})"
    note = (
        f"{samples} {split} steps, greedy. SFT = {model}; RL = the trainer's final "
        f"weights ({save}) {how}."
    )
    table = eval_table(sft, rl, note)
    table += "\nPer page kind (`python -m env_server.page_report`):\n\n"
    table += pages_table(plan.run_dir, samples, cfg.env, split) + "\n"
    (plan.run_dir / "eval.md").write_text(table)
    print(table, flush=True)
