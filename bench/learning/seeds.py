"""What does ``make run`` give, seed to seed? (issue 46, point 3)

Runs ``make run`` (its install is a no-op where the venv is there) once per seed, with
``RUN_ARGS="--seed S --run-dir ..."``, each from scratch: its own artifacts folder (``SHOP_R1_ARTIFACTS``), so the SFT cold start
is trained again with that seed, then GRPO, then both evaluations on the 512 held-out test
steps (a study on validation: ``-- --eval-split validation --eval-samples 256``; the table
says which split). ``--seed S`` is every service's seed (the SFT's data order, the GRPO
trainer, the env's row order, vLLM's sampling). The base model and the dataset are the same
bytes for every seed: they are copied from ``--from-artifacts`` when it holds them (else each
run builds them, deterministically), so the rows answered are the same and every RL - SFT is
paired on them.

Writes ``<out>/seed<S>/`` (the run's folder ``run/``, its console ``console.log``; the
artifacts are removed afterwards unless ``--keep-artifacts``), ``<out>/seed<S>/times.json``,
and ``<out>/result.json`` + the table (``--report`` rebuilds both from the files): for each
seed SFT, RL and RL - SFT (paired on the same rows, with its SE), then the mean over the
seeds, their standard deviation and the range. Extra launcher options after ``--``.

``--sft-from DIR`` (``{seed}`` in it is the seed) reuses an SFT model trained before with the
run's SFT settings and that seed (e.g. by a study on the validation split): it is copied in as
the seed's SFT model, so ``make run`` skips its SFT. After the run its settings are compared
with the run's own SFT config (any difference but paths is an error), and the table's time
adds that SFT's training time (its ``metrics.jsonl``) and says so.

  flock /tmp/heavy.lock .venv/bin/python -m bench.learning.seeds --out runs/seeds --seeds 0 1 2
  python -m bench.learning.seeds --out docs/results/make_run_seeds --report
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import REPO, finished_seeds, machine, spread, stop_on_sigterm
from env_server.eval_stats import paired_difference
from settings import paths

PHASE = re.compile(r"^\[run_all\] (?P<phase>.+?) done \|.*\| (?P<t>[\d:]+) elapsed")
"""The launcher's line at the end of a phase: ``[run_all] SFT done | ... | 13:42 elapsed``."""
PAIRED = (("exact", "exact match", 100.0, " pts"), ("reward", "mean reward", 1.0, ""))
UNPAIRED = (("type_accuracy", "type accuracy", 100.0), ("macro_f1", "macro-F1", 100.0))
KEPT = {n: n for n in ("eval.md", "eval_sft", "eval_rl", "reward_curve.png", "config")}
KEPT["trainer/metrics.jsonl"] = "trainer_metrics.jsonl"
KEPT["env_metrics.jsonl"] = "env_metrics.jsonl"  # its groups: bench.learning.trained_groups
"""What of a run's folder is copied beside its console log (as what), the rest left in
``run/`` (its checkpoints, logs and databases)."""


def seconds(clock: str) -> int:
    """``13:42`` or ``1:02:03`` -> seconds."""
    total = 0
    for part in clock.split(":"):
        total = 60 * total + int(part)
    return total


def phase_times(console: str) -> dict[str, int]:
    """Seconds of each phase the launcher reported done (``SFT``, ``GRPO``, evaluations)."""
    times: dict[str, int] = {}
    for line in console.splitlines():
        m = PHASE.match(line.strip())
        if m:
            times[m["phase"]] = seconds(m["t"])
    return times


def seed_artifacts(src: Path, dst: Path) -> None:
    """``dst`` with ``src``'s base model and dataset (when there), never its SFT model."""
    for sub in (paths.TINY_MODEL_DIR, paths.SMOL_MODEL_DIR, paths.DATA_DIR):
        rel = sub.relative_to(paths.ARTIFACTS)
        if (src / rel).is_dir() and not (dst / rel).exists():
            shutil.copytree(src / rel, dst / rel)


SFT_PATH_KEYS = {"model_name", "save_path", "data_dir", "resume", "overwrite"}
"""Trainer settings that name where things are, not what is trained."""


