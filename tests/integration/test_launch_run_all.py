"""launch/run_all.sh end to end on the CPU preset with a tiny budget, in every bridge mode
(shared_vllm runs with two inference servers), in one isolated artifacts folder shared by the
session (the fixture builds the tiny model, the dataset and a 3-step SFT once, through
``--prepare-only``); plus a service that will not start, and Ctrl-C.

Each run: the services start in order and log, the trainer syncs its weights into every vLLM
server (the weight version advances with every step), and every process it started is gone
afterwards (checked by the PIDs it recorded). One run also writes the evaluation table, and
checks what a user sees: the console's progress of every phase, the rollout samples and the
run's page (report.html) in a real headless Chromium.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from launch.procs import REPO_ROOT, free_port

pytestmark = pytest.mark.integration
STEPS = 2
RUN_ALL = str(REPO_ROOT / "launch" / "run_all.sh")


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _stop_recorded(run_dir: Path) -> None:
    """SIGKILL the process group of every PID the launcher recorded (its services each run
    in their own group), so a failed test leaves nothing running."""
    try:
        pids = json.loads((run_dir / "pids.json").read_text())
    except (OSError, ValueError):
        return
    for p in pids.values():
        try:
            os.killpg(p["pid"], signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


@pytest.fixture(scope="session")
def artifacts_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """SHOP_R1_ARTIFACTS with the tiny model, a small dataset and a 3-step SFT, built once."""
    root = tmp_path_factory.mktemp("run_all")
    env = dict(os.environ, SHOP_R1_ARTIFACTS=str(root / "artifacts"), SHOP_R1_PROGRESS_INTERVAL="5")
    for name in ("NUM_INFERENCE_NODES", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)  # the runs below set what they test
    prep = root / "prepare"
    argv = [RUN_ALL, "--prepare-only", "--sft-steps", "3", "--num-sessions", "200",
            "--run-dir", str(prep)]  # fmt: skip
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    phases = ["build tiny model done", "build dataset done", "SFT done | 3/3 steps"]
    for phase in phases:
        assert f"[run_all] {phase}" in done.stdout, done.stdout[-4000:]
    assert (prep / "sft.log").stat().st_size > 0
    assert (root / "artifacts" / "models" / "tiny-qwen2-sft" / "model.safetensors").exists()
    return env


def run_all(run_dir: Path, env: dict[str, str], *args: str) -> str:
    argv = [RUN_ALL, "--steps", str(STEPS), "--keep-constant-groups", "--run-dir", str(run_dir),
            *args]  # fmt: skip
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    return out


def check_run(run_dir: Path, out: str, vllm: list[str]) -> None:
    """Every service logged, the weights advanced on every server, nothing left running."""
    names = ["api", *vllm, "env", "trainer"]
    assert "tail -f " + " ".join(str(run_dir / f"{n}.log") for n in names) in out
    for name in names:
        assert (run_dir / f"{name}.log").stat().st_size > 0, name
    api_log = (run_dir / "api.log").read_text()
    assert "Uvicorn running" in api_log or "startup" in api_log.lower()
    for name in vllm:
        assert "[bridge] mode=" in (run_dir / f"{name}.log").read_text(), name

    rows = [json.loads(x) for x in (run_dir / "trainer" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert rows[-1]["policy_version"] == STEPS  # one version per optimizer step
    versions = json.loads((run_dir / "weight_versions.json").read_text())
    assert versions == {name: str(STEPS) for name in vllm}  # every server serves the last one

    pids = json.loads((run_dir / "pids.json").read_text())
    assert set(pids) == set(names)
    assert not any(p["alive"] for p in pids.values()), pids
    assert all(_gone(p["pid"]) for p in pids.values()), pids
    assert "[run_all] stopped" in out


@pytest.mark.parametrize(
    "flags",
    [
        pytest.param(["--weight-bridge-mode", "shared_vllm", "--single-copy"], id="single_copy"),
        pytest.param(["--weight-bridge-mode", "lora_only"], id="lora_only"),
        pytest.param(["--weight-bridge-mode", "none"], id="none"),
    ],
)
def test_run_all_bridge_modes(
    artifacts_env: dict[str, str], tmp_path: Path, flags: list[str]
) -> None:
    run_dir = tmp_path / "run"
    out = run_all(run_dir, artifacts_env, *flags, "--eval-samples", "0")
    check_run(run_dir, out, ["vllm"])
    if "--single-copy" in flags:
        assert "backend=shm" in (run_dir / "vllm.log").read_text()
    if "lora_only" in flags:  # the adapters the trainer handed to vLLM, one per version
        assert (run_dir / "trainer" / "bridge" / f"v{STEPS}").is_dir()


def test_run_all_two_inference_servers(artifacts_env: dict[str, str], tmp_path: Path) -> None:
    """shared_vllm (gloo broadcast) and the CPU proof of the multi-server path:
    NUM_INFERENCE_NODES=2 starts two vLLM servers, the env spreads rollouts over both, one
    trainer broadcast (rendezvous pinned by MASTER_ADDR/MASTER_PORT) feeds both; then the
    SFT-vs-RL evaluation table and the reward curve."""
    run_dir = tmp_path / "run"
    port = free_port()
    env = dict(artifacts_env, NUM_INFERENCE_NODES="2", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port))  # fmt: skip
    out = run_all(run_dir, env, "--weight-bridge-mode", "shared_vllm", "--eval-samples", "4")
    check_run(run_dir, out, ["vllm", "vllm1"])
    for name in ("vllm", "vllm1"):
        assert "backend=gloo_bcast" in (run_dir / f"{name}.log").read_text()
    trainer_log = (run_dir / "trainer.log").read_text()
    assert f"weight broadcast group at 127.0.0.1:{port}, 3 ranks" in trainer_log
    line = next(
        x for x in (run_dir / "env.log").read_text().splitlines() if "requests per server" in x
    )
    per_server = json.loads(line.split("requests per server: ", 1)[1].replace("'", '"'))
    assert len(per_server) == 2 and all(n > 0 for n in per_server.values()), line

    table = (run_dir / "eval.md").read_text()
    for label in ("exact match", "type accuracy", "macro-F1", "format rate", "mean reward"):
        assert f"| {label}" in table
    assert f"weight version {STEPS}" in table  # RL = the trainer's final weights
    for split in ("sft", "rl"):
        assert json.loads((run_dir / f"eval_{split}" / "metrics.json").read_text())["n"] == 4
    assert (run_dir / "reward_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    check_what_the_user_sees(run_dir, out, tmp_path)


def check_what_the_user_sees(run_dir: Path, out: str, tmp_path: Path) -> None:
    """Plain progress lines of every phase (the output is a pipe), rollout samples in
    rollouts.jsonl and TensorBoard, and the run's page rendered by Chromium."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tests.browser import check_report_screenshot, dom, screenshot

    assert "\r" not in out
    done = [
        "start API + vLLM done | 3/3 up (100%)",
        "evaluate SFT done | 4/4 rows",
        f"GRPO done | {STEPS}/{STEPS} steps (100%) | reward ",
        "evaluate RL done | 4/4 rows",
    ]
    for line in done:
        assert f"[run_all] {line}" in out, out[-4000:]
    rows = [
        json.loads(x) for x in (run_dir / "trainer" / "rollouts.jsonl").read_text().splitlines()
    ]
    assert sorted({r["step"] for r in rows}) == list(range(1, STEPS + 1))
    for r in rows:  # what the env's reward saw travelled with the group
        assert r["completion"] and r["prompt_tail"] and r["gold_action"]["type"]
        assert sum(r["reward"].values()) == pytest.approx(r["score"], abs=1e-6)
    events = EventAccumulator(str(run_dir / "trainer" / "tb"), size_guidance={"tensors": 0})
    texts = events.Reload().Tensors("rollouts/text_summary")
    assert [e.step for e in texts] == list(range(1, STEPS + 1))

    page = run_dir / "report.html"
    assert f"[run_all] the run's page: {page}" in out
    check_report_screenshot(screenshot(page, tmp_path / "report.png"))
    assert f'data-ready="{len(rows)}"' in dom(page)


