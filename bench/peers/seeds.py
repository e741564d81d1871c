"""GRPO against TRL's GRPOTrainer, seed to seed (issue 46, point 5).

Runs ``python -m bench.peers.peer_trl`` once per seed (``--seed S``: both sides' row order,
sampling and training) into ``<out>/seed<S>/`` (``peer.json`` and its ``.md``, the runs in
``work/``), then reports over the finished seeds (``--report`` only reports):

- per seed: samples trained per minute of each side (steps 2..N) and their ratio, each side's
  start-up (launch to step 1), and validation exact match of the start model and of each
  side's last checkpoint, with the paired difference (this stack - TRL) after the same samples
  and after the same wall time; the paper's mean reward of both last checkpoints, with its
  paired difference;
- over the seeds: mean, sample standard deviation and range of the ratio and of the three
  paired differences;
- ``curve.png``: validation exact match against minutes since step 1, both sides, every seed.

Options after ``--`` go to every peer_trl run (its ``--out``, ``--work-dir`` and ``--seed`` are
this bench's), ``{seed}`` in them replaced by the seed (``--trl-result old/seed{seed}/peer.json``
compares each seed with TRL's recorded run of that seed). A seed whose ``peer.json`` exists is
kept, not run again.

  flock /tmp/heavy.lock .venv/bin/python -m bench.peers.seeds --out runs/peer_seeds \\
      --seeds 0 1 2 -- --preset cpu-smol --trl-generation vllm-colocate --trl-micro-batch 8
  python -m bench.peers.seeds --out docs/results/peer_trl_vllm_seeds --report
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.common import finished_seeds, spread

OWN_FLAGS = ("--out", "--work-dir", "--seed")
"""peer_trl options this bench sets for each seed."""


def peer_argv(out: Path, seed: int, extra: Sequence[str]) -> list[str]:
    """The peer_trl command of one seed (``{seed}`` in ``extra`` replaced by it)."""
    clash = [a for a in extra if a.split("=")[0] in OWN_FLAGS]
    if clash:
        raise SystemExit(f"bench.peers.seeds sets {', '.join(OWN_FLAGS)} itself; drop {clash}")
    where = out / f"seed{seed}"
    return [
        sys.executable,
        "-m",
        "bench.peers.peer_trl",
        *(a.replace("{seed}", str(seed)) for a in extra),
        "--seed",
        str(seed),
        "--out",
        str(where / "peer.json"),
        "--work-dir",
        str(where / "work"),
    ]


def run_seed(out: Path, seed: int, extra: Sequence[str]) -> None:
    """One seed's peer_trl run (a child that dies with us), unless its result exists."""
    from launch.procs import ManagedProcess

    where = out / f"seed{seed}"
    if (where / "peer.json").exists():
        print(f"seed {seed}: done before, kept ({where})", flush=True)
        return
    where.mkdir(parents=True, exist_ok=True)
    argv = peer_argv(out, seed, extra)
    print(f"seed {seed}: {shlex.join(argv)}  (log: {where / 'peer_trl.log'})", flush=True)
    proc = ManagedProcess(f"peer_trl seed {seed}", argv, where / "peer_trl.log")
    rc = proc.run_to_exit(stall=3600, limit=24 * 3600)
    if rc != 0:
        raise SystemExit(f"seed {seed}: peer_trl exited {rc}; read {where / 'peer_trl.log'}")


def load(path: Path) -> dict[str, Any]:
    """A peer_trl result (one preset key) with an ``eval`` section."""
    data = json.loads(path.read_text())
    if len(data) != 1:
        raise SystemExit(f"{path}: expected one preset, found {sorted(data)}")
    res = next(iter(data.values()))
    if not res.get("eval"):
        raise SystemExit(f"{path}: no evaluation (was it run with --eval-points 0?)")
    return res


def _comparison(res: Mapping[str, Any], wall: bool) -> dict[str, Any]:
    """The last comparison after the same samples (``wall`` False) or the one after the same
    wall time (``wall`` True: the one with ``wall_s``, bench/peers/evaluate.py)."""
    rows = [c for c in res["eval"]["comparisons"] if ("wall_s" in c) == wall]
    if not rows:
        raise SystemExit(f"no comparison after the same {'wall time' if wall else 'samples'}")
    return rows[-1]


def _percent(d: Mapping[str, Any]) -> dict[str, Any]:
    """A difference of exact-match fractions in points (``paired`` kept as it is)."""
    return {k: 100 * v if k in ("diff", "se") and v is not None else v for k, v in d.items()}


def seed_row(res: Mapping[str, Any]) -> dict[str, Any]:
    """One seed's numbers (see the module docstring); exact match in percent."""
    ours, trl = res["ours"]["rate"], res["trl"]["rate"]
    same, wall = _comparison(res, wall=False), _comparison(res, wall=True)
    return {
        "samples_per_min": {"ours": ours["samples_per_min"], "trl": trl["samples_per_min"]},
        "ratio": ours["samples_per_min"] / trl["samples_per_min"],
        "startup_s": {"ours": res["ours"]["startup_s"], "trl": res["trl"]["startup_s"]},
        "start_exact": 100 * res["eval"]["sft"]["exact"],
        "samples": {"ours": same["samples_ours"], "trl": same["samples_trl"]},
        "exact": {"ours": 100 * same["ours"]["exact"], "trl": 100 * same["trl"]["exact"]},
        "same_samples": _percent(same["diff"]["exact"]),
        "reward": {"ours": same["ours"]["reward"], "trl": same["trl"]["reward"]},
        "reward_same_samples": dict(same["diff"]["reward"]),
        "same_wall": _percent(wall["diff"]["exact"]) | {"point": wall["point"]},
    }


