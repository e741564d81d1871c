"""An hour of churn on the default preset: the four services of ``launch/run_all.sh`` (API,
patched vLLM, Shop-R1 env, GRPO trainer on ``cpu-tiny``), a random one SIGKILLed every few
minutes and restarted, plus one full-disk episode, then an exactly-once audit
(docs/FAULT_TOLERANCE.md, "The one-hour soak"). Not part of CI; anyone can rerun it:

    python -m bench.faults.soak                                   # 60 min, a kill every 2-4 min
    python -m bench.faults.soak --minutes 10 --kill-every 60 120  # a short look
    python -m bench.faults.soak --out docs/results/soak           # keep the report (soak.json)

Needs the preset's SFT model (``launch/run_all.sh --prepare-only`` builds it) and the whole
machine for the hour (2 cores: vLLM on one, the trainer on the other, as run_all plans it).
The full-disk episode needs a tmpfs (root); without one it is skipped and the report says so.

What it does: starts the services with run_all's resolved configs (the trainer with
``--training-steps`` large, the API's database and the trainer's checkpoints on a tmpfs
"data disk"); every ``--kill-every`` seconds (uniform) SIGKILLs the process group of one
service drawn at random and restarts it with the same arguments (the trainer with
``--resume``), waiting until it answers before the next kill; a service that exits by
itself is restarted too and counted. At ``--disk-at`` of the run the data disk is filled
to ``--disk-leave-mb`` free for ``--disk-s`` seconds: the API refuses pushes (507) and the
trainer's next checkpoint fails (exit 74) until the space is back. At the end the env is
stopped, the trainer is restarted once with ``--training-steps`` = its last checkpoint's step,
which acks what that checkpoint holds and exits, and every process is stopped. Then the
audit: groups the env was told were stored but are not in the database (lost, must be 0),
groups the checkpoint lineage trained twice (must be 0), the API's acked groups against the
lineage, every batch acked, the final weights finite, no process of any session left.
"""

from __future__ import annotations

import argparse
import json
import random
import sqlite3
import sys
import time
from collections import Counter
from pathlib import Path

from bench.common import machine
from launch.exits import EXIT_CHECKPOINT_WRITE


def wait_healthy(stack, name: str, timeout: float = 900.0) -> float:
    """Seconds until ``name`` answers (raises if it dies or takes longer)."""
    t0 = time.monotonic()
    while not stack.healthy(name):
        proc = stack.procs[name]
        if not proc.alive():
            raise RuntimeError(f"{name} died while starting; read {proc.log_path}")
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"{name} did not come up in {timeout:.0f}s; read {proc.log_path}")
        time.sleep(1.0)
    return time.monotonic() - t0


class Watch:
    """What the services say about themselves, asked once a second (never their logs): the
    API's ``/status`` (``storage_refusals``: pushes refused for lack of space, counted by each
    API process since it started) and vLLM's ``/bridge/health`` (the weight version it serves:
    a restarted server is back on the trainer's weights once it serves at least the version
    the trainer had checkpointed when the server was killed)."""

    def __init__(self) -> None:
        self.refusals: dict[int, int] = {}  # API start number -> the most it reported
        self.refusing_seen = False  # /status said storage_low at least once
        self.waiting: list[tuple[float, int]] = []  # (restart time, version it must reach)
        self.resync_s: list[float] = []

    def poll(self, stack) -> None:
        import httpx

        from api.client import bearer

        try:
            status = httpx.get(f"{stack.api_url}/status", timeout=2).json()
            n = stack.starts["api"]
            self.refusals[n] = max(self.refusals.get(n, 0), int(status["storage_refusals"]))
            self.refusing_seen |= bool(status["storage_low"])
        except (httpx.HTTPError, ValueError, KeyError):
            pass  # down (being killed or restarted): the next poll asks again
        if self.waiting:
            headers = bearer(stack.token)
            try:
                health = httpx.get(f"{stack.vllm_url}/bridge/health", timeout=2, headers=headers)
                version = int(health.json()["weight_version"])
            except (httpx.HTTPError, ValueError, KeyError, TypeError):
                return
            now = time.monotonic()
            self.resync_s += [round(now - t, 1) for t, v in self.waiting if version >= v]
            self.waiting = [(t, v) for t, v in self.waiting if version < v]

    def report(self) -> dict:
        return {
            "api_storage_refusals": sum(self.refusals.values()),
            "api_reported_storage_low": self.refusing_seen,
            "vllm_restarts_resynced": len(self.resync_s),
            "vllm_resync_s": self.resync_s,
            "vllm_restarts_not_resynced_by_the_end": len(self.waiting),
        }


