"""trainer/agent_death.py: a torchrun rank asks to die with its parent (torchrun's agent), run
for real in child processes (the test's own process is never touched). The trainer under
torchrun itself: tests/integration/trainer/test_checkpoint_faults.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from launch.lifeline import is_running
from launch.procs import REPO_ROOT
from trainer.agent_death import AGENT_VAR, die_with_agent, started_by_agent

pytestmark = pytest.mark.unit
RANK = (
    "import sys, time\n"
    "from trainer import PARENT_AT_START\n"
    "from trainer.agent_death import die_with_agent\n"
    "print(die_with_agent(PARENT_AT_START if len(sys.argv) < 2 else int(sys.argv[1])), flush=True)\n"
    "time.sleep(600)\n"
)
"""A stand-in rank: asks, says whether it asked, then waits to be killed."""


def _env(agent: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != AGENT_VAR}
    return {**env, AGENT_VAR: "run-1"} if agent else env


def test_only_a_rank_started_by_torchrun_asks() -> None:
    assert started_by_agent({AGENT_VAR: "abc"})
    assert not started_by_agent({})
    assert not started_by_agent({"RANK": "0", "WORLD_SIZE": "2"})  # srun, a bridge: not ours
    assert die_with_agent(os.getppid(), {}) is False  # a no-op outside torchrun


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux only")
def test_a_rank_dies_with_its_parent() -> None:
    """A parent starts a rank (in a session of its own, as torchrun does) and is SIGKILLed:
    the rank goes too. Without the agent's variable it would not have asked, and stays."""
    parent_code = (
        "import subprocess, sys, time\n"
        f"p = subprocess.Popen([sys.executable, '-c', {RANK!r}], start_new_session=True,"
        " stdout=subprocess.PIPE, text=True)\n"
        "print(p.pid, p.stdout.readline().strip(), flush=True)\n"
        "time.sleep(600)\n"
    )
    ranks = {}
    for agent in (True, False):
        parent = subprocess.Popen(
            [sys.executable, "-c", parent_code],
            cwd=REPO_ROOT,
            env=_env(agent),
            stdout=subprocess.PIPE,
            text=True,
        )
        pid, asked = parent.stdout.readline().split()
        ranks[agent] = int(pid)
        assert asked == str(agent)
        parent.kill()
        parent.wait()
    try:
        deadline = time.monotonic() + 60  # it ends the loop as soon as the rank is gone
        while is_running(ranks[True]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not is_running(ranks[True]), "the rank outlived its parent"
        time.sleep(0.5)
        assert is_running(ranks[False])  # the premise: an orphan runs on by itself
    finally:
        for pid in ranks.values():
            if is_running(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux only")
def test_a_rank_whose_parent_is_already_gone_dies_at_once() -> None:
    """``parent`` is not its parent any more (torchrun died before the request): SIGKILL."""
    other = os.getppid()  # this test's parent: not the rank's (this test is)
    rank = subprocess.run(
        [sys.executable, "-c", RANK, str(other)],
        cwd=REPO_ROOT,
        env=_env(True),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert rank.returncode == -signal.SIGKILL, (rank.returncode, rank.stdout, rank.stderr)
