"""Trainer step-time breakdown (waiting for data / compute / checkpoint / sync), synchronous
vs asynchronous, on the real four-service stack.

    flock /tmp/heavy.lock .venv/bin/python -m bench.trainer.breakdown [--staleness 0,1,2]
        [--steps 10] [--model tiny] [--group-size 4] [--batch-groups 2] [--max-tokens 96]

For each ``max_staleness`` value: start the batching API with ``--max-staleness S``, a
patched vLLM server (shared_vllm, CPU), the Shop-R1 environment service and the GRPO trainer
(``--weight-bridge-mode shared_vllm``), exactly as ``launch/run_all.sh`` wires them (cpu-tiny
preset: group size 4, 2 groups per batch, 96 completion tokens), run ``--steps`` steps and read
the trainer's ``metrics.jsonl`` (``wait_s``, ``step_s``, ``checkpoint_s``, ``sync_s`` per step).

- ``S = 0`` is the synchronous mode: the API drops every group sampled by an older policy than
  the live one, so each step trains only on completions of the newest weights and the trainer
  waits for them to be generated after each sync.
- ``S = 1, 2`` are asynchronous: the env samples the next batches while the trainer steps, and
  the trainer may train on completions up to S versions old (the API drops older ones).

The first step is reported apart (it waits for vLLM's first rollouts in every mode). The env
keeps its default concurrency (4 prompts in flight). Results are merged into
docs/results/trainer_breakdown.json under ``<model>/s<S>``; the API's final ``/status``
(groups dropped as stale) is kept too.
"""

from __future__ import annotations

import argparse
import json
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.common import (
    MODEL_SIZES,
    RESULTS,
    count_params,
    machine,
    model_dir,
    parse_list,
    stop_on_sigterm,
    write_result,
)

PARTS = ("wait_s", "step_s", "checkpoint_s", "sync_s")


def breakdown(rows: list[dict]) -> dict[str, float]:
    """Totals and fractions of each part over the given steps (fractions of their sum)."""
    totals = {p: sum(float(r[p]) for r in rows) for p in PARTS}
    wall = sum(totals.values())
    out: dict[str, float] = {"steps": len(rows), "wall_s": wall}
    for p in PARTS:
        out[p] = totals[p]
        out[p.replace("_s", "_frac")] = totals[p] / wall if wall else 0.0
    out["step_time_median_s"] = statistics.median(sum(float(r[p]) for p in PARTS) for r in rows)
    out["staleness_mean"] = statistics.mean(float(r.get("staleness_mean", 0.0)) for r in rows)
    return out


