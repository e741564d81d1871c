"""Fault tolerance of the whole stack on loopback: API + patched vLLM (``shared_vllm``, gloo) +
Shop-R1 environment service + GRPO trainer on the tiny model, SIGKILLed mid-run and restarted
with the same arguments (the trainer with ``--resume``): each in turn, then the API, vLLM and
the env a second time, together (their restarts overlap: the env's start-up waits out
vLLM's), while the resumed trainer runs (7 kills in 5 rounds, each service but the trainer
restarted twice).

Checks (docs/FAULT_TOLERANCE.md records the figures this test prints):
- the run reaches its step target; the env service and the trainer ride out the API and vLLM
  restarts by themselves (same PIDs before and after);
- after the vLLM restart (base weights, weight version 0, new run_id) the trainer re-syncs: the
  server's weight version equals the trainer's policy version again; no step trains on
  rollouts beyond the staleness bound. vLLM is killed while the trainer is idle (the env is
  paused with SIGSTOP until the queue is drained), so the only way back is the trainer's own
  re-sync on seeing a new run_id: without it, it would wait for fresh rollouts forever (the
  restarted server's are labelled version 0 and dropped as stale); the first time, the env
  stays paused until vLLM serves the trainer's version again, so no step is trained meanwhile
  (measured, not assumed: a push the env had sent before its SIGSTOP can be stored after the
  trainer was seen idle, and then rightly trained; the test counts the groups stored while the
  env was paused and asserts "no step" when there were none);
  the second time, the env is killed too and its restart samples from the restarted server,
  whose version-0 rollouts cannot train a step either;
- exactly once: every group the API acknowledged to the env is in its database; the groups the
  API marks acked are exactly the groups the trainer's checkpoint lineage trained, each once,
  and every acked batch is a batch of the lineage (by batch id and group ids);
- the final weights hold no NaN/inf, and vLLM serves them: its greedy completion equals
  transformers' greedy generation from the final checkpoint, token for token;
- no process is left behind: none of any session the test started (every restart included)
  is alive at the end.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from api.client import ApiClient
from launch.procs import ManagedProcess, tail
from launch.vllm_server import BridgeServer, start_bridge_server
from settings.ports import free_ports
from tests.integration.bridge_checks import assert_greedy, vllm_greedy

pytestmark = pytest.mark.integration
TOKEN = "fault-tolerance-token"
STEPS = 18
"""Enough for every round at the latest steps the API's queue allows: a round that kills vLLM
first lets the trainer drain the queue, at most ``MAX_STALENESS + 1`` batches (the API's
backpressure), so the last kill lands by about step 15 at worst (step 10 in the measured run)."""
KILLS = (("api",), ("vllm",), ("env",), ("trainer",), ("api", "vllm", "env"))
"""Each service in turn, then the API, vLLM and the env together while the resumed trainer
runs (one restart of each, overlapping: the env's start-up waits out vLLM's)."""
GROUP = 4
MAX_STALENESS = 2
WAIT_S = 300.0
GREEDY_PROMPT = "Click the search button to find running shoes"
"""Longest wait for any one thing (a step, a restart); the whole test stays far below."""


class Stack:
    """The four services, each restartable with the arguments it first ran with."""

    def __init__(self, model: Path, tmp: Path) -> None:
        self.model, self.tmp = model, tmp
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
        proc = ManagedProcess("api", argv, self._log("api")).start()
        self.procs["api"] = proc
        self.history.append(proc)
        client = ApiClient(self.api_url, token=TOKEN, retries=0)
        _wait(lambda: _healthy(client), f"API health; {proc.log_path}", proc)

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
            str(STEPS),
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
        return httpx.get(f"{self.vllm_url}/bridge/health", timeout=5).json()

    def check_alive(self) -> None:
        for name in ("api", "vllm", "env"):
            proc = self.procs[name]
            assert proc.alive(), f"{name} died; {proc.log_path}:\n{tail(proc.log_path, 30)}"


def _healthy(client: ApiClient) -> bool:
    try:
        return client.health()
    except Exception:  # noqa: BLE001 - not listening yet
        return False


def _wait(
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


def _leased_batches(db: Path) -> set[str]:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        return {b for (b,) in conn.execute("SELECT batch_id FROM batches WHERE state = 'leased'")}


def _group_count(db: Path) -> int:
    """Groups the API has stored (any state)."""
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        return int(conn.execute("SELECT COUNT(*) FROM groups").fetchone()[0])


def _trainer_idle(stack: Stack, client: ApiClient) -> bool:
    """Nothing left to lease and the last step fully synced: the trainer polls for data. A
    lease the killed trainer held does not count (it would keep the API's ``active_leases``
    up until it expires, ``--lease-seconds``: up to a minute of waiting for nothing)."""
    status = client.status()
    step = stack.last_step()
    return (
        status.queued_groups == 0
        and _leased_batches(stack.db) <= stack.dead_leases
        and step > 0
        and status.policy_version == step
        and stack.vllm_health()["weight_version"] == str(step)
        and _polls_for_data(stack.tmp / f"trainer.{stack.starts['trainer']}.log")
    )


def _polls_for_data(log: Path) -> bool:
    """The trainer's last lease, after its last step, came back empty (204). The API's view
    alone is not enough: a trainer acks its batch before it syncs and logs the step, so
    between the two it looks idle (a run saw vLLM killed there, and the step trained after
    the restart)."""
    lines = log.read_text(errors="replace").splitlines()
    leases = [i for i, line in enumerate(lines) if "/batches/lease " in line]
    steps = [i for i, line in enumerate(lines) if "trainer.grpo: step " in line]
    return bool(leases) and " 204 " in lines[leases[-1]] and leases[-1] > max(steps, default=-1)


def _kill_and_restart(stack: Stack, names: tuple[str, ...]) -> dict:
    """SIGKILL the services ``names`` mid-run (together), restart them, and time the recovery
    (seconds). With vLLM among them, the env is paused first until the trainer idles (see the
    module docstring); a killed env is restarted before vLLM, whose start it waits out."""
    env, trainer = stack.procs["env"], stack.procs["trainer"]
    out: dict = {"service": "+".join(names)}
    stored = -1  # groups the API held when the trainer was seen idle
    if "vllm" in names:  # kill it while the trainer is idle (see the module docstring)
        os.kill(env.pid, signal.SIGSTOP)
        client = ApiClient(stack.api_url, token=TOKEN)

        def idle() -> bool:
            """Idle, with no group stored while we looked: a push the env had sent before
            its SIGSTOP may still be committed later (the API answers /status meanwhile)."""
            nonlocal stored
            before = _group_count(stack.db)
            stored = before if _trainer_idle(stack, client) else -1
            return stored >= 0 and _group_count(stack.db) == before

        _wait(idle, "the trainer to drain the queue", trainer)
        run_id = stack.vllm_health()["run_id"]
    step_before = stack.last_step()
    assert step_before < STEPS - 1, "raise STEPS: the run ended before every kill was tried"
    pid_before = {n: p.pid for n, p in stack.procs.items()}
    t_kill = time.monotonic()
    for name in names:
        stack.procs[name].kill9()
    if "trainer" in names:  # what it held stays leased until the lease expires
        stack.dead_leases |= _leased_batches(stack.db)
    time.sleep(1.0)  # let the others notice the loss before the restart
    t_restart = time.monotonic()
    for name in sorted(names, key=("api", "env", "trainer", "vllm").index):
        stack.start(name)
    t_up = time.monotonic()
    if "vllm" in names:
        health = stack.vllm_health()
        assert health["run_id"] != run_id
        out["version_seen_after_restart"] = health["weight_version"]  # "0" unless re-synced
        assert health["weight_version"] in ("0", str(step_before))
        # Only the trainer's own re-sync can bring vLLM back to its version: the rollouts of
        # the start weights (version 0) are stale, so no step can train before it.
        t_synced = _wait(
            lambda: int(stack.vllm_health()["weight_version"]) >= step_before,
            "vLLM weight version == trainer policy version",
            stack.procs["trainer"],
            stack.procs["env"],
            stack.procs["vllm"],
        )
        out["restart_to_resync_s"] = round(t_synced - t_restart, 1)
        if "env" not in names:  # paused, it sampled nothing meanwhile: no step either
            late = _group_count(stack.db) - stored  # pushes sent before the SIGSTOP, stored late
            out["groups_stored_while_paused"] = late
            if late == 0:  # measured: with a late group the trainer may rightly train it
                assert stack.last_step() == step_before
            os.kill(env.pid, signal.SIGCONT)
    watch = [stack.procs["trainer"], stack.procs["env"]]
    t_step = _wait(lambda: stack.last_step() > step_before, f"a trained step after {names}", *watch)
    out.update(
        step_at_kill=step_before,
        restart_s=round(t_up - t_restart, 1),
        restart_to_next_step_s=round(t_step - t_restart, 1),
        kill_to_next_step_s=round(t_step - t_kill, 1),
    )
    for other in ("api", "vllm", "env", "trainer"):
        if other not in names:  # the others recovered by themselves: same process, running
            proc = stack.procs[other]
            assert proc.pid == pid_before[other] and proc.alive(), tail(proc.log_path, 40)
    return out


def _log_text(stack: Stack, name: str) -> str:
    return "".join(
        (stack.tmp / f"{name}.{i}.log").read_text(errors="replace")
        for i in range(1, stack.starts[name] + 1)
    )


def _db_groups(db: Path) -> dict[str, tuple[str, int]]:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        rows = conn.execute("SELECT group_id, state, policy_version FROM groups").fetchall()
    return {gid: (state, version) for gid, state, version in rows}


def _db_batches(db: Path) -> tuple[dict[str, tuple[str, int, set[str]]], int]:
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


def _left_behind(sessions: list[int]) -> list[str]:
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


def test_kill9_each_service_in_turn(tiny_model_dir: Path, tmp_path: Path) -> None:
    t0 = time.monotonic()
    stack = Stack(tiny_model_dir, tmp_path)
    report: dict = {"kills": []}
    try:
        stack.start_api()
        # The env and the trainer first, while vLLM starts: they wait for it by themselves.
        stack.start_env()
        stack.start_trainer()
        stack.start_vllm()
        _wait(lambda: stack.last_step() >= 2, "the first two steps", *stack.procs.values())
        report["startup_to_step2_s"] = round(time.monotonic() - t0, 1)

        for names in KILLS:
            report["kills"].append(_kill_and_restart(stack, names))
            stack.check_alive()

        trainer = stack.procs["trainer"]
        try:
            _wait(
                lambda: not trainer.alive(),
                f"the trainer to finish {STEPS} steps",
                *[stack.procs[n] for n in ("api", "vllm", "env")],
            )
        except AssertionError as e:  # where the trainer waits: its stacks (SIGUSR1) and log
            if trainer.alive():
                os.kill(trainer.pid, signal.SIGUSR1)
                time.sleep(2)
            raise AssertionError(
                f"{e}\n--- trainer: {trainer.log_path}\n{tail(trainer.log_path, 80)}"
            ) from None
        assert trainer.popen.returncode == 0, tail(trainer.log_path, 60)
        stack.procs["env"].stop()  # no more pushes: the accounting below is final

        # -- the run reached its target; vLLM serves the trainer's final version ------------
        rows = stack.steps()
        steps = [r["step"] for r in rows]
        assert steps == sorted(set(steps)) and steps[-1] == STEPS, steps  # none logged twice
        assert all(r["policy_version"] == r["step"] for r in rows)
        assert max(r["staleness_max"] for r in rows) <= MAX_STALENESS
        assert stack.vllm_health()["weight_version"] == str(STEPS)
        client = ApiClient(stack.api_url, token=TOKEN)
        assert client.status().policy_version == STEPS

        # -- exactly once ------------------------------------------------------------------
        final = stack.save / "checkpoints" / f"step_{STEPS:06d}" / "trainer_state.json"
        lineage = json.loads(final.read_text())["recent_batches"]
        trained = [gid for b in lineage for gid in b["group_ids"]]
        db = _db_groups(stack.db)
        by_state = Counter(state for state, _ in db.values())
        acked = {gid for gid, (state, _) in db.items() if state == "acked"}
        pushed = [json.loads(x) for x in stack.env_metrics.read_text().splitlines()]
        pushed_ids = [
            r["group_id"] for r in pushed if r.get("kind") == "group" and r.get("pushed", True)
        ]
        assert len(trained) == len(set(trained)), "a group was trained twice"
        assert set(trained) == acked, "acked by the API != trained by the checkpoint lineage"
        assert set(pushed_ids) <= set(db), "a group the API acknowledged is not in its database"
        assert len(pushed_ids) == len(set(pushed_ids))
        # Every stored group is accounted for: trained, dropped as stale, or still waiting.
        assert set(by_state) <= {"acked", "dropped", "queued", "leased"}, by_state
        batches, ever_leased = _db_batches(stack.db)
        acked_batches = {b: gids for b, (state, _, gids) in batches.items() if state == "acked"}
        lineage_batches = {b["batch_id"]: set(b["group_ids"]) for b in lineage}
        # Every batch of the lineage is acked, holding only groups it trained (the DB keeps
        # each group's last batch); an acked batch outside the lineage is one re-served after
        # the trainer's crash whose groups the lineage had trained: acked, not trained again.
        assert set(lineage_batches) <= set(acked_batches), (acked_batches, lineage_batches)
        assert all(acked_batches[b] <= lineage_batches[b] for b in lineage_batches)
        acked_again = {b: g for b, g in acked_batches.items() if b not in lineage_batches}
        assert all(g <= set(trained) for g in acked_again.values()), acked_again

        # -- no NaN in the weights; vLLM serves exactly them ------------------------------
        final_model = final.parent / "model"
        weights = load_file(final_model / "model.safetensors")
        assert all(torch.isfinite(t).all() for t in weights.values()), "NaN/inf in the weights"
        hf = AutoModelForCausalLM.from_pretrained(final_model, dtype=torch.float32).eval()
        ids = AutoTokenizer.from_pretrained(final_model)(GREEDY_PROMPT)["input_ids"]
        served = stack.vllm.served_model_name
        got_ids, got_lp, header = vllm_greedy(stack.vllm_url, served, ids)
        assert header == str(STEPS)
        assert_greedy(hf, ids, got_ids, got_lp)  # the trained weights: a near-tie is a draw

        # -- who recovered by themselves --------------------------------------------------
        env_log, trainer_log = _log_text(stack, "env"), _log_text(stack, "trainer")
        assert "retry" in env_log  # the env retried the API and vLLM while they were down
        assert "re-syncing version" in trainer_log  # a vLLM restart, seen while idle
        kills = Counter(n for names in KILLS for n in names)
        assert kills == {"api": 2, "vllm": 2, "env": 2, "trainer": 1}
        report.update(
            steps=STEPS,
            groups_stored=len(db),
            groups_by_state=dict(by_state),
            groups_pushed_logged_by_env=len(pushed_ids),
            groups_trained=len(trained),
            groups_trained_twice=len(trained) - len(set(trained)),
            batches_trained=len(lineage),
            kill_counts=dict(kills),
            restarts={n: stack.starts[n] - 1 for n in ("api", "vllm", "env", "trainer")},
            batches_leased=len(batches),
            batches_acked=len(acked_batches),
            batches_acked_as_already_trained=len(acked_again),
            batches_by_state=dict(Counter(state for state, _, _ in batches.values())),
            groups_redelivered=sum(n for _, n, _ in batches.values()) - ever_leased,
            weights_finite=True,
            greedy_tokens_equal=len(got_ids),
            staleness_max=max(r["staleness_max"] for r in rows),
            versions_pushed=dict(
                Counter(
                    r["policy_version"]
                    for r in pushed
                    if r.get("kind") == "group" and r.get("pushed", True)
                )
            ),
            trainer_resync_lines=trainer_log.count("re-syncing"),
            trainer_sync_retries=trainer_log.count("weight sync of version"),
            trainer_api_retries=len(re.findall(r"API [A-Z]+ \S+ failed", trainer_log))
            + trainer_log.count("lease failed"),
            env_retries=env_log.count("retry"),
            total_s=round(time.monotonic() - t0, 1),
        )
    finally:
        stack.stop_all()
        left = _left_behind(stack.sessions)
        report["processes_left_behind"] = len(left)
        print("FAULT_TOLERANCE_REPORT " + json.dumps(report))
        out = os.environ.get("SHOP_R1_FT_REPORT")
        if out:
            Path(out).write_text(json.dumps(report, indent=1) + "\n")
    assert not left, f"processes outlived the test: {left}"