def test_run_all_names_the_log_of_a_service_that_will_not_start(
    artifacts_env: dict[str, str], tmp_path: Path
) -> None:
    """vLLM cannot load the model: a clear failure naming vllm.log, nothing left running."""
    run_dir = tmp_path / "run"
    argv = [RUN_ALL, "--model", str(tmp_path / "no-such-model"), "--run-dir", str(run_dir),
            "--eval-samples", "0", "--health-timeout", "300"]  # fmt: skip
    done = subprocess.run(argv, env=artifacts_env, capture_output=True, text=True, timeout=400)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out[-4000:]
    assert "[run_all] FAILED: vllm did not come up: vllm exited with" in out
    assert f"read {run_dir / 'vllm.log'}" in out
    pids = json.loads((run_dir / "pids.json").read_text())
    assert set(pids) == {"api", "vllm"}  # the env and the trainer were never started
    assert all(_gone(p["pid"]) for p in pids.values()), pids


def test_run_all_ctrl_c_stops_what_it_started(
    artifacts_env: dict[str, str], tmp_path: Path
) -> None:
    """SIGINT while vLLM starts: exit 130, every recorded PID gone."""
    run_dir = tmp_path / "run"
    argv = [RUN_ALL, "--run-dir", str(run_dir), "--eval-samples", "0"]
    proc = subprocess.Popen(argv, env=artifacts_env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if "vllm" in json.loads((run_dir / "pids.json").read_text()):
                    break
            except (OSError, ValueError):  # not written yet, or caught mid-write
                pass
            time.sleep(0.5)
        else:
            pytest.fail("the launcher never started vLLM")
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:  # the launcher ignored SIGINT: clean up what it started
            proc.kill()
            _stop_recorded(run_dir)
    assert proc.returncode == 130, out[-4000:]
    assert "interrupted; stopping the services" in out
    pids = json.loads((run_dir / "pids.json").read_text())
    assert {"api", "vllm"} <= set(pids)
    assert all(_gone(p["pid"]) for p in pids.values()), pids
