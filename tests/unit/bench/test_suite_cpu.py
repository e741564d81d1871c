"""bench.suite.cpu_by_process: how a command line maps to a kind of process, and that a
child's CPU time is counted under its kind (the child burns a known amount of CPU, then
waits until the sampler has read its total before it exits)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import bench.suite.cpu_by_process as cpu_by_process
from bench.suite.cpu_by_process import kind_of, main, measure

pytestmark = pytest.mark.unit

BURN_S = 1.0


@pytest.mark.parametrize(
    ("cmdline", "name", "kind"),
    [
        ([], "kswapd0", "kernel threads"),
        (["python", "-m", "vllm_patching.serve", "--model", "m"], "python", "vLLM API server"),
        (["VLLM::EngineCore"], "VLLM::EngineCore", "vLLM engine core"),
        (
            ["python", "-m", "env_server.evaluate", "--out-dir", "run/trainer"],
            "python",
            "evaluation",
        ),
        (
            ["python", "-m", "env_server.verifiers", "--config", "c"],
            "python",
            "verifiers env service",
        ),
        (["python", "-m", "trainer", "grpo", "--config", "x"], "python", "trainer"),
        (["python", "-m", "api", "--port", "1"], "python", "batching API"),
        (
            ["python", "-u", "-c", "import sys;exec(eval(sys.stdin.readline()))"],
            "python",
            "pytest workers (the tests' own code)",
        ),
        (["/usr/bin/sleep", "5"], "sleep", "other: sleep"),
        (  # the template's preloads name vLLM: it is the template, not a server
            [
                "python",
                "-B",
                "-c",
                "from multiprocessing.forkserver import main; main(3, 5, "
                "['vllm.entrypoints.openai.api_server', 'vllm_patching.serve'])",
            ],
            "python",
            "forked-server template",
        ),
    ],
)
def test_kind_of(cmdline: list[str], name: str, kind: str) -> None:
    assert kind_of(cmdline, name) == kind


def _tell_when_sampled(monkeypatch: pytest.MonkeyPatch, flag: Path, marker: str, kind: str):
    """The measured child's code that waits (bounded) until the sampler has read its whole
    burn under ``kind``: the sampler then writes ``flag`` (not a sleep a stalled box outlasts)."""
    real = cpu_by_process.sample

    def sample(procs: dict, before: bool = False) -> None:
        real(procs, before)
        if any(
            marker in p["cmd"] and p["kind"] == kind and p["used"] >= BURN_S for p in procs.values()
        ):
            flag.touch()

    monkeypatch.setattr(cpu_by_process, "sample", sample)
    # the flag's path by the environment: a pytest tmp path in its command line would change
    # the child's kind
    monkeypatch.setenv("SAMPLED_FLAG", str(flag))
    return (
        "import os\n"
        "end = time.monotonic() + 120\n"
        "while not os.path.exists(os.environ['SAMPLED_FLAG']) and time.monotonic() < end:\n"
        "    time.sleep(0.05)\n"
    )


def test_a_childs_cpu_is_counted_under_its_kind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kind = f"other: {Path(sys.executable).name}"
    wait = _tell_when_sampled(monkeypatch, tmp_path / "sampled", "the-burning-child", kind)
    code = (
        "import time  # the-burning-child\n"
        f"while time.process_time() < {BURN_S}: pass\n"  # at least BURN_S of its own CPU
        + wait  # until the sampler has read the total
    )
    result = measure([sys.executable, "-c", code], tmp_path / "child.log", interval=0.1)
    assert result["exit_code"] == 0
    # every process on the box is sampled (a suite's reparented orphans too): find ours
    (child,) = [p for p in result["processes"] if "the-burning-child" in p["cmd"]]
    assert child["kind"] == kind
    assert child["cpu_s"] >= BURN_S, child
    assert result["kinds"][child["kind"]]["cpu_s"] >= child["cpu_s"]
    assert result["busy_cpu_s"] >= child["cpu_s"] - 0.05  # the box was busy at least that long


def test_main_writes_the_result_and_fails_with_the_command(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    assert (
        main(["--out", str(out), "--interval", "0.2", "--", sys.executable, "-c", "exit(3)"]) == 1
    )
    assert json.loads(out.read_text())["exit_code"] == 3


def test_a_process_that_renames_itself_counts_under_its_new_kind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fork of the template starts with the template's command line and then sets its own
    (setproctitle, launch/forked.py): the last command line seen decides its kind."""
    pytest.importorskip("setproctitle")
    wait = _tell_when_sampled(monkeypatch, tmp_path / "sampled", "--renamed-child", "trainer")
    code = (
        "import time, setproctitle\n"
        "time.sleep(1.0)  # sampled under its first command line\n"
        "setproctitle.setproctitle('python -m trainer grpo --renamed-child')\n"
        f"while time.process_time() < {BURN_S}: pass\n" + wait
    )
    result = measure([sys.executable, "-c", code], tmp_path / "child.log", interval=0.1)
    (child,) = [p for p in result["processes"] if "--renamed-child" in p["cmd"]]
    assert child["kind"] == "trainer" and child["cpu_s"] >= BURN_S