class Lineage:
    """The checkpoint lineage, from snapshots of the newest checkpoint's ``recent_batches``
    (64 kept: snapshots every few seconds miss none); a step seen with two batches is a
    fork, which must never happen."""

    def __init__(self) -> None:
        self.by_step: dict[int, dict] = {}
        self.forks: list[int] = []

    def snapshot(self, stack) -> None:
        state = stack.latest_state()
        if state is None:
            return
        step, recent = state
        for i, b in enumerate(recent):
            s = step - len(recent) + 1 + i
            if s in self.by_step and self.by_step[s]["batch_id"] != b["batch_id"]:
                self.forks.append(s)
            self.by_step[s] = b


def run(a: argparse.Namespace) -> dict:
    from bench.faults.soak_stack import SERVICES, SoakStack

    rng = random.Random(a.seed)
    stack = SoakStack(a.run_dir, a.preset, a.disk_mb << 20, 1_000_000)
    report: dict = {"machine": machine(), "preset": a.preset, "minutes": a.minutes, "events": []}
    kills: Counter[str] = Counter()
    unplanned: list[dict] = []
    lineage, watch = Lineage(), Watch()

    t0 = time.monotonic()

    def event(what: str, **kw: object) -> None:
        row = {"t_s": round(time.monotonic() - t0, 1), "what": what, **kw}
        report["events"].append(row)
        print(json.dumps(row), flush=True)

    try:
        for name in SERVICES:
            stack.start(name)
            if name in ("api", "vllm"):
                event("started", service=name, up_s=round(wait_healthy(stack, name), 1))
        while not (stack.save / "metrics.jsonl").exists():  # the hour counts from step 1
            dead = [n for n in SERVICES if not stack.procs[n].alive()]
            if dead or time.monotonic() - t0 > 3600:
                raise RuntimeError(f"no first step ({dead or 'an hour'}); read {a.run_dir}")
            time.sleep(1.0)
        event("first step")
        t1 = time.monotonic()
        deadline = t1 + 60 * a.minutes
        next_kill = t1 + rng.uniform(*a.kill_every)
        disk_at = t1 + a.disk_at * 60 * a.minutes if stack.disk else None
        disk_until = None
        report["others_at_start"] = others()
        loads: list[float] = []
        while time.monotonic() < deadline:
            time.sleep(1.0)
            lineage.snapshot(stack)
            watch.poll(stack)
            if len(loads) < (time.monotonic() - t1) / 60:  # one sample a minute
                loads.append(machine()["loadavg"][0])
            if not report.get("others_midway") and time.monotonic() > (t1 + deadline) / 2:
                report["others_midway"] = others()
            for name in SERVICES:  # a service that exited by itself: note it, restart it
                proc = stack.procs[name]
                if not proc.alive():
                    rc = proc.popen.returncode
                    unplanned.append({"service": name, "exit": rc, "log": str(proc.log_path)})
                    event("exited by itself", service=name, exit=rc)
                    proc.stop()
                    stack.start(name)
            now = time.monotonic()
            if disk_at is not None and now >= disk_at and disk_until is None:
                free = stack.disk.fill(leave=a.disk_leave_mb << 20)
                disk_until = now + a.disk_s
                event("disk full", free_bytes=free, for_s=a.disk_s)
            if disk_until is not None and now >= disk_until and disk_at is not None:
                event("disk space back", free_bytes=stack.disk.release())
                disk_at = None
            if now >= next_kill:
                name = rng.choice(SERVICES)
                step = (stack.latest_state() or (0, []))[0]
                stack.procs[name].kill9()
                kills[name] += 1
                time.sleep(1.0)
                stack.start(name)
                if name == "vllm":  # it serves the start weights until the trainer re-syncs
                    watch.waiting.append((time.monotonic(), max(step, 1)))
                up = wait_healthy(stack, name) if name in ("api", "vllm") else 0.0
                event("killed and restarted", service=name, step=step, up_s=round(up, 1))
                next_kill = time.monotonic() + rng.uniform(*a.kill_every)
        # -- the end: let the trainer ack what its last checkpoint holds, then stop ----------
        if disk_at is not None and disk_until is not None:  # still full: give the space back
            event("disk space back", free_bytes=stack.disk.release())
        stack.procs["env"].stop()
        stack.procs["trainer"].stop()
        lineage.snapshot(stack)
        final_step = (stack.latest_state() or (0, []))[0]
        stack.start("trainer", training_steps=str(final_step))
        rc = stack.procs["trainer"].wait_exit()
        event("final trainer run (acks the last checkpoint)", exit=rc, step=final_step)
        lineage.snapshot(stack)
        report.update(audit(stack, lineage, final_step))
        report.update(watch.report(), trainer_resumes=resumes(stack.save))
        report["trainer_checkpoint_write_stops"] = sum(
            u["service"] == "trainer" and u["exit"] == EXIT_CHECKPOINT_WRITE for u in unplanned
        )
        report["loadavg_1min_per_minute"] = loads
    finally:
        stack.stop_all()
        report["processes_left_behind"] = left_behind([p.pid for p in stack.history])
    report.update(
        kills=dict(kills),
        kills_total=sum(kills.values()),
        restarts={n: stack.starts[n] - 1 for n in SERVICES},
        unplanned_exits=unplanned,
        full_disk_episode=stack.disk is not None,
        total_s=round(time.monotonic() - t0, 1),
        loadavg_end=machine()["loadavg"],
    )
    return report


