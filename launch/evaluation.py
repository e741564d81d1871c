"""The evaluations of ``launch/run_all.sh``: ``python -m env_server.evaluate`` on the test
split (``launch.eval_split``) against a running vLLM server, once before GRPO (the SFT model) and once after (the
trainer's final weights as vLLM serves them). launch/eval_table.py compares the two.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from env_server.config import EnvConfig
from launch.follow import eval_source
from launch.procs import ManagedProcess
from launch.supervisor import PY, finish_step, start_step
from launch.threads import light_env


def evaluate(
    label: str, vllm_url: str, samples: int, run_dir: Path, env_file: Path, split: str = "test"
) -> dict:
    """Evaluate the first ``samples`` steps of ``split`` greedily on ``vllm_url`` into
    ``run_dir/eval_<label>/`` with the rollouts' tokenizer, budgets and dataset (``env_file``:
    the env service's config, ``<run>/config/env.yaml``); return its ``metrics.json``."""
    proc = start_evaluation(label, vllm_url, samples, run_dir, env_file, split=split)
    return finish_evaluation(proc)


def start_evaluation(
    label: str,
    vllm_url: str,
    samples: int,
    run_dir: Path,
    env_file: Path,
    wait_s: float = 0,
    split: str = "test",
) -> ManagedProcess:
    """:func:`evaluate`, started: with ``wait_s`` it may start before the server is up (it
    loads its libraries, data and tokenizer meanwhile, then waits for ``/health``)."""
    argv = evaluation_argv(label, vllm_url, samples, run_dir, env_file, wait_s, split)
    return start_step(
        f"eval_{label}", argv, run_dir / f"eval_{label}.log", {**os.environ, **light_env()}
    )


def evaluation_argv(
    label: str,
    vllm_url: str,
    samples: int,
    run_dir: Path,
    env_file: Path,
    wait_s: float = 0,
    split: str = "test",
) -> list[str]:
    """The command line of :func:`start_evaluation`."""
    argv = [PY, "-m", "env_server.evaluate", "--env-config", str(env_file)]
    argv += ["--split", split, "--limit", str(samples), "--inference-url", vllm_url]
    return argv + ["--out-dir", str(run_dir / f"eval_{label}"), "--wait-for-server", f"{wait_s:g}"]


def finish_evaluation(proc: ManagedProcess) -> dict:
    """Wait for an evaluation :func:`start_evaluation` started; its ``metrics.json``."""
    label = proc.name.removeprefix("eval_")
    finish_step(proc, f"evaluate {label.upper()}", eval_source(proc.log_path))
    return json.loads((proc.log_path.parent / proc.name / "metrics.json").read_text())


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
