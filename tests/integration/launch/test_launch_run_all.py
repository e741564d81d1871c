"""launch/run_all.sh end to end on the CPU preset with a tiny budget, in one isolated
artifacts folder shared by the session (the fixture builds the tiny model, the dataset and a
3-step SFT once, through ``--prepare-only``): shared_vllm with one weight copy; plus a service
that will not start, Ctrl-C, and a launcher that is SIGKILLed (nothing it started outlives
it; the first case also checks that a one-process trainer pins shared_vllm's broadcast
rendezvous to ``MASTER_ADDR``/``MASTER_PORT``). The other bridge modes run under the launcher
in the modules that share this fixture: shared_vllm's broadcast to two inference servers and
``lora_only``, both with two trainer ranks (test_launch_fsdp.py), ``none`` in the OOM-killed
run and its resumed relaunch (test_launch_oom.py); every one of those runs ends with
``check_run``.

Each run: the services start in order and log, the trainer syncs its weights into every vLLM
server (the weight version advances with every step), and every process it started is gone
afterwards (checked by the PIDs it recorded). The two-server run also writes the evaluation
table, and checks what a user sees (``check_what_the_user_sees``): the console's progress of
every phase, the rollout samples and the run's page (report.html) in a real headless Chromium.

The runs are the preset's with 2 GRPO steps of 2 groups of 4 (``artifacts_env``: the
environment layer of the run's config, ``SHOP_R1_ENV__GROUP_SIZE`` and
``SHOP_R1_TRAINER__GRPO__BATCH_SIZE``) instead of 4 groups of 8: they check the plumbing, and
a quarter of the rollouts and training cut ~8 CPU-s a run. The launcher is waited on by its
progress, not by one wall-clock budget (tests/integration/launcher_harness.py), and cleaned up
however a test ends.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from launch.lifeline import descendants, is_running
from settings.ports import free_port
from tests.integration.launcher_harness import LauncherRun, gone, start_launcher

pytestmark = pytest.mark.integration
STEPS = 2
WARNING_LINE = re.compile(r"^.+:\d+: \w*Warning: .*$", re.MULTILINE)
"""A line Python's ``warnings`` printed: ``<frozen runpy>:128: RuntimeWarning: ...``."""


