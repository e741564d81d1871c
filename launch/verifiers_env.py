"""The run's verifiers environment (docs/VERIFIERS.md): ``python -m env_server.verifiers``
started by launch/run_all.sh beside Shop-R1's environment, or instead of it
(``--launch.shop-r1-env false``), and its held-out evaluation before and after training
(``launch.verifiers_eval_env_args``), by the same environment and renderer, on the weights
the first vLLM server serves at that moment."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import httpx

from env_server.verifiers.compare import compare, read_episodes, table
from launch.procs import ManagedProcess
from launch.run_config import RunConfig
from launch.supervisor import PY, ServiceFailed

SERVICE = "verifiers"
"""The service's name (= its log, ``<run>/verifiers.log``)."""


def service_argv(config: Path) -> list[str]:
    return [PY, "-m", "env_server.verifiers", "--config", str(config)]


def evaluation_argv(cfg: RunConfig, url: str, out: Path) -> list[str]:
    """The held-out evaluation of the run's verifiers env against ``url``."""
    v, lc = cfg.verifiers, cfg.launch
    assert v is not None and lc.verifiers_eval_env_args is not None
    env_args = {**json.loads(v.env_args or "{}"), **json.loads(lc.verifiers_eval_env_args)}
    argv = [PY, "-m", "env_server.verifiers.evaluate", v.env_id, "--env-args", json.dumps(env_args)]
    argv += ["--inference-url", url, "--samples", str(lc.verifiers_eval_samples)]
    argv += ["--temperature", str(v.temperature), "--max-tokens", str(v.max_tokens)]
    argv += ["--concurrency", str(max(v.concurrency, 4)), "--out", str(out)]
    for name in ("env_config", "renderer", "tokenizer", "model", "sampling"):
        value = getattr(v, name, None)
        if value is not None:
            argv += [f"--{name.replace('_', '-')}", str(value)]
    for path in v.env_path:
        argv += ["--env-path", str(path)]
    return argv


def start_evaluation(
    cfg: RunConfig, url: str, name: str, run_dir: Path, base: Mapping[str, str], wait_s: float = 0
) -> ManagedProcess:
    """Start the held-out evaluation (``eval_verifiers_<name>.jsonl``); with ``wait_s`` it may
    start before the server is up (it loads verifiers and the env meanwhile, then waits for
    ``/health``)."""
    out = run_dir / f"eval_verifiers_{name}.jsonl"
    log = run_dir / f"eval_verifiers_{name}.log"
    print(f"[run_all] verifiers evaluation '{name}' on the held-out tasks -> {out}", flush=True)
    argv = [*evaluation_argv(cfg, url, out), "--wait-for-server-s", f"{wait_s:g}"]
    return ManagedProcess(f"eval_verifiers_{name}", argv, log, base).start()


def finish_evaluation(proc: ManagedProcess) -> Path:
    """Wait for an evaluation :func:`start_evaluation` started; its JSONL file. A failure
    stops the run with the log to read."""
    try:
        rc = proc.popen.wait()
    finally:  # Ctrl-C while it runs: stopped by its PID like every service
        proc.stop()
    if rc != 0:
        name = proc.name.removeprefix("eval_verifiers_")
        raise ServiceFailed(
            f"the verifiers evaluation '{name}' exited with {rc}; read {proc.log_path}"
        )
    return proc.log_path.with_suffix(".jsonl")


def start_before(
    cfg: RunConfig, url: str, run_dir: Path, base: Mapping[str, str], wait_s: float
) -> ManagedProcess | Path | None:
    """The held-out evaluation of the start weights, started while vLLM loads (before any
    env or trainer starts); a ``--resume`` reads back the one it already has (its path);
    None when the run asks for none."""
    if cfg.verifiers is None or cfg.launch.verifiers_eval_env_args is None:
        return None
    done = run_dir / "eval_verifiers_before.jsonl"
    if cfg.launch.resume and done.exists():
        print(f"[run_all] verifiers evaluation: reusing {done} (--resume)", flush=True)
        return done
    return start_evaluation(cfg, url, "before", run_dir, base, wait_s)


def report_after(
    cfg: RunConfig, url: str, run_dir: Path, base: Mapping[str, str], before: Path
) -> str:
    """The held-out evaluation of the trained weights as served, and the before/after table
    (``<run>/eval_verifiers.md``, printed)."""
    after = finish_evaluation(start_evaluation(cfg, url, "after", run_dir, base))
    version = httpx.get(f"{url}/bridge/health", timeout=30).json().get("weight_version")
    v = cfg.verifiers
    assert v is not None
    note = (
        f"{v.env_id} with env args {cfg.launch.verifiers_eval_env_args}, "
        f"{cfg.launch.verifiers_eval_samples} episodes per task at temperature "
        f"{v.temperature}: before = {cfg.model}; after = the trainer's weights as vLLM "
        f"serves them after the last sync (weight version {version})."
    )
    text = table(compare(read_episodes(before), read_episodes(after)), note)
    (run_dir / "eval_verifiers.md").write_text(text)
    print(text, flush=True)
    return text