def audit(stack, lineage: Lineage, final_step: int) -> dict:
    """Exactly once, from the env's record, the API's database and the checkpoint lineage."""
    import torch
    from safetensors.torch import load_file

    pushed = [json.loads(x) for x in stack.env_metrics.read_text().splitlines() if x.strip()]
    records = [r for r in pushed if r.get("kind") == "group"]
    # the env records every group it scored; a constant group it dropped was never pushed
    pushed_ids = {r["group_id"] for r in records if r.get("pushed", True)}
    with sqlite3.connect(f"file:{stack.db}?mode=ro", uri=True) as db:
        groups = dict(db.execute("SELECT group_id, state FROM groups").fetchall())
        batches = dict(db.execute("SELECT batch_id, state FROM batches").fetchall())
        ok = db.execute("PRAGMA integrity_check").fetchone()[0]
    steps = sorted(lineage.by_step)
    trained = [g for s in steps for g in lineage.by_step[s]["group_ids"]]
    acked = {g for g, s in groups.items() if s == "acked"}
    final = stack.save / "checkpoints" / f"step_{final_step:06d}" / "model"
    weights = {}
    for f in final.glob("*.safetensors"):
        weights.update(load_file(f))
    return {
        "steps": final_step,
        "lineage_steps_seen": len(steps),
        "lineage_complete": steps == list(range(1, final_step + 1)),
        "lineage_forks": lineage.forks,
        "groups_acknowledged_to_env": len(pushed_ids),
        "groups_dropped_by_env": len(records) - len(pushed_ids),
        "groups_lost": len(pushed_ids - set(groups)),
        "groups_in_db": len(groups),
        "groups_by_state": dict(Counter(groups.values())),
        "groups_trained": len(trained),
        "groups_trained_twice": len(trained) - len(set(trained)),
        "acked_equals_trained": acked == set(trained),
        "batches_trained": len(steps),
        "batches_by_state": dict(Counter(batches.values())),
        "lineage_batches_acked": all(
            batches.get(lineage.by_step[s]["batch_id"]) == "acked" for s in steps
        ),
        "db_integrity": ok,
        "final_weights_finite": bool(weights)
        and all(torch.isfinite(t).all() for t in weights.values()),
    }


def resumes(save: Path) -> int:
    """Trainer starts that resumed from a checkpoint (the trainer's ``starts.jsonl``)."""
    from trainer.run import read_starts

    return sum(r["resumed_from"] is not None for r in read_starts(save))


def others(n: int = 6) -> list[str]:
    """The busiest processes on the machine now (what else ran beside the soak)."""
    import subprocess

    out = subprocess.run(
        ["ps", "-eo", "pcpu,rss,etime,args", "--sort=-pcpu"], capture_output=True, text=True
    ).stdout.splitlines()
    return [line[:160] for line in out[1:] if " ps -eo " not in line][:n]


def left_behind(sessions: list[int]) -> int:
    """Processes still alive in any session the soak started (their leaders' PIDs)."""
    wanted, left = set(sessions), 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2 :].split()
        left += int(fields[3]) in wanted and fields[0] != "Z"
    return left


def main() -> int:
    ap = argparse.ArgumentParser(
        "python -m bench.faults.soak",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--minutes", type=float, default=60.0)
    ap.add_argument(
        "--kill-every", type=float, nargs=2, default=[120.0, 240.0], metavar=("MIN", "MAX")
    )
    ap.add_argument("--disk-at", type=float, default=0.5, help="fraction of the run (0.5)")
    ap.add_argument("--disk-s", type=float, default=120.0, help="seconds the disk stays full")
    ap.add_argument("--disk-leave-mb", type=int, default=16, help="free MB while full (16)")
    ap.add_argument("--disk-mb", type=int, default=512, help="data disk MB (tmpfs: RAM)")
    ap.add_argument("--preset", default="cpu-tiny")
    ap.add_argument("--seed", type=int, default=29)
    ap.add_argument("--run-dir", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=None, help="folder for soak.json")
    a = ap.parse_args()
    if a.run_dir is None:
        import tempfile

        a.run_dir = Path(tempfile.mkdtemp(prefix="soak-"))
    a.run_dir = a.run_dir.resolve()
    a.run_dir.mkdir(parents=True, exist_ok=True)
    print(f"[soak] run dir {a.run_dir}", flush=True)
    report = run(a)
    text = json.dumps({k: v for k, v in report.items() if k != "events"}, indent=1)
    print(text, flush=True)
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "soak.json").write_text(json.dumps(report, indent=1) + "\n")
    bad = report.get("groups_lost") or report.get("groups_trained_twice")
    return 1 if bad or report["processes_left_behind"] else 0


if __name__ == "__main__":
    sys.exit(main())
