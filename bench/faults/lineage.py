"""The parts of bench/faults/torn_checkpoint.py and tests/integration/trainer/test_checkpoint_faults.py: the
real trainer (``python -m trainer grpo``, one process or 2 ranks under torchrun) against a real
API and a real patched vLLM server (bridge mode ``none``), killed at random points inside its
checkpoint writes (``kill_inside_write``) or run to the end uninterrupted (the reference).

A ``Lineage`` is one training run from scratch to ``steps``: its own API process and database
holding the same fabricated groups (deterministic ids and tokens, one group per batch, served
FIFO), so every lineage trains the same batch at the same step and an interrupted run can be
compared, weight for weight, with an uninterrupted one. The lease is 1 s, and a resumed
trainer starts only once every lease in the database has passed its deadline: a killed
trainer's batch is back in the queue when its successor leases, first in line again.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import sqlite3
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from api.client import ApiClient
from launch.lifeline import ProcInfo, descendants, group_members, is_running, signal_group
from launch.procs import ManagedProcess, tail
from settings.ports import free_port
from trainer.checkpoint import list_checkpoints, missing_parts
from trainer.run import read_starts

TOKEN = "trainer-faults-token"
GROUP = 4
WAIT_S = 900.0
"""Longest wait for any one thing (a trainer start on a loaded 2-core box takes ~20-60 s)."""
ORPHAN_S = 30.0
"""How long the processes below a killed trainer may outlive it (a torchrun rank dies with
torchrun at once: trainer/agent_death.py; torchrun stops the other rank within its grace)."""


def fabricate_groups(model_dir: Path, n: int) -> list[dict]:
    """``n`` valid scored groups of ``GROUP`` sequences (the tiny tokenizer's real token ids,
    Shop-R1 targets), the same every call: ids ``g000``, ``g001``, ..."""
    from transformers import AutoTokenizer

    from env_server.prompts import format_target

    tok = AutoTokenizer.from_pretrained(model_dir)
    actions = [{"type": "click", "name": "buy"}, {"type": "terminate"}]
    groups = []
    for g in range(n):
        page = f"<html><button name='buy'>Buy {g}</button><p>item {g % 7}</p></html>"
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": page}], add_generation_prompt=True, tokenize=True
        )
        prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
        seqs = []
        for i in range(GROUP):
            text = format_target(f"I want option {g} {i}.", actions[(g + i) % 2])
            comp = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            seqs.append(
                {
                    "tokens": prompt + comp,
                    "mask": [0] * len(prompt) + [1] * len(comp),
                    "logprobs": [0.0] * len(prompt) + [-4.0 + 0.1 * i] * len(comp),
                    "score": float((g * 3 + i * 5) % 4) / 2,
                }
            )
        gid = f"g{g:03d}"
        groups.append({"group_id": gid, "env": "shop_r1", "policy_version": 0, "sequences": seqs})
    return groups


def step_of(path: Path) -> int:
    """``step_000012`` / ``.tmp-step_000012-123`` -> 12."""
    return int(re.search(r"step_(\d+)", path.name).group(1))


def weights(ckpt: Path) -> dict[str, torch.Tensor]:
    return load_file(ckpt / "model" / "model.safetensors")


def max_diff(a: Path, b: Path) -> float:
    """Largest absolute weight difference between two checkpoints (0.0: bitwise equal)."""
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys(), (a, b)
    return max((wa[k] - wb[k]).abs().max().item() for k in wa)


class Lineage:
    """One training run (see the module docstring), restartable with ``--resume``."""

    def __init__(
        self,
        root: Path,
        name: str,
        model: Path,
        vllm_url: str,
        groups: list[dict],
        steps: int,
        procs: int = 1,
        keep: int = 2,
        bridge_token: str = TOKEN,
        forked: bool = False,
    ) -> None:
        self.dir = root / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.name, self.model, self.vllm_url = name, model, vllm_url
        self.steps, self.procs, self.keep = steps, procs, keep
        self.bridge_token = bridge_token  # the vLLM server's (a shared one has its own)
        self.forked = forked and procs == 1
        """A one-process trainer forked from the vLLM template (``launch.forked``): ~5 s of
        imports less per start; torchrun's ranks are always plain starts."""
        self.save, self.db = self.dir / "trainer", self.dir / "api.sqlite"
        self.url = f"http://127.0.0.1:{free_port()}"
        self.starts = 0
        self.starts_recorded = 0  # rows of starts.jsonl before the latest start
        self.trainers: list[ManagedProcess] = []
        argv = [sys.executable, "-m", "api", "--port", self.url.rsplit(":", 1)[1]]
        argv += ["--db-path", str(self.db), "--token", TOKEN, "--max-staleness", "100000"]
        self.api = ManagedProcess(f"api-{name}", argv, self.dir / "api.log").start()
        client = ApiClient(self.url, token=TOKEN, give_up_s=120, connect_timeout=1.0)
        try:
            client.register_env("shop_r1", 1.0, GROUP)
            for i in range(0, len(groups), 16):
                assert client.push_groups(groups[i : i + 16]).accepted == len(groups[i : i + 16])
        except BaseException:
            self.api.stop()
            raise
        finally:
            client.close()

    # -- the trainer -------------------------------------------------------------------------
    def trainer_argv(self, resume: bool) -> list[str]:
        launcher = [sys.executable]
        if self.procs > 1:
            launcher += ["-m", "torch.distributed.run", "--standalone"]
            launcher += [f"--nproc-per-node={self.procs}"]
        args = ["-m", "trainer", "grpo", "--model-name", str(self.model)]
        args += ["--save-path", str(self.save), "--api-url", self.url, "--api-token", TOKEN]
        args += ["--weight-bridge-mode", "none", "--inference-url", self.vllm_url]
        args += ["--bridge-token", self.bridge_token, "--device", "cpu", "--precision", "fp32"]
        args += ["--training-steps", str(self.steps), "--batch-size", str(GROUP)]
        args += ["--lr", "1e-3", "--kl-beta", "0.05", "--lease-seconds", "1"]
        args += ["--save-every", "1", "--keep-checkpoints", str(self.keep)]
        args += ["--wait-timeout", "300", "--reconnect-timeout", "300", "--poll-interval", "0.2"]
        args += ["--no-tensorboard", "--resume" if resume else "--overwrite"]
        return launcher + args

    def start_trainer(self, resume: bool) -> ManagedProcess:
        if resume:  # its predecessor's batch must be first in line again (module docstring)
            self.wait_leases_expired()
        self.starts += 1
        env = {**os.environ, "OMP_NUM_THREADS": "1"}  # the same float sums in every run
        for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(var, None)
        log = self.dir / f"trainer.{self.starts}.log"
        argv = self.trainer_argv(resume)
        proc = ManagedProcess(f"trainer-{self.name}", argv, log, env=env, forked=self.forked)
        self.starts_recorded = len(read_starts(self.save))  # its own line comes next
        self.trainers.append(proc.start())
        return proc

    def run(self, resume: bool = False) -> tuple[int, str]:
        """A trainer to its end: exit status and log."""
        proc = self.start_trainer(resume)
        try:
            rc = proc.wait_exit()
        finally:
            proc.stop()
        return rc, proc.log_path.read_text(errors="replace")

    def resumed_step(self, proc: ManagedProcess) -> int:
        """The step ``proc``, the trainer started last, resumed at, 0 for a fresh start: its
        row of ``starts.jsonl``, the first after those there when it started (under torchrun
        the row is rank 0's, whose PID is not the launcher's)."""
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            if len(rows := read_starts(self.save)) > self.starts_recorded:
                row = rows[self.starts_recorded]
                return int(row["step"]) if row["resumed_from"] else 0
            assert proc.alive(), f"{proc.name} died before resuming:\n{tail(proc.log_path)}"
            time.sleep(0.2)
        raise TimeoutError(f"{proc.name} did not resume: {tail(proc.log_path)}")

    def stop(self) -> None:
        for p in self.trainers:
            p.stop()
        self.api.stop()

    # -- what is on disk and in the database -------------------------------------------------
    def checkpoint(self, step: int) -> Path:
        return self.save / "checkpoints" / f"step_{step:06d}"

    def complete_steps(self) -> list[int]:
        """Steps of the published checkpoints; asserts every one is complete."""
        found = list_checkpoints(self.save)
        for p in found:
            assert missing_parts(p) == [], f"{p} is incomplete: {missing_parts(p)}"
        return [step_of(p) for p in found]

    def wait_leases_expired(self) -> None:
        """Sleep until every batch the database holds as leased is past its lease deadline
        (the API's clock is this box's ``time.time``), so the next lease finds it expired."""
        ((deadline,),) = self.query("SELECT MAX(deadline) FROM batches WHERE state = 'leased'")
        if deadline is not None:
            time.sleep(max(0.0, deadline - time.time()) + 0.05)

    def query(self, sql: str) -> list[tuple]:
        with sqlite3.connect(f"file:{self.db}?mode=ro", uri=True) as conn:
            return conn.execute(sql).fetchall()

    def metrics(self) -> list[dict]:
        path = self.save / "metrics.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        return [json.loads(x) for x in lines if x.strip()]


