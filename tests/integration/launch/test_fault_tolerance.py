"""Fault tolerance of the whole stack on loopback: API + patched vLLM (``shared_vllm``, gloo) +
Shop-R1 environment service + GRPO trainer on the tiny model, SIGKILLed mid-run and restarted
with the same arguments (the trainer with ``--resume``): each in turn, then the API, vLLM and
the env a second time, together (their restarts overlap: the env's start-up waits out
vLLM's), while the resumed trainer runs (7 kills in 5 rounds, each service but the trainer
restarted twice). The services and the views of their stores: tests/integration/stack_harness.py.

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
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from api.client import ApiClient
from launch.procs import tail
from tests.integration.bridge_checks import assert_greedy, vllm_greedy
from tests.integration.stack_harness import (
    MAX_STALENESS,
    TOKEN,
    Stack,
    db_batches,
    db_groups,
    group_count,
    leased_batches,
    left_behind,
    wait_for,
)

pytestmark = pytest.mark.integration
STEPS = 18
"""Enough for every round at the latest steps the API's queue allows: a round that kills vLLM
first lets the trainer drain the queue, at most ``MAX_STALENESS + 1`` batches (the API's
backpressure), so the last kill lands by about step 15 at worst (step 10 in the measured run)."""
KILLS = (("api",), ("vllm",), ("env",), ("trainer",), ("api", "vllm", "env"))
"""Each service in turn, then the API, vLLM and the env together while the resumed trainer
runs (one restart of each, overlapping: the env's start-up waits out vLLM's)."""
GREEDY_PROMPT = "Click the search button to find running shoes"


def _trainer_idle(stack: Stack, client: ApiClient) -> bool:
    """Nothing left to lease and the last step fully synced: the trainer polls for data. A
    lease the killed trainer held does not count (it would keep the API's ``active_leases``
    up until it expires, ``--lease-seconds``: up to a minute of waiting for nothing)."""
    status = client.status()
    step = stack.last_step()
    return (
        status.queued_groups == 0
        and leased_batches(stack.db) <= stack.dead_leases
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
            before = group_count(stack.db)
            stored = before if _trainer_idle(stack, client) else -1
            return stored >= 0 and group_count(stack.db) == before

        wait_for(idle, "the trainer to drain the queue", trainer)
        run_id = stack.vllm_health()["run_id"]
    step_before = stack.last_step()
    assert step_before < STEPS - 1, "raise STEPS: the run ended before every kill was tried"
    pid_before = {n: p.pid for n, p in stack.procs.items()}
    t_kill = time.monotonic()
    for name in names:
        stack.procs[name].kill9()
    if "trainer" in names:  # what it held stays leased until the lease expires
        stack.dead_leases |= leased_batches(stack.db)
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
        t_synced = wait_for(
            lambda: int(stack.vllm_health()["weight_version"]) >= step_before,
            "vLLM weight version == trainer policy version",
            stack.procs["trainer"],
            stack.procs["env"],
            stack.procs["vllm"],
        )
        out["restart_to_resync_s"] = round(t_synced - t_restart, 1)
        if "env" not in names:  # paused, it sampled nothing meanwhile: no step either
            late = group_count(stack.db) - stored  # pushes sent before the SIGSTOP, stored late
            out["groups_stored_while_paused"] = late
            if late == 0:  # measured: with a late group the trainer may rightly train it
                assert stack.last_step() == step_before
            os.kill(env.pid, signal.SIGCONT)
    watch = [stack.procs["trainer"], stack.procs["env"]]
    t_step = wait_for(
        lambda: stack.last_step() > step_before, f"a trained step after {names}", *watch
    )
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


def test_kill9_each_service_in_turn(tiny_model_dir: Path, tmp_path: Path) -> None:
    t0 = time.monotonic()
    stack = Stack(tiny_model_dir, tmp_path, STEPS)
    report: dict = {"kills": []}
    try:
        stack.start_api()
        # The env and the trainer first, while vLLM starts: they wait for it by themselves.
        stack.start_env()
        stack.start_trainer()
        stack.start_vllm()
        wait_for(lambda: stack.last_step() >= 2, "the first two steps", *stack.procs.values())
        report["startup_to_step2_s"] = round(time.monotonic() - t0, 1)

        for names in KILLS:
            report["kills"].append(_kill_and_restart(stack, names))
            stack.check_alive()

        trainer = stack.procs["trainer"]
        try:
            wait_for(
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
        db = db_groups(stack.db)
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
        batches, ever_leased = db_batches(stack.db)
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
        env_log, trainer_log = stack.log_text("env"), stack.log_text("trainer")
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
        left = left_behind(stack.sessions)
        report["processes_left_behind"] = len(left)
        print("FAULT_TOLERANCE_REPORT " + json.dumps(report))
        out = os.environ.get("SHOP_R1_FT_REPORT")
        if out:
            Path(out).write_text(json.dumps(report, indent=1) + "\n")
    assert not left, f"processes outlived the test: {left}"
