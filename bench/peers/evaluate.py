"""The evaluations of ``bench/peers/peer_trl.py``: every checkpoint of both sides (and the start
model) greedily on the same validation rows, by ``python -m env_server.evaluate`` against one
patched vLLM server (the stack's own evaluation path, launch/evaluation.py, on the validation
split instead of the test split).

The server starts once, in bridge mode ``none``, on the start model; each checkpoint is then
loaded into it in place (``POST /bridge/reload``: paused, weights applied, prefix cache
dropped, new version) before its rows are asked. Both sides are read by the same engine,
with the same prompts, budget and greedy decoding, so their per-row results pair up.
A checkpoint whose ``metrics.json`` is already there is not evaluated again (``redo`` does).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bench.peers.settings import Plan
    from env_server.config import EnvConfig


@dataclass(frozen=True)
class Point:
    """A model to evaluate: ``side`` (sft, ours, trl) after ``step`` optimizer steps."""

    side: str
    step: int
    path: Path | None
    """Weights folder (safetensors); None: the start model the server was started on."""

    @property
    def label(self) -> str:
        return f"{self.side}_step{self.step:06d}"


def ours_checkpoints(run_dir: Path) -> dict[int, Path]:
    """``{step: weights folder}`` of our trainer's checkpoints in a run_all run directory."""
    out = {}
    for d in sorted((run_dir / "trainer" / "checkpoints").glob("step_*")):
        if (d / "model").is_dir() and re.fullmatch(r"step_\d+", d.name):
            out[int(d.name[5:])] = d / "model"
    return out


def trl_checkpoints(out_dir: Path) -> dict[int, Path]:
    """``{step: weights folder}`` of TRL's ``checkpoint-N`` folders."""
    out = {}
    for d in sorted(out_dir.glob("checkpoint-*")):
        if re.fullmatch(r"checkpoint-\d+", d.name) and any(d.glob("*.safetensors")):
            out[int(d.name.split("-")[1])] = d
    return out


def eval_argv(env: EnvConfig, url: str, tokenizer: str, rows: int, out: Path) -> list[str]:
    """``python -m env_server.evaluate`` on the first ``rows`` validation rows, with the
    rollouts' prompt and completion budgets (as launch/evaluation.py does for the test split)."""
    argv = [
        sys.executable,
        "-m",
        "env_server.evaluate",
        "--split",
        "validation",
        "--limit",
        str(rows),
        "--inference-url",
        url,
        "--data-dir",
        str(env.data_dir),
        "--tokenizer",
        tokenizer,
        "--max-prompt-tokens",
        str(env.max_prompt_tokens),
        "--max-tokens",
        str(env.max_tokens),
        "--out-dir",
        str(out),
    ]
    if env.num_sessions is not None:
        argv += ["--num-sessions", str(env.num_sessions)]
    if env.latest_only:
        argv.append("--latest-only")
    return argv