def reference(lin: Lineage) -> float:
    """Run ``lin`` uninterrupted to its end (``keep`` = every step); returns the median
    checkpoint write (``checkpoint_s``: the write, then the acks), the trials' kill window."""
    rc, log = lin.run()
    assert rc == 0, log[-3000:]
    assert lin.complete_steps() == list(range(1, lin.steps + 1))
    return statistics.median(r["checkpoint_s"] for r in lin.metrics())


def rank_pid(torchrun_pid: int, rank: int) -> int:
    """The PID of torchrun's worker ``rank`` (its environment says ``RANK=<rank>``)."""
    for child in descendants(torchrun_pid):
        try:
            env = Path(f"/proc/{child.pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and b"LOCAL_RANK=" in b"\0".join(env):
            return child.pid
    raise LookupError(f"no rank {rank} under torchrun {torchrun_pid}")


def kill_inside_write(
    lin: Lineage, proc: ManagedProcess, rng: random.Random, window_s: float, min_step: int
) -> dict[str, Any]:
    """Wait until ``proc`` starts writing the checkpoint of a step >= ``min_step``, wait a
    random time in ``[0, window_s]``, SIGKILL it (one process: its group; torchrun: one
    random rank, whose death torchrun turns into the others', or the whole group), wait
    until every process of the group and every process that ran below it (torchrun's ranks,
    each in a session of its own) is gone, and say where the kill landed."""
    root = lin.save / "checkpoints"
    deadline = time.monotonic() + WAIT_S
    # what the previous kill left (a 2-rank write's ``.tmp-step_N-sharded`` has no PID in its
    # name) is not this process's write: ignored until the resume's clean-up removes it
    stale = {p.name for p in root.iterdir()} if root.is_dir() else set()
    while True:
        names = [p for p in root.iterdir()] if root.is_dir() else []
        stale &= {p.name for p in names}
        writing = [
            p
            for p in names
            if p.name.startswith(".tmp-step_") and step_of(p) >= min_step and p.name not in stale
        ]
        if writing:
            break
        assert proc.alive(), f"{proc.name} exited before step {min_step}:\n{tail(proc.log_path)}"
        assert time.monotonic() < deadline, f"no checkpoint write: {tail(proc.log_path)}"
        time.sleep(0.005)
    step, tmp = step_of(writing[0]), writing[0]
    delay = rng.uniform(0.0, window_s)
    time.sleep(delay)
    target = "process group" if lin.procs == 1 else rng.choice(["rank 0", "rank 1", "group"])
    below = descendants(proc.pid)  # torchrun's ranks run in sessions of their own
    if target.startswith("rank"):
        try:
            os.kill(rank_pid(proc.pid, int(target[-1])), signal.SIGKILL)
        except (LookupError, ProcessLookupError):
            target = "group (the rank had already exited)"
            signal_group(proc.pid, signal.SIGKILL)
    else:
        signal_group(proc.pid, signal.SIGKILL)
    in_tmp = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*")) if tmp.exists() else None
    proc.popen.wait(timeout=WAIT_S)
    while group_members(proc.pid):  # torchrun stops the other rank: wait for all of them
        assert time.monotonic() < deadline, f"{proc.name}'s processes outlived the kill"
        time.sleep(0.1)
    proc.stop()  # unregister it from the lifeline
    wait_gone(below, proc.name)
    return {
        "step": step,
        "delay_s": round(delay, 3),
        "killed": target,
        "phase": _phase(lin, step, in_tmp),
    }


def wait_gone(procs: list[ProcInfo], name: str) -> None:
    """Wait up to ``ORPHAN_S`` for ``procs`` (what ran below a killed trainer) to be gone;
    SIGKILL and name those still running: a rank that outlives torchrun goes on training and
    writing checkpoints beside the resumed trainer, and every check after the kill is void."""
    deadline = time.monotonic() + ORPHAN_S
    while alive := [p for p in procs if is_running(p.pid, p.starttime)]:
        if time.monotonic() > deadline:
            for p in alive:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGKILL)
            raise AssertionError(
                f"{len(alive)} process(es) below {name} outlived it by {ORPHAN_S:.0f} s "
                f"(PIDs {[p.pid for p in alive]}): orphaned ranks, now SIGKILLed"
            )
        time.sleep(0.05)


