"""Four services started by hand on loopback (API, patched vLLM in ``shared_vllm``, the Shop-R1
env service, the GRPO trainer on the tiny model), each restartable by name with the arguments it
first ran with, and read-only views of what they leave (the API's SQLite store, the trainer's
metrics, every process session started): the harness of
tests/integration/launch/test_fault_tolerance.py, which SIGKILLs them in turn."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import httpx

from api.client import bearer
from launch.procs import ManagedProcess, tail
from launch.vllm_server import BridgeServer, start_bridge_server
from settings.ports import free_ports

TOKEN = "fault-tolerance-token"
GROUP = 4
MAX_STALENESS = 2
WAIT_S = 300.0
"""Longest wait for any one thing (a step, a restart); the whole test stays far below."""


class Stack:
    """The four services, each restartable with the arguments it first ran with."""

    def __init__(self, model: Path, tmp: Path, steps: int) -> None:
        self.model, self.tmp, self.steps_target = model, tmp, steps
        self.api_port, self.vllm_port = free_ports(2)  # two draws could pick the same port
        self.api_url = f"http://127.0.0.1:{self.api_port}"
        self.vllm_url = f"http://127.0.0.1:{self.vllm_port}"
        self.db = tmp / "api.sqlite"
        self.save = tmp / "trainer"
        self.env_metrics = tmp / "env_metrics.jsonl"
        self.procs: dict[str, ManagedProcess] = {}
        self.vllm: BridgeServer | None = None
        self.starts: Counter[str] = Counter()
        self.dead_leases: set[str] = set()
        """Batches leased to a trainer that was killed: they stay leased until they expire."""
        self.history: list[ManagedProcess] = []

    # -- starting ------------------------------------------------------------------------
    def _log(self, name: str) -> Path:
        self.starts[name] += 1
        return self.tmp / f"{name}.{self.starts[name]}.log"

    @property
    def sessions(self) -> list[int]:
        """The session of every process started (restarts included): its leader's PID."""
        return [p.pid for p in self.history]

    def start_api(self) -> None:
        argv = [
            sys.executable,
            "-m",
            "api",
            "--port",
            str(self.api_port),
            "--db-path",
            str(self.db),
            "--token",
            TOKEN,
            "--max-staleness",
            str(MAX_STALENESS),
        ]
        proc = ManagedProcess("api", argv, self._log("api"), forked=True).start()
        self.procs["api"] = proc
        self.history.append(proc)
        proc.wait_http(f"{self.api_url}/health", WAIT_S, interval=0.2, headers=bearer(TOKEN))

    def start_vllm(self) -> None:
        self.vllm = start_bridge_server(
            self.model,
            "shared_vllm",
            self._log("vllm"),
            token=TOKEN,
            port=self.vllm_port,
            timeout=WAIT_S,
            forked=True,
        )
        self.procs["vllm"] = self.vllm.proc
        self.history.append(self.vllm.proc)

    def start_env(self) -> None:
        argv = [
            sys.executable,
            "-m",
            "env_server",
            "--api-url",
            self.api_url,
            "--api-token",
            TOKEN,
            "--inference-url",
            self.vllm_url,
            "--tokenizer",
            str(self.model),
            "--data-dir",
            str(self.tmp / "data"),
            "--num-sessions",
            "20",
            "--group-size",
            str(GROUP),
            "--max-tokens",
            "24",
            "--max-prompt-tokens",
            "512",
            "--latest-only",
            "--concurrency",
            "2",
            "--no-drop-constant-groups",
            "--poll-interval-s",
            "0.3",
            "--log-every-s",
            "5",
            "--reconnect-timeout-s",
            str(WAIT_S),
            "--metrics-path",
            str(self.env_metrics),
        ]
        self.procs["env"] = ManagedProcess("env", argv, self._log("env"), forked=True).start()
        self.history.append(self.procs["env"])

    def start_trainer(self) -> None:
        resume = "--resume" if self.starts["trainer"] else "--overwrite"
        argv = [
            sys.executable,
            "-m",
            "trainer",
            "grpo",
            "--model-name",
            str(self.model),
            "--save-path",
            str(self.save),
            "--api-url",
            self.api_url,
            "--api-token",
            TOKEN,
            "--weight-bridge-mode",
            "shared_vllm",
            "--inference-url",
            self.vllm_url,
            "--bridge-token",
            TOKEN,
            "--device",
            "cpu",
            "--training-steps",
            str(self.steps_target),
            "--batch-size",
            str(GROUP),
            "--lr",
            "1e-4",
            "--kl-beta",
            "0",
            "--lease-seconds",
            "60",
            "--wait-timeout",
            str(2 * WAIT_S),
            "--poll-interval",
            "0.3",
            "--reconnect-timeout",
            str(WAIT_S),
            "--save-every",
            "1",
            "--no-tensorboard",
            resume,
        ]
        trainer = ManagedProcess("trainer", argv, self._log("trainer"), forked=True)
        self.procs["trainer"] = trainer.start()
        self.history.append(self.procs["trainer"])

    def start(self, name: str) -> None:
        getattr(self, f"start_{name}")()

    def stop_all(self) -> None:
        for name in ("trainer", "env", "vllm", "api"):
            if name in self.procs:
                if self.procs[name].alive():
                    os.kill(self.procs[name].pid, signal.SIGCONT)  # if paused, let it stop
                self.procs[name].stop()

    # -- observing -----------------------------------------------------------------------
    def steps(self) -> list[dict]:
        path = self.save / "metrics.jsonl"
        if not path.exists():
            return []
        rows = []
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # a line being written
        return rows

    def last_step(self) -> int:
        rows = self.steps()
        return rows[-1]["step"] if rows else 0

    def vllm_health(self) -> dict:
        return httpx.get(f"{self.vllm_url}/bridge/health", timeout=60).json()

    def log_text(self, name: str) -> str:
        """Every log of service ``name``, its restarts' in order."""
        return "".join(
            (self.tmp / f"{name}.{i}.log").read_text(errors="replace")
            for i in range(1, self.starts[name] + 1)
        )

    def check_alive(self) -> None:
        for name in ("api", "vllm", "env"):
            proc = self.procs[name]
            assert proc.alive(), f"{name} died; {proc.log_path}:\n{tail(proc.log_path, 30)}"