def evaluate_points(
    points: Sequence[Point],
    model: str,
    env: EnvConfig,
    rows: int,
    work: Path,
    vllm_config: Path,
    redo: bool = False,
) -> dict[str, dict[str, Any]]:
    """``{label: metrics.json}`` of every point (see the module docstring)."""
    import httpx

    from launch.procs import ManagedProcess
    from launch.threads import available_cores, light_env
    from launch.vllm_server import cpu_env, spawn_bridge_server
    from vllm_patching.protocol import TOKEN_HEADER

    work.mkdir(parents=True, exist_ok=True)
    todo = [p for p in points if redo or not (work / p.label / "metrics.json").exists()]
    if todo:
        token = secrets.token_hex(16)
        env_vars = cpu_env(token)
        if "OMP_NUM_THREADS" not in os.environ:  # nothing else runs now: every core
            env_vars |= {"OMP_NUM_THREADS": str(len(available_cores()))}
            env_vars |= {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}
        server = spawn_bridge_server(
            model,
            "none",
            work / "vllm.log",
            token=token,
            extra=["--config", str(vllm_config)],
            env=env_vars,
            name="eval-vllm",
        )
        try:
            server.wait(900)
            http = httpx.Client(base_url=server.base_url, headers={TOKEN_HEADER: token})
            version = 0
            for p in sorted(todo, key=lambda p: p.path is not None):  # the start model first
                served = "start model"
                if p.path is not None:
                    version += 1
                    r = http.post(
                        "/bridge/reload",
                        json={"path": str(p.path.resolve()), "version": version},
                        timeout=900,
                    )
                    r.raise_for_status()
                    served = f"version {r.json()['weight_version']} from {p.path}"
                elif version:
                    raise ValueError("the start model must be evaluated before any reload")
                out = work / p.label
                print(f"[peer_trl] evaluating {p.label} ({served}) on {rows} rows", flush=True)
                log = work / f"{p.label}.log"
                rc = ManagedProcess(
                    f"eval-{p.label}",
                    eval_argv(env, server.base_url, model, rows, out),
                    log,
                    env={**os.environ, **light_env()},
                ).run_to_exit(stall=1800, limit=6 * 3600)
                if rc != 0:
                    raise RuntimeError(f"evaluation of {p.label} failed; read {log}")
        finally:
            server.stop()
    return {p.label: json.loads((work / p.label / "metrics.json").read_text()) for p in points}


def vectors(
    plan: Plan, points: Sequence[Point], rows: int, out: Path, redo: bool = False
) -> dict[str, dict[str, list]]:
    """``{label: per-row vectors}`` of ``points`` evaluated into ``out`` (see
    :func:`evaluate_points`): exact match, the paper's reward, the trained reward."""
    from bench.peers.report import per_sample, train_rewards
    from bench.peers.settings import write_vllm

    metrics = evaluate_points(points, plan.model, plan.env, rows, out, write_vllm(plan, out), redo)
    val = validation_rows(plan.env, rows)
    reward = plan.env.reward_config()
    return {
        p.label: per_sample(
            metrics[p.label], train_rewards(out / p.label / "predictions.jsonl", val, reward)
        )
        for p in points
    }


def check_start(plan: Plan, work: Path, recorded: Mapping[str, Any], rows: int) -> None:
    """Before any training: the start model evaluated (kept for :func:`evaluate_sides`) and
    checked against a recorded TRL side's (:func:`same_start`)."""
    from bench.peers.report import summary_of

    start = vectors(plan, [Point("sft", 0, None)], rows, work / "eval")["sft_step000000"]
    same_start(recorded, rows, summary_of(start))


def recorded_steps(recorded: Mapping[str, Any]) -> dict[int, None]:
    """The steps of TRL's checkpoints an earlier result evaluated (its ``eval.points``)."""
    return {
        int(k.rsplit("step", 1)[1]): None for k in recorded["points"] if k.startswith("trl_step")
    }


def same_start(recorded: Mapping[str, Any], rows: int, start: Mapping[str, float]) -> None:
    """Refuse a recorded TRL side unless its evaluation had the same rows and the start model
    evaluated there exactly as here (greedy: the same model gives the same answers)."""
    was = recorded["points"]["sft_step000000"]
    if recorded["rows"] != rows or any(abs(was[k] - start[k]) > 1e-9 for k in ("exact", "reward")):
        raise SystemExit(
            f"--trl-result: its start model scored exact {was['exact']:.4f}, reward "
            f"{was['reward']:.4f} on {recorded['rows']} validation rows; here it scored "
            f"{start['exact']:.4f}, {start['reward']:.4f} on {rows}: not the same start model "
            "or rows, so the recorded TRL side cannot be compared with this run"
        )


def validation_rows(env: EnvConfig, rows: int) -> list[dict[str, Any]]:
    """The rows ``env_server.evaluate --split validation --limit rows`` evaluates."""
    from env_server.data.dataset import load_or_build

    return load_or_build(env.data_dir, env.num_sessions)["validation"].to_list()[:rows]