def _phase(lin: Lineage, step: int, in_tmp: list[str] | None) -> str:
    """Where in the write of ``step`` the kill landed, from what it left."""
    ckpt = lin.checkpoint(step)
    if in_tmp is not None and not ckpt.exists():
        files = [f for f in in_tmp if "/" not in f or f.startswith("dcp/")]
        return f"writing ({len(in_tmp)} entries in the temporary dir: {', '.join(files[:8])})"
    if not ckpt.exists():
        return "published and pruned already"
    batch = json.loads((ckpt / "trainer_state.json").read_text())["recent_batches"][-1]
    acked = lin.query(f"SELECT state FROM batches WHERE batch_id='{batch['batch_id']}'")
    if acked and acked[0][0] == "acked":
        return "after the ack (weight sync, metrics, next lease)"
    return "after the rename, before the ack"


def after_kill(lin: Lineage, ref: Lineage) -> dict[str, Any]:
    """Right after a kill: every published checkpoint is complete; the newest one's weights
    equal the reference's at the same step (their largest difference is returned)."""
    steps = lin.complete_steps()
    last = steps[-1] if steps else 0
    diff = max_diff(lin.checkpoint(last), ref.checkpoint(last)) if last else 0.0
    leftovers = [p.name for p in (lin.save / "checkpoints").iterdir() if p.name.startswith(".")]
    return {"last_complete": last, "max_weight_diff": diff, "leftovers": leftovers}