def wait_for(
    cond: Callable[[], bool], what: str, *watch: ManagedProcess, timeout: float = WAIT_S
) -> float:
    """Poll ``cond`` until true; fail early when a watched process died. Returns the time."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return time.monotonic()
        for p in watch:
            assert p.alive(), f"{p.name} died waiting for {what}:\n{tail(p.log_path, 40)}"
        time.sleep(0.2)
    logs = "".join(f"\n--- {p.name}: {p.log_path}\n{tail(p.log_path, 30)}" for p in watch)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}{logs}")


def leased_batches(db: Path) -> set[str]:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        return {b for (b,) in conn.execute("SELECT batch_id FROM batches WHERE state = 'leased'")}


def group_count(db: Path) -> int:
    """Groups the API has stored (any state)."""
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        return int(conn.execute("SELECT COUNT(*) FROM groups").fetchone()[0])


def db_groups(db: Path) -> dict[str, tuple[str, int]]:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        rows = conn.execute("SELECT group_id, state, policy_version FROM groups").fetchall()
    return {gid: (state, version) for gid, state, version in rows}


def db_batches(db: Path) -> tuple[dict[str, tuple[str, int, set[str]]], int]:
    """{batch_id: (state, groups leased in it, groups whose last batch it is)}, and how many
    groups were ever leased (the difference of the sums: groups served again)."""
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        out = {
            b: (state, n, set())
            for b, state, n in conn.execute("SELECT batch_id, state, n_groups FROM batches")
        }
        for gid, b in conn.execute("SELECT group_id, batch_id FROM groups WHERE batch_id NOT NULL"):
            out[b][2].add(gid)
    return out, sum(len(g) for _, _, g in out.values())


def left_behind(sessions: list[int]) -> list[str]:
    """Processes still alive in any session the test started (each service is a session
    leader, ManagedProcess's start_new_session; its children inherit the session)."""
    wanted, left = set(sessions), []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # exited meanwhile
            continue
        fields = text[text.rindex(")") + 2 :].split()  # state ppid pgrp session ...
        if int(fields[3]) in wanted and fields[0] != "Z":
            left.append(f"pid {stat.parent.name} session {fields[3]}: {text[:80]}")
    return left
