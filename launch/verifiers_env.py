"""The run's verifiers environment (docs/VERIFIERS.md): ``python -m env_server.verifiers``
started by launch/run_all.sh beside Shop-R1's environment, or instead of it
(``--launch.shop-r1-env false``), and its held-out evaluation before and after training
(``launch.verifiers_eval_env_args``), by the same environment and renderer, on the weights
the first vLLM server serves at that moment."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx

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


def evaluate(cfg: RunConfig, url: str, name: str, run_dir: Path, base: Mapping[str, str]) -> Path:
    """Run the held-out evaluation now (``eval_verifiers_<name>.jsonl``); a failure stops the
    run with the log to read."""
    out = run_dir / f"eval_verifiers_{name}.jsonl"
    log = run_dir / f"eval_verifiers_{name}.log"
    print(f"[run_all] verifiers evaluation '{name}' on the held-out tasks -> {out}", flush=True)
    proc = ManagedProcess(f"eval_verifiers_{name}", evaluation_argv(cfg, url, out), log, base)
    try:
        rc = proc.start().popen.wait()
    finally:  # Ctrl-C while it runs: stopped by its PID like every service
        proc.stop()
    if rc != 0:
        raise ServiceFailed(f"the verifiers evaluation '{name}' exited with {rc}; read {log}")
    return out


def _episodes(path: Path) -> list[dict[str, Any]]:
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return [r for r in rows if r.get("kind") == "episode"]


def compare(before: Path, after: Path) -> dict[str, Any]:
    """After - before on the held-out episodes: mean reward and solved share, each with the
    standard error of the difference of two independent samples of episodes (every episode
    samples its own turns), and the mean model turns."""
    a, b = _episodes(before), _episodes(after)
    if len(a) < 2 or len(b) < 2:
        raise ValueError(f"need at least 2 episodes a side, got {len(a)} and {len(b)}")
    out: dict[str, Any] = {"episodes": [len(a), len(b)]}
    for key, value in (("reward", lambda r: float(r["reward"])), ("solved", _solved)):
        xs, ys = [value(r) for r in a], [value(r) for r in b]
        (m0, v0), (m1, v1) = _mean_var(xs), _mean_var(ys)
        se = math.sqrt(v0 / len(xs) + v1 / len(ys))
        diff = m1 - m0
        out[key] = {"before": m0, "after": m1, "difference": diff, "se": se}
        out[key]["z"] = diff / se if se > 0 else 0.0
    out["turns"] = {"before": _mean_var([r["turns"] for r in a])[0]}
    out["turns"]["after"] = _mean_var([r["turns"] for r in b])[0]
    out["failed"] = [sum(r["error"] is not None for r in rows) for rows in (a, b)]
    return out


def _solved(row: Mapping[str, Any]) -> float:
    return float(row["reward"] > 0)


def _mean_var(xs: list[float]) -> tuple[float, float]:
    m = sum(xs) / len(xs)
    return m, sum((x - m) ** 2 for x in xs) / max(1, len(xs) - 1)


def table(result: Mapping[str, Any], note: str) -> str:
    """The before/after table in Markdown."""
    lines = [
        "| held-out | before | after | after - before | SE | z |",
        "|---|---|---|---|---|---|",
    ]
    for key, label in (("reward", "mean episode reward"), ("solved", "solved share")):
        r = result[key]
        lines.append(
            f"| {label} | {r['before']:.3f} | {r['after']:.3f} | {r['difference']:+.3f} "
            f"| {r['se']:.3f} | {r['z']:+.1f} |"
        )
    t = result["turns"]
    lines.append(f"| model turns per episode | {t['before']:.2f} | {t['after']:.2f} | | | |")
    n0, n1 = result["episodes"]
    return "\n".join(lines) + f"\n\n{n0} / {n1} episodes. {note}\n"


def evaluate_before(
    cfg: RunConfig, url: str, run_dir: Path, base: Mapping[str, str]
) -> Path | None:
    """The held-out evaluation of the start weights, before any env or trainer starts (a
    ``--resume`` reads back the one it already has); None when the run asks for none."""
    if cfg.verifiers is None or cfg.launch.verifiers_eval_env_args is None:
        return None
    done = run_dir / "eval_verifiers_before.jsonl"
    if cfg.launch.resume and done.exists():
        print(f"[run_all] verifiers evaluation: reusing {done} (--resume)", flush=True)
        return done
    return evaluate(cfg, url, "before", run_dir, base)


def report_after(
    cfg: RunConfig, url: str, run_dir: Path, base: Mapping[str, str], before: Path
) -> str:
    """The held-out evaluation of the trained weights as served, and the before/after table
    (``<run>/eval_verifiers.md``, printed)."""
    after = evaluate(cfg, url, "after", run_dir, base)
    version = httpx.get(f"{url}/bridge/health", timeout=30).json().get("weight_version")
    v = cfg.verifiers
    assert v is not None
    note = (
        f"{v.env_id} with env args {cfg.launch.verifiers_eval_env_args}, "
        f"{cfg.launch.verifiers_eval_samples} episodes per task at temperature "
        f"{v.temperature}: before = {cfg.model}; after = the trainer's weights as vLLM "
        f"serves them after the last sync (weight version {version})."
    )
    text = table(compare(before, after), note)
    (run_dir / "eval_verifiers.md").write_text(text)
    print(text, flush=True)
    return text