def run_one(staleness: int, mdir: Path, args: argparse.Namespace, work: Path) -> dict:
    import httpx

    from launch.procs import ManagedProcess
    from launch.vllm_server import start_bridge_server
    from settings.paths import DATA_DIR
    from settings.ports import free_port

    py = sys.executable
    run = work / f"s{staleness}"
    token = secrets.token_hex(8)
    api_port = free_port()
    api_url = f"http://127.0.0.1:{api_port}"
    procs: list[ManagedProcess] = []
    server = None
    try:
        api = ManagedProcess(
            "api",
            [
                py,
                "-m",
                "api",
                "--port",
                str(api_port),
                "--db-path",
                str(run / "api.sqlite"),
                "--max-staleness",
                str(staleness),
                "--log-level",
                "warning",
            ],
            run / "api.log",
        ).start()
        procs.append(api)
        api.wait_http(api_url + "/health", timeout=60)
        server = start_bridge_server(mdir, "shared_vllm", run / "vllm.log", token=token)
        env = ManagedProcess(
            "env",
            [
                py,
                "-m",
                "env_server",
                "--api-url",
                api_url,
                "--inference-url",
                server.base_url,
                "--tokenizer",
                str(mdir),
                "--data-dir",
                str(DATA_DIR),
                "--group-size",
                str(args.group_size),
                "--max-tokens",
                str(args.max_tokens),
                "--no-drop-constant-groups",
                "--log-every-s",
                "10",
            ],
            run / "env.log",
        ).start()
        procs.append(env)
        batch = args.group_size * args.batch_groups
        trainer = ManagedProcess(
            "trainer",
            [
                py,
                "-m",
                "trainer",
                "grpo",
                "--model-name",
                str(mdir),
                "--save-path",
                str(run / "trainer"),
                "--api-url",
                api_url,
                "--weight-bridge-mode",
                "shared_vllm",
                "--inference-url",
                server.base_url,
                "--bridge-token",
                token,
                "--device",
                "cpu",
                "--training-steps",
                str(args.steps),
                "--batch-size",
                str(batch),
                "--lr",
                "5e-5",
                "--no-tensorboard",
                "--overwrite",
                "--wait-timeout",
                "900",
            ],
            run / "trainer.log",
        ).start()
        procs.append(trainer)
        t0 = time.monotonic()
        truncated = False
        while trainer.alive():
            for p in (api, env, server.proc):
                if not p.alive():
                    raise RuntimeError(f"{p.name} died; read {p.log_path}")
            if time.monotonic() - t0 > args.run_timeout:  # keep what was measured so far
                truncated = True
                trainer.stop()
                break
            time.sleep(1.0)
        wall = time.monotonic() - t0
        if not truncated and trainer.popen.returncode != 0:
            raise RuntimeError(
                f"trainer exited {trainer.popen.returncode}; read {trainer.log_path}"
            )
        status = httpx.get(api_url + "/status", timeout=30).json()
    finally:
        for p in reversed(procs):
            p.stop()
        if server is not None:
            server.stop()
    rows = [json.loads(x) for x in (run / "trainer" / "metrics.jsonl").read_text().splitlines()]
    if len(rows) < 2:
        raise RuntimeError(
            f"only {len(rows)} steps in {args.run_timeout:.0f}s; raise --run-timeout"
        )
    dropped = sum(int(e["dropped_groups"]) for e in status["envs"])
    return {
        "max_staleness": staleness,
        "model": args.model,
        "params": count_params(mdir),
        "group_size": args.group_size,
        "batch_sequences": batch,
        "max_tokens": args.max_tokens,
        "trainer_process_wall_s": wall,
        "truncated": truncated,
        "first_step": breakdown(rows[:1]),
        "steady": breakdown(rows[1:]),
        "all": breakdown(rows),
        "per_step": [{k: r[k] for k in ("step", *PARTS, "staleness_mean", "tokens")} for r in rows],
        "api_status_envs": status["envs"],
        "dropped_stale_groups": dropped,
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        "python -m bench.trainer.breakdown",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    ap.add_argument("--staleness", default="0,1,2", help="max_staleness values, comma list")
    ap.add_argument("--steps", type=int, default=10, help="GRPO steps per run")
    ap.add_argument("--model", choices=sorted(MODEL_SIZES), default="tiny")
    ap.add_argument("--group-size", type=int, default=4, help="cpu-tiny preset: 4")
    ap.add_argument("--batch-groups", type=int, default=2, help="groups per batch (cpu-tiny: 2)")
    ap.add_argument("--max-tokens", type=int, default=96, help="completion budget (cpu-tiny: 96)")
    ap.add_argument(
        "--run-timeout",
        type=float,
        default=300.0,
        help="seconds per run; then the trainer is stopped and the steps done are reported",
    )
    ap.add_argument("--out", type=Path, default=RESULTS / "trainer_breakdown.json")
    args = ap.parse_args()
    stop_on_sigterm()
    mdir = model_dir(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        for s in parse_list(args.staleness):
            before = machine()
            res = run_one(s, mdir, args, Path(tmp))
            res.update(machine_before=before, machine_after=machine())
            key = f"{args.model}/s{s}"
            if (args.group_size, args.batch_groups) != (4, 2):
                key += f"/gs{args.group_size}xb{args.batch_groups}"
            write_result(args.out, key, res)
            st = res["steady"]
            print(
                f"max_staleness={s}: steady steps {st['steps']}, step time median "
                f"{st['step_time_median_s']:.2f}s, wait {100 * st['wait_frac']:.1f}% compute "
                f"{100 * st['step_frac']:.1f}% checkpoint {100 * st['checkpoint_frac']:.1f}% "
                f"sync {100 * st['sync_frac']:.1f}%, staleness {st['staleness_mean']:.2f}, "
                f"dropped stale groups {res['dropped_stale_groups']}",
                flush=True,
            )


if __name__ == "__main__":
    main()