def curve(results: Mapping[int, Mapping[str, Any]], png: Path) -> None:
    """Validation exact match against minutes since step 1: both sides, every seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for seed, res in results.items():
        ev = res["eval"]
        for side, style, name in (("ours", "-o", "this stack"), ("trl", "--s", "TRL")):
            times = ev["elapsed_s"][side]
            pts = sorted(
                (times[str(int(key.rsplit("step", 1)[1]))] / 60, 100 * v["exact"])
                for key, v in ev["points"].items()
                if key.startswith(f"{side}_") or key.startswith("sft_")
            )
            ax.plot(*zip(*pts, strict=True), style, label=f"{name}, seed {seed}")
    ax.set_xlabel("minutes since step 1 (start-up excluded)")
    ax.set_ylabel(
        f"validation exact match, % ({next(iter(results.values()))['eval']['rows']} rows)"
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def _pm(d: Mapping[str, Any]) -> str:
    from bench.peers.report import plus_minus

    return plus_minus(d, digits=1)


def table(rows: Mapping[int, Mapping[str, Any]], summary: Mapping[str, Any]) -> str:
    lines = [
        "| seed | samples / min (ours / TRL) | ratio | start-up s (ours / TRL) | exact: start "
        "-> ours / TRL (samples) | ours - TRL, same samples | ours - TRL, same wall time | "
        "paper's reward, ours / TRL, same samples (diff) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s, r in rows.items():
        sp, st, ex, n = r["samples_per_min"], r["startup_s"], r["exact"], r["samples"]
        lines.append(
            f"| {s} | {sp['ours']:.1f} / {sp['trl']:.1f} | {r['ratio']:.2f}x | "
            f"{st['ours']:.0f} / {st['trl']:.0f} | {r['start_exact']:.1f} -> {ex['ours']:.1f} / "
            f"{ex['trl']:.1f} ({n['ours']} / {n['trl']}) | {_pm(r['same_samples'])} pts | "
            f"{_pm(r['same_wall'])} pts ({r['same_wall']['point']}) | "
            f"{r['reward']['ours']:.1f} / {r['reward']['trl']:.1f} "
            f"({_pm(r['reward_same_samples'])}) |"
        )
    if len(rows) > 1:
        cell = {
            k: f"{v['mean']:+.2f} (sd {v['sd']:.2f}, {v['min']:+.2f} to {v['max']:+.2f})"
            for k, v in summary.items()
        }
        lines.append(
            f"| mean of {len(rows)} | | {summary['ratio']['mean']:.2f}x (sd "
            f"{summary['ratio']['sd']:.2f}, {summary['ratio']['min']:.2f} to "
            f"{summary['ratio']['max']:.2f}) | | | {cell['same_samples']} pts | "
            f"{cell['same_wall']} pts | {cell['reward_same_samples']} |"
        )
    return "\n".join(lines)


def report(out: Path) -> int:
    """``result.json``, ``table.md`` and ``curve.png`` from the finished seeds under ``out``."""
    found = finished_seeds(out, "peer.json")
    if not found:
        raise SystemExit(f"no finished seed under {out} (seed<S>/peer.json)")
    results = {s: load(out / f"seed{s}" / "peer.json") for s in found}
    rows = {s: seed_row(r) for s, r in results.items()}
    summary = {
        "ratio": spread([r["ratio"] for r in rows.values()]),
        "same_samples": spread([r["same_samples"]["diff"] for r in rows.values()]),
        "same_wall": spread([r["same_wall"]["diff"] for r in rows.values()]),
        "reward_same_samples": spread([r["reward_same_samples"]["diff"] for r in rows.values()]),
    }
    text = table(rows, summary)
    first = next(iter(results.values()))
    recorded = [s for s, r in rows.items() if r["same_samples"].get("paired") is False]
    if recorded:  # TRL's side from earlier results, per-row results lost (bench/peers/report.py)
        text += (
            "\n\nTRL's side recorded by earlier runs (--trl-result; seeds "
            f"{', '.join(map(str, recorded))}): ours - TRL unpaired, exact match ± the SE of "
            "two independent proportions, rewards without an SE."
        )
    machine = {s: r["machine"] for s, r in results.items()}
    result = {"seeds": {str(s): r for s, r in rows.items()}, "summary": summary}
    result |= {"machine": machine, "commands": {str(s): r["command"] for s, r in results.items()}}
    result["trl_generation"] = first.get("trl_generation", "transformers")
    (out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "table.md").write_text(text + "\n")
    curve(results, out / "curve.png")
    print(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        "python -m bench.peers.seeds",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--report", action="store_true", help="only the report of the finished seeds")
    p.add_argument("peer_args", nargs="*", help="after --: options for every peer_trl run")
    args = p.parse_args(argv)
    out = args.out.resolve()
    if not args.report:
        for seed in args.seeds:
            run_seed(out, seed, args.peer_args)
    return report(out)


if __name__ == "__main__":
    raise SystemExit(main())