@pytest.fixture(scope="session")
def artifacts_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """SHOP_R1_ARTIFACTS with the tiny model, a small dataset and a 3-step SFT, built once per
    pytest run: under pytest-xdist the workers share one folder in the run's common temporary
    root, built by the first worker that asks while the others wait on a file lock (the three
    launcher modules each built their own, ~90 s apiece, when they ran on different workers).
    A launcher run only reads it (``launch/prepare.py`` builds what is missing, and nothing is
    missing after the preparation)."""
    import fcntl

    if os.environ.get("PYTEST_XDIST_WORKER"):  # the run's root: shared by its workers
        root = tmp_path_factory.getbasetemp().parent / "run_all_shared"
    else:
        root = tmp_path_factory.mktemp("run_all")
    root.mkdir(exist_ok=True)
    env = dict(os.environ, SHOP_R1_ARTIFACTS=str(root / "artifacts"), SHOP_R1_PROGRESS_INTERVAL="5")
    # 2 groups of 4 a step (the module docstring), through the run config's environment layer
    env |= {"SHOP_R1_ENV__GROUP_SIZE": "4", "SHOP_R1_TRAINER__GRPO__BATCH_SIZE": "8"}
    for name in ("NUM_INFERENCE_NODES", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)  # the runs below set what they test
    with (root / ".prepare.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (root / ".prepared").exists():
            _prepare(root, env)
            (root / ".prepared").touch()
    return env


def _prepare(root: Path, env: dict[str, str]) -> None:
    """``run_all.sh --prepare-only`` into ``root``: the tiny model, the dataset, 3 SFT steps
    (its run folder named by this process: a worker after one that failed tries afresh)."""
    prep = root / f"prepare-{os.getpid()}"
    run = start_launcher(prep, env, "--prepare-only", "--sft-steps", "3", "--num-sessions", "200")
    try:
        assert run.wait() == 0, run.tails()
    finally:
        run.cleanup()
    phases = ["build tiny model done", "build dataset done", "SFT done | 3/3 steps"]
    for phase in phases:
        assert f"[run_all] {phase}" in run.output(), run.output()[-4000:]
    assert (prep / "sft.log").stat().st_size > 0
    assert (root / "artifacts" / "models" / "tiny-qwen2-sft" / "model.safetensors").exists()


@pytest.fixture
def launcher() -> Iterator[Callable[..., LauncherRun]]:
    """``launcher(run_dir, env, *args)`` starts ``run_all.sh``; however the test ends, every
    launcher it started and every process group they recorded in pids.json is gone after."""
    runs: list[LauncherRun] = []

    def start(run_dir: Path, env: dict[str, str], *args: str) -> LauncherRun:
        runs.append(start_launcher(run_dir, env, *args))
        return runs[-1]

    try:
        yield start
    finally:
        for run in runs:
            run.cleanup()


def run_all(
    launcher: Callable[..., LauncherRun], run_dir: Path, env: dict[str, str], *args: str
) -> str:
    run = launcher(run_dir, env, "--training-steps", str(STEPS), "--keep-constant-groups", *args)
    assert run.wait() == 0, run.tails()
    return run.output()


def check_run(
    run_dir: Path,
    out: str,
    vllm: list[str],
    steps: int = STEPS,
    resumed: bool = False,
    eval_servers: tuple[str, ...] = (),
) -> None:
    """Every service logged, the weights advanced on every server (to version ``steps``, one
    per optimizer step), nothing left running. A ``resumed`` run's metrics also hold the steps
    its first launch logged after its last checkpoint, logged again after the resume.
    ``eval_servers``: the evaluations' own vLLM servers (``--eval-server own``)."""
    names = ["api", *vllm, "env", "trainer"]
    assert "tail -f " + " ".join(str(run_dir / f"{n}.log") for n in names) in out
    for name in names:
        assert (run_dir / f"{name}.log").stat().st_size > 0, name
    api_log = (run_dir / "api.log").read_text()
    assert "Uvicorn running" in api_log or "startup" in api_log.lower()
    for name in vllm:
        assert "[bridge] mode=" in (run_dir / f"{name}.log").read_text(), name

    rows = [json.loads(x) for x in (run_dir / "trainer" / "metrics.jsonl").read_text().splitlines()]
    logged = [r["step"] for r in rows]
    assert (sorted(set(logged)) if resumed else logged) == list(range(1, steps + 1)), logged
    assert rows[-1]["step"] == steps and rows[-1]["policy_version"] == steps  # a version a step
    versions = json.loads((run_dir / "weight_versions.json").read_text())
    assert versions == {name: str(steps) for name in vllm}  # every server serves the last one

    pids = json.loads((run_dir / "pids.json").read_text())
    assert set(pids) == {*names, *eval_servers}
    assert not any(p["alive"] for p in pids.values()), pids
    assert all(gone(p["pid"]) for p in pids.values()), pids
    assert "[run_all] stopped" in out
    assert "[run_all] threads on " in out  # the thread plan is logged
    # the terminal shows the run's lines, not Python's warnings (runpy warned in every forked
    # child that the launcher's module, preloaded by the template, was already imported)
    assert not WARNING_LINE.findall(out), WARNING_LINE.findall(out)


def test_run_all_single_copy(
    artifacts_env: dict[str, str], launcher: Callable[..., LauncherRun], tmp_path: Path
) -> None:
    """shared_vllm with one weight copy: the server and the trainer share the weights' memory."""
    run_dir = tmp_path / "run"
    flags = ["--weight-bridge-mode", "shared_vllm", "--single-copy", "--eval-samples", "0"]
    out = run_all(launcher, run_dir, artifacts_env, *flags)
    check_run(run_dir, out, ["vllm"])
    assert "backend=shm" in (run_dir / "vllm.log").read_text()


def check_what_the_user_sees(run_dir: Path, out: str, tmp_path: Path, samples: int) -> None:
    """Plain progress lines of every phase (the output is a pipe), rollout samples in
    rollouts.jsonl and TensorBoard, and the run's page rendered by Chromium."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tests.browser import check_report_screenshot, dom, screenshot

    assert "\r" not in out
    done = [
        "start API + vLLM done | 3/3 up (100%)",
        f"evaluate SFT done | {samples}/{samples} rows",
        f"GRPO done | {STEPS}/{STEPS} steps (100%) | reward ",
        f"evaluate RL done | {samples}/{samples} rows",
    ]
    for line in done:
        assert f"[run_all] {line}" in out, out[-4000:]
    rows = [
        json.loads(x) for x in (run_dir / "trainer" / "rollouts.jsonl").read_text().splitlines()
    ]
    assert sorted({r["step"] for r in rows}) == list(range(1, STEPS + 1))
    for r in rows:  # what the env's reward saw travelled with the group (a sampled
        # completion may be empty: EOS first)
        assert isinstance(r["completion"], str) and r["prompt_tail"] and r["gold_action"]["type"]
        assert sum(r["reward"].values()) == pytest.approx(r["score"], abs=1e-6)
    assert any(r["completion"] for r in rows)
    events = EventAccumulator(str(run_dir / "trainer" / "tb"), size_guidance={"tensors": 0})
    texts = events.Reload().Tensors("rollouts/text_summary")
    assert [e.step for e in texts] == list(range(1, STEPS + 1))

    page = run_dir / "report.html"
    assert f"[run_all] the run's page: {page}" in out
    check_report_screenshot(screenshot(page, tmp_path / "report.png"))
    assert f'data-ready="{len(rows)}"' in dom(page)


def test_run_all_names_the_log_of_a_service_that_will_not_start(
    artifacts_env: dict[str, str], launcher: Callable[..., LauncherRun], tmp_path: Path
) -> None:
    """The vLLM server refuses the model (a path that does not exist, said before vLLM is
    imported): a clear failure naming vllm.log and what it says, nothing left running."""
    run_dir = tmp_path / "run"
    run = launcher(
        run_dir,
        artifacts_env,
        "--model",
        str(tmp_path / "no-such-model"),
        "--eval-samples",
        "0",
        "--health-timeout",
        "300",
    )
    out = run.output() if run.wait() == 1 else pytest.fail(run.tails())
    assert "[run_all] FAILED: vllm did not come up: vllm exited with" in out
    assert f"read {run_dir / 'vllm.log'}" in out
    assert f"--model {tmp_path / 'no-such-model'}: no such file or directory" in out
    pids = json.loads((run_dir / "pids.json").read_text())
    assert set(pids) == {"api", "vllm"}  # the env and the trainer were never started
    assert all(gone(p["pid"]) for p in pids.values()), pids


def test_run_all_ctrl_c_stops_what_it_started(
    artifacts_env: dict[str, str], launcher: Callable[..., LauncherRun], tmp_path: Path
) -> None:
    """SIGINT while vLLM starts: exit 130, every recorded PID gone."""
    run_dir = tmp_path / "run"
    run = launcher(run_dir, artifacts_env, "--eval-samples", "0")
    run.wait_until(lambda: "vllm" in run.pids(), "the launcher to start vLLM")
    run.proc.send_signal(signal.SIGINT)
    assert run.wait() == 130, run.tails()
    assert "interrupted; stopping the services" in run.output()
    pids = run.pids()
    assert {"api", "vllm"} <= set(pids)
    assert all(gone(p["pid"]) for p in pids.values()), pids


SERVICES = ("api", "vllm", "env", "trainer")


def _all_four_run(run: LauncherRun) -> bool:
    """Every service recorded and running, vLLM with its engine core under it, and the
    trainer past its start-up (its log has lines)."""
    pids = run.pids()
    if set(pids) != set(SERVICES) or not all(is_running(pids[n]["pid"]) for n in SERVICES):
        return False
    trainer_log = run.run_dir / "trainer.log"
    return (
        bool(descendants(pids["vllm"]["pid"]))
        and trainer_log.exists()
        and (trainer_log.stat().st_size > 0)
    )


@pytest.mark.parametrize(
    "victim",
    [
        pytest.param("launcher", id="sigkill_run_all_sh"),
        pytest.param("group", id="sigkill_launcher_process_group"),
    ],
)
def test_run_all_sigkilled_leaves_no_process_behind(
    artifacts_env: dict[str, str],
    launcher: Callable[..., LauncherRun],
    tmp_path: Path,
    victim: str,
) -> None:
    """SIGKILL of ``run_all.sh`` (it execs the launcher: same PID) -- or of the launcher's
    whole process group, as a CI job timeout or a closed terminal does -- once all four
    services run: every process under the launcher (the services, vLLM's engine core and
    worker, the reaper itself) is gone soon after, and the reaper said so in the logs."""
    run_dir = tmp_path / "run"
    env, pinned = dict(artifacts_env), None
    if victim == "launcher":  # and the rendezvous pin a one-process trainer takes from these
        port = free_port()
        env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        pinned = f"weight broadcast group at 127.0.0.1:{port}, 2 ranks"
    run = launcher(
        run_dir,
        env,
        "--training-steps",
        "1000",
        "--eval-samples",
        "0",
        "--keep-constant-groups",
    )
    run.wait_until(lambda: _all_four_run(run), "all four services to run")
    if pinned is not None:  # shared_vllm's broadcast group, at MASTER_ADDR/MASTER_PORT
        trainer_log = run_dir / "trainer.log"
        run.wait_until(lambda: pinned in trainer_log.read_text(), "the first weight broadcast")
    pids = run.pids()
    tree = descendants(run.pid)
    in_tree = {p.pid for p in tree}
    assert {p["pid"] for p in pids.values()} <= in_tree, (pids, tree)
    vllm_children = [p for p in tree if p.ppid == pids["vllm"]["pid"]]
    assert vllm_children, "vLLM has no child process (engine core) to check"

    if victim == "launcher":
        os.kill(run.pid, signal.SIGKILL)
    else:
        os.killpg(run.pid, signal.SIGKILL)  # the launcher leads its own session (harness)
    run.proc.wait()

    def left() -> list[str]:
        return [f"{p.pid} (parent {p.ppid})" for p in tree if is_running(p.pid, p.starttime)]

    # Generous: the reaper waits up to 5 s between SIGTERM and SIGKILL; the box may be busy.
    deadline = time.monotonic() + 120
    while left() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left(), f"outlived the launcher: {left()}\n{run.tails()}"
    for name in SERVICES:
        text = (run_dir / f"{name}.log").read_text(errors="replace")
        assert f"[lifeline] pid {run.pid}, which started {name}, is gone" in text, name