def exactly_once(lin: Lineage, ref: Lineage, tol: float) -> dict[str, Any]:
    """The finished run: its last step's weights equal the reference's (within ``tol``);
    every batch the API acked was trained once by the checkpoint lineage (each group once),
    every group the lineage trained is acked, no step was logged twice."""
    final = lin.checkpoint(lin.steps)
    diff = max_diff(final, ref.checkpoint(lin.steps))
    assert diff <= tol, f"final weights differ from the uninterrupted run's by {diff}"
    lineage = json.loads((final / "trainer_state.json").read_text())["recent_batches"]
    trained = [g for b in lineage for g in b["group_ids"]]
    assert len(lineage) == lin.steps and len(trained) == len(set(trained)), "trained twice"
    ref_lineage = json.loads((ref.checkpoint(lin.steps) / "trainer_state.json").read_text())
    assert [b["group_ids"] for b in lineage] == [
        b["group_ids"] for b in ref_lineage["recent_batches"]
    ], "another batch at some step than the uninterrupted run"
    acked = {g for (g,) in lin.query("SELECT group_id FROM groups WHERE state='acked'")}
    assert acked == set(trained), "the API's acked groups != the groups the lineage trained"
    batches = dict(lin.query("SELECT batch_id, state FROM batches"))
    assert all(batches[b["batch_id"]] == "acked" for b in lineage)
    steps = [r["step"] for r in lin.metrics() if not r.get("skipped_update")]
    assert len(steps) == len(set(steps)), f"a step logged twice: {steps}"
    return {
        "final_max_weight_diff": diff,
        "groups_trained": len(trained),
        "groups_trained_twice": len(trained) - len(set(trained)),
        "batches_leased": len(batches),
        "batches_acked": sum(s == "acked" for s in batches.values()),
        "batches_expired": sum(s == "expired" for s in batches.values()),
    }


def torn_run(
    lin: Lineage, ref: Lineage, rng: random.Random, trials: int, window_s: float, tol: float
) -> dict[str, Any]:
    """Train ``lin`` to its end, SIGKILLing it inside a checkpoint write ``trials`` times
    (the write of the first or second step after each resume, at random) and resuming it
    each time; check every trial (``after_kill``, the step it resumed at) and the end
    (``exactly_once``). Returns the record of every trial and the final counts."""
    records: list[dict[str, Any]] = []
    proc, resumed = lin.start_trainer(resume=False), 0
    while len(records) < trials:
        target = resumed + rng.choice([1, 2])
        assert target <= lin.steps, "raise the steps: the run ended before the trials did"
        t0 = time.monotonic()
        kill = kill_inside_write(lin, proc, rng, window_s, target)
        state = after_kill(lin, ref)
        assert state["max_weight_diff"] <= tol, state
        proc = lin.start_trainer(resume=True)
        resumed = lin.resumed_step(proc)
        assert resumed == state["last_complete"], (resumed, state)
        records.append(
            {**kill, **state, "resumed_at": resumed, "s": round(time.monotonic() - t0, 1)}
        )
    rc = proc.wait_exit()
    proc.stop()
    assert rc == 0, tail(proc.log_path, 60)
    return {"trials": records, **exactly_once(lin, ref, tol)}