def reuse_sft(src: Path, artifacts: Path) -> dict[str, Any]:
    """Copy the SFT model at ``src`` (its final model, not its checkpoints) in as
    ``artifacts``' SFT model; what the seed's ``times.json`` records of it."""
    if not (src / "model.safetensors").exists():
        raise SystemExit(f"--sft-from: no SFT model at {src}")
    dst = artifacts / paths.SMOL_SFT_MODEL_DIR.relative_to(paths.ARTIFACTS)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("checkpoints"), dirs_exist_ok=True)
    steps = [json.loads(line) for line in (src / "metrics.jsonl").read_text().splitlines()]
    train_s = steps[-1]["time"] - steps[0]["time"] + steps[0]["step_s"]
    return {"from": str(src), "train_s": round(train_s, 1), "steps": len(steps)}


def check_reused_sft(src: Path, run_dir: Path) -> None:
    """The reused SFT model was trained with the run's SFT settings (paths aside)."""
    import yaml

    ran = yaml.safe_load((run_dir / "config" / "trainer_sft.yaml").read_text())["trainer"]["sft"]
    had = json.loads((src / "trainer_config.json").read_text())
    differ = sorted(
        k for k in (ran.keys() | had.keys()) - SFT_PATH_KEYS if ran.get(k) != had.get(k)
    )
    if differ:
        raise SystemExit(
            f"--sft-from {src}: trained with other SFT settings than the run's: "
            + ", ".join(f"{k} {had.get(k)!r} (run: {ran.get(k)!r})" for k in differ)
        )


def keep(out: Path) -> None:
    """Copy what a finished run shows (evaluations, configs, metrics, eval.md) beside its
    console."""
    for name, to in KEPT.items():
        src = out / "run" / name
        if src.is_dir():
            shutil.copytree(src, out / to, dirs_exist_ok=True)
        elif src.exists():
            shutil.copy2(src, out / to)