def evaluate_sides(
    plan: Plan,
    work: Path,
    ours: dict[str, Any],
    trl: dict[str, Any],
    rows: int,
    redo: bool = False,
    ran: Sequence[str] = (),
    recorded: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Evaluate the start model and every checkpoint both sides saved, then compare them
    after the same samples and after the same wall time (bench/peers/peer_trl.py's docstring).
    ``recorded``: TRL's side is an earlier result's ``eval`` (``--trl-result``): its
    checkpoints are not evaluated again, the start model must evaluate as it did there (the
    same model on the same rows), and the comparisons are paired where it kept its per-row
    results (``per_row``), unpaired on its means where not."""
    import shutil

    from bench.peers.report import (
        at_wall_time,
        compare,
        elapsed,
        summary_of,
        unpaired,
    )

    out = work / "eval"
    for side in ran:  # that side's checkpoints are new: its old evaluations are stale
        for d in out.glob(f"{side}_step*"):
            shutil.rmtree(d) if d.is_dir() else d.unlink()
    ck = {"ours": ours_checkpoints(work / "ours")}
    ck["trl"] = trl_checkpoints(work / "trl") if recorded is None else recorded_steps(recorded)
    saved = sorted(set(ck["ours"]) & set(ck["trl"]))
    if not saved or saved[-1] != plan.steps:
        raise RuntimeError(f"checkpoints ours {sorted(ck['ours'])}, TRL {sorted(ck['trl'])}")
    sides = ("ours",) if recorded is not None else ("ours", "trl")
    points = [Point("sft", 0, None)]
    points += [Point(side, s, ck[side][s]) for side in sides for s in saved]
    vec = vectors(plan, points, rows, out, redo)
    points_out = {k: summary_of(v) for k, v in vec.items()}
    if recorded is not None:
        same_start(recorded, rows, points_out["sft_step000000"])
        points_out |= {k: v for k, v in recorded["points"].items() if k.startswith("trl_")}
        kept = recorded.get("per_row", {})  # where kept: paired
        vec |= {k: v for k, v in kept.items() if k.startswith("trl_")}

    def at(side: str, step: int) -> dict[str, list]:
        return vec[Point("sft" if step == 0 else side, step, None).label]

    def versus(so: int, st: int) -> dict[str, Any]:
        """ours after ``so`` steps against TRL after ``st`` (TRL's step 0: the start model)."""
        o = at("ours", so)
        if recorded is None or st == 0 or Point("trl", st, None).label in vec:
            t = at("trl", st)
            return {"ours": summary_of(o), "trl": summary_of(t), "diff": compare(t, o)}
        t = points_out[Point("trl", st, None).label]
        return {"ours": summary_of(o), "trl": t, "diff": unpaired(t, o)}

    b = plan.batch_size
    comparisons = []
    for s in saved:
        comparisons.append(
            {"point": f"{s * b} samples", "samples_ours": s * b, "samples_trl": s * b}
            | versus(s, s)
        )
    trl_times = (
        elapsed(trl["timeline"])
        if recorded is None
        else {int(k): v for k, v in recorded["elapsed_s"]["trl"].items()}
    )
    times = {"ours": elapsed(ours["timeline"]), "trl": trl_times}
    wall = min(times["ours"][plan.steps], times["trl"][plan.steps])
    so, st = (at_wall_time(times[side], saved, wall) for side in ("ours", "trl"))
    comparisons.append(
        {
            "point": f"{wall / 60:.1f} min of training",
            "wall_s": wall,
            "samples_ours": so * b,
            "samples_trl": st * b,
        }
        | versus(so, st)
    )
    return {
        "rows": rows,
        "split": "validation",
        "sft": points_out["sft_step000000"],
        "points": points_out,
        "elapsed_s": {side: {str(k): v for k, v in t.items()} for side, t in times.items()},
        "comparisons": comparisons,
        "per_row": vec,  # each point's per-row vectors, so a later --trl-result pairs with them
    }