def run_in_group(argv: list[str], env: dict[str, str], console: Any) -> int:
    """Run ``argv`` (make, then the launcher) in a process group of its own, its exit code.
    Stopped (SIGTERM or Ctrl-C of this bench), the whole group gets SIGINT, so the launcher
    stops its run's services as on Ctrl-C; SIGKILL after two minutes. Killed (SIGKILL), this
    bench's lifeline reaper sends the group SIGTERM (launch/lifeline.py)."""
    from launch.lifeline import lifeline, signal_group

    proc = subprocess.Popen(
        argv, env=env, stdout=console, stderr=subprocess.STDOUT, start_new_session=True
    )
    lifeline().register(proc.pid, "make run", console.name)
    try:
        return proc.wait()
    except BaseException:
        signal_group(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            signal_group(proc.pid, signal.SIGKILL)
            proc.wait()
        raise
    finally:
        lifeline().unregister(proc.pid)


def run_seed(args: argparse.Namespace, seed: int) -> None:
    """One ``make run RUN_ARGS="--seed S ..."`` from scratch into ``<out>/seed<S>``."""
    out = args.out / f"seed{seed}"
    if (out / "eval_rl" / "metrics.json").exists():
        print(f"seed {seed}: done before, kept ({out})", flush=True)
        return
    artifacts, run_dir = out / "artifacts", out / "run"
    if run_dir.exists():  # an unfinished run: started over, never half-reused
        shutil.rmtree(run_dir)
    artifacts.mkdir(parents=True, exist_ok=True)
    seed_artifacts(args.from_artifacts, artifacts)
    reused = None
    if args.sft_from:
        reused = reuse_sft(Path(args.sft_from.format(seed=seed)), artifacts)
    env = {**os.environ, "SHOP_R1_ARTIFACTS": str(artifacts)}
    run_args = ["--seed", str(seed), "--run-dir", str(run_dir), *args.launcher_args]
    argv = ["make", "-s", "-C", str(REPO), "run", f"RUN_ARGS={shlex.join(run_args)}"]
    print(f"seed {seed}: {' '.join(argv)}", flush=True)
    t = time.monotonic()
    with open(out / "console.log", "w") as console:
        rc = run_in_group(argv, env, console)
    wall = time.monotonic() - t
    text = (out / "console.log").read_text(errors="replace")
    times = {"wall_s": round(wall, 1), "phases_s": phase_times(text), "exit": rc}
    times["machine"] = machine()
    if reused:
        times["sft_reused"] = reused
    (out / "times.json").write_text(json.dumps(times, indent=2) + "\n")
    if rc != 0:
        raise SystemExit(f"seed {seed}: make run exited {rc}; see {out}/console.log")
    if reused:
        check_reused_sft(Path(reused["from"]), run_dir)
    keep(out)
    if not args.keep_artifacts:
        shutil.rmtree(artifacts)
    print(f"seed {seed}: done in {wall / 60:.1f} min", flush=True)


def seed_row(out: Path, rows: list[dict] | None = None) -> dict[str, Any]:
    """One seed's SFT, RL and paired RL - SFT from its evaluations; with the rows of the split
    the evaluations answered (:func:`eval_split`), also :func:`action_changes`."""
    sft = json.loads((out / "eval_sft" / "metrics.json").read_text())
    rl = json.loads((out / "eval_rl" / "metrics.json").read_text())
    row: dict[str, Any] = {"rows": sft["n"], "split": eval_split(out)}
    for key, _, scale, _ in PAIRED:
        a, b = sft["per_sample"][key], rl["per_sample"][key]
        d, se = paired_difference(a, b)
        row[key] = {
            "sft": scale * sum(a) / len(a),
            "rl": scale * sum(b) / len(b),
            "diff": scale * d,
            "se": scale * se,
        }
    for key, _, scale in UNPAIRED:
        row[key] = {"sft": scale * sft[key], "rl": scale * rl[key]}
        row[key]["diff"] = row[key]["rl"] - row[key]["sft"]
    times_path = out / "times.json"
    row["times"] = json.loads(times_path.read_text()) if times_path.exists() else {}
    preds = [out / name / "predictions.jsonl" for name in ("eval_sft", "eval_rl")]
    if rows is not None and all(p.exists() for p in preds):
        row["actions"] = action_changes(rows[: sft["n"]], *preds)
    return row


def action_changes(rows: list[dict], sft_preds: Path, rl_preds: Path) -> dict[str, Any]:
    """Where RL gained and lost exact matches, per gold action type (page kinds summed), and
    what each model predicts where the shopper leaves (gold ``terminate``): point 4's
    over-clicking, per seed."""
    from env_server.evaluate import read_predictions
    from env_server.page_report import change_counts

    before, after = read_predictions(sft_preds, rows), read_predictions(rl_preds, rows)
    cells, leaves = change_counts(rows, before, after)
    net: dict[str, int] = {}
    for (kind, _page), c in cells.items():
        net[kind] = net.get(kind, 0) + c["gained"] - c["lost"]
    return {"net_exact_by_gold_type": net, "where_the_shopper_leaves": leaves}


def eval_split(out: Path) -> str:
    """The split both evaluations of a seed answered (``--eval-split``; evaluations written
    before the metrics named it answered the test split)."""
    named = {
        json.loads((out / name / "metrics.json").read_text()).get("split", "test")
        for name in ("eval_sft", "eval_rl")
    }
    if len(named) != 1:
        raise SystemExit(f"{out}: the SFT and the RL evaluation answered different splits {named}")
    return named.pop()


def split_rows(artifacts: Path, split: str) -> list[dict] | None:
    """The rows of ``split`` every seed answered (the dataset the runs copied), if it is there."""
    data = artifacts / paths.DATA_DIR.relative_to(paths.ARTIFACTS)
    if not (data / f"{split}.jsonl").exists():
        return None
    from env_server.data.dataset import load_or_build

    return load_or_build(data)[split].to_list()


def report(args: argparse.Namespace) -> int:
    """``result.json`` and the markdown table from the seeds' folders."""
    seeds = finished_seeds(args.out, "eval_rl/metrics.json")
    if not seeds:
        raise SystemExit(f"no finished seed under {args.out}")
    splits = {eval_split(args.out / f"seed{s}") for s in seeds}
    if len(splits) != 1:
        raise SystemExit(f"{args.out}: the seeds answered different splits {sorted(splits)}")
    split = splits.pop()
    answered = split_rows(args.from_artifacts, split)  # read once: every seed answered these
    rows = {s: seed_row(args.out / f"seed{s}", answered) for s in seeds}
    metrics = [(k, label, unit) for k, label, _, unit in PAIRED]
    metrics += [(k, label, " pts") for k, label, _ in UNPAIRED]
    head = " | ".join(f"{m[1]} SFT -> RL (RL - SFT)" for m in metrics)
    lines = [f"| seed | time | {head} |"]
    lines.append("|---" * (2 + len(metrics)) + "|")
    for s, row in rows.items():
        wall, reused = row["times"].get("wall_s"), row["times"].get("sft_reused")
        when = f"{wall / 60:.0f} min" if wall else "?"
        if wall and reused:
            total = (wall + reused["train_s"]) / 60
            when = f"{total:.0f} min (SFT reused: {reused['train_s'] / 60:.0f} min of it)"
        cells = [str(s), when]
        for key, _, unit in metrics:
            r = row[key]
            se = f" ± {r['se']:.1f}" if "se" in r else ""
            ratio = f", {r['rl'] / r['sft']:.2f}x" if key == "exact" and r["sft"] else ""
            cells.append(f"{r['sft']:.1f} -> {r['rl']:.1f} ({r['diff']:+.1f}{se}{unit}{ratio})")
        lines.append("| " + " | ".join(cells) + " |")
    summary = {key: spread([rows[s][key]["diff"] for s in seeds]) for key, _, _ in metrics}
    cells = [f"mean of {len(seeds)}", ""]
    for key, _, unit in metrics:
        sp = summary[key]
        cells.append(
            f"RL - SFT {sp['mean']:+.1f}{unit} (sd {sp['sd']:.1f}, {sp['min']:+.1f} to "
            f"{sp['max']:+.1f})"
        )
    if len(seeds) > 1:  # one seed has no spread to show
        lines.append("| " + " | ".join(cells) + " |")
    for s, row in rows.items():
        if "actions" in row:
            net = row["actions"]["net_exact_by_gold_type"]
            leaves = row["actions"]["where_the_shopper_leaves"]
            n = sum(leaves["SFT"].values())
            lines.append("")
            lines.append(
                f"Seed {s}: net exact rows gained by RL per gold action: "
                + ", ".join(f"{k} {v:+d}" for k, v in sorted(net.items()))
                + f"; where the shopper leaves ({n} rows) it clicks on {leaves['RL']['click']}"
                f" (SFT {leaves['SFT']['click']})."
            )
    n = {row["rows"] for row in rows.values()}
    lines += [
        "",
        f"Each seed's SFT and RL answered the first {'/'.join(map(str, sorted(n)))}"
        f" steps of the {split} split, greedy; RL - SFT is paired on them.",
    ]
    table = "\n".join(lines)
    result = {"seeds": {str(s): r for s, r in rows.items()}, "rl_minus_sft": summary}
    result["split"] = split
    result["machine"] = machine()
    (args.out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "table.md").write_text(table + "\n")
    print(table)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        "python -m bench.learning.seeds",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument(
        "--from-artifacts",
        type=Path,
        default=paths.ARTIFACTS,
        help="where the base model and the dataset are copied from (default: this checkout's)",
    )
    p.add_argument("--keep-artifacts", action="store_true", help="keep each seed's SFT model")
    p.add_argument(
        "--sft-from",
        help="reuse the SFT model trained before with this seed, e.g. runs/val/sft{seed}",
    )
    p.add_argument("--report", action="store_true", help="the table of the finished seeds")
    p.add_argument("launcher_args", nargs="*", help="after --: more launch/run_all.sh options")
    args = p.parse_args(argv)
    args.out = args.out.resolve()
    if not args.report:
        stop_on_sigterm()
        for seed in args.seeds:
            run_seed(args, seed)
    return report(args)


if __name__ == "__main__":
    sys.exit(main())
