"""``launch/run_all.sh``: the four services together (API -> vLLM -> env -> trainer), then
the SFT-vs-RL evaluation table and the reward curve.

    launch/run_all.sh                                  # cpu-tiny, shared_vllm, 20 GRPO steps
    launch/run_all.sh --weight-bridge-mode none --steps 5 --run-dir runs/try

Every process is a ``ManagedProcess`` (own process group, own log under the run dir) and is
stopped by its PID on Ctrl-C / SIGTERM, when a service dies, or when the trainer is done.
"""

from __future__ import annotations

import argparse
import json
import secrets
import signal
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Literal

import httpx
from pydantic import BaseModel, Field

from launch.paths import DATA_DIR, RUNS_DIR, SFT_MODEL_DIR, TINY_MODEL_DIR
from launch.presets import PRESETS, Preset
from launch.procs import ManagedProcess, free_port, tail

PY = sys.executable
METRICS = [
    ("exact_match", "exact match"),
    ("type_accuracy", "type accuracy"),
    ("macro_f1", "macro-F1"),
    ("format_rate", "format rate"),
    ("mean_reward", "mean reward"),
]


class RunAllConfig(BaseModel):
    """Options of launch/run_all.sh."""

    preset: Literal["cpu-tiny", "gpu-0.5b", "gpu-3b"] = Field(
        "cpu-tiny", description="Model/device preset (launch/presets.py)."
    )
    model: str | None = Field(None, description="Override the preset's model (dir or hub id).")
    weight_bridge_mode: Literal["shared_vllm", "lora_only", "none"] = Field(
        "shared_vllm", description="How trainer weights reach vLLM (docs/BRIDGE.md)."
    )
    single_copy: bool = Field(False, description="shared_vllm: one weight copy in shared memory.")
    steps: int = Field(20, ge=1, description="GRPO training steps.")
    sft_steps: int | None = Field(
        None, ge=1, description="SFT steps if SFT must run (default: trainer's)."
    )
    num_sessions: int | None = Field(
        None,
        ge=10,
        description="Sessions to simulate if the dataset is missing (default: builder's).",
    )
    keep_constant_groups: bool = Field(
        False, description="Keep groups whose rewards are all equal (zero advantage)."
    )
    eval_samples: int = Field(64, ge=0, description="Test-split steps to evaluate (0: skip).")
    run_dir: Path | None = Field(None, description="Run directory (default runs/<timestamp>).")
    api_port: int | None = Field(None, description="API port (default: a free one).")
    vllm_port: int | None = Field(None, description="vLLM port (default: a free one).")
    health_timeout: float = Field(600.0, description="Seconds to wait for each health check.")


def parse_args(argv: list[str] | None = None) -> RunAllConfig:
    p = argparse.ArgumentParser(prog="launch/run_all.sh", description=__doc__.split("\n\n")[0])
    for name, field in RunAllConfig.model_fields.items():
        flag = "--" + name.replace("_", "-")
        if field.annotation is bool:
            p.add_argument(flag, action="store_true", help=field.description)
        else:
            p.add_argument(flag, default=None, help=field.description)
    given = {k: v for k, v in vars(p.parse_args(argv)).items() if v not in (None, False)}
    return RunAllConfig(**given)


class ServiceFailed(RuntimeError):
    """A service did not come up or died; the message names the log to read."""


class Stack:
    """The processes this launcher started, in start order; stopped in reverse order."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.procs: list[ManagedProcess] = []

    def add(self, proc: ManagedProcess) -> ManagedProcess:
        self.procs.append(proc)
        self.write_pids()
        return proc

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None):
        return self.add(ManagedProcess(name, argv, self.run_dir / f"{name}.log", env=env).start())

    def check_alive(self, *names: str) -> None:
        for p in self.procs:
            if p.name in names and not p.alive():
                raise ServiceFailed(
                    f"{p.name} died (exit {p.popen.returncode}); read {p.log_path}:\n"
                    f"{tail(p.log_path, 20)}"
                )

    def stop(self, name: str) -> None:
        for p in self.procs:
            if p.name == name:
                p.stop()
        self.write_pids()

    def stop_all(self) -> None:
        for p in reversed(self.procs):
            p.stop()
        self.write_pids()

    def write_pids(self) -> None:
        pids = {
            p.name: {"pid": p.pid, "alive": p.alive(), "log": str(p.log_path)} for p in self.procs
        }
        (self.run_dir / "pids.json").write_text(json.dumps(pids, indent=2) + "\n")


def _raise_interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def run_step(name: str, argv: list[str], log: Path) -> None:
    """A preparation command in the foreground (stopped by PID if we are interrupted)."""
    print(f"[run_all] {name}: {' '.join(argv[1:])}  (log: {log})", flush=True)
    proc = ManagedProcess(name, argv, log).start()
    try:
        rc = proc.popen.wait()
    finally:
        proc.stop()
    if rc != 0:
        raise ServiceFailed(f"{name} failed (exit {rc}); read {log}:\n{tail(log, 20)}")


def prepare_embedded(cfg: RunAllConfig, run_dir: Path) -> None:
    """Tiny model, dataset and SFT cold start, each only if missing."""
    if not (TINY_MODEL_DIR / "config.json").exists():
        run_step("tiny_model", [PY, "-m", "trainer.tiny_model"], run_dir / "tiny_model.log")
    if not (DATA_DIR / "test.jsonl").exists():
        argv = [PY, "-m", "env_server.data", "build", "--out", str(DATA_DIR)]
        if cfg.num_sessions:
            argv += ["--num-sessions", str(cfg.num_sessions)]
        run_step("dataset", argv, run_dir / "dataset.log")
    if not (SFT_MODEL_DIR / "model.safetensors").exists():
        # An interrupted SFT left checkpoints: continue it rather than start over.
        resume = (SFT_MODEL_DIR / "checkpoints").is_dir()
        # --eval-generate 0: the launcher measures the SFT model itself, with vLLM (much faster).
        argv = [PY, "-m", "trainer", "sft", "--model-name", str(TINY_MODEL_DIR),
                "--save-path", str(SFT_MODEL_DIR), "--data-dir", str(DATA_DIR),
                "--no-tensorboard", "--eval-generate", "0",
                "--resume" if resume else "--overwrite"]  # fmt: skip
        if cfg.sft_steps:
            argv += ["--training-steps", str(cfg.sft_steps)]
        run_step("sft", argv, run_dir / "sft.log")


def wait_http(proc: ManagedProcess, url: str, timeout: float) -> None:
    try:
        proc.wait_http(url, timeout=timeout)
    except (RuntimeError, TimeoutError) as e:
        raise ServiceFailed(str(e)) from e


def evaluate(label: str, vllm_url: str, cfg: RunAllConfig, run_dir: Path, model: str) -> dict:
    out = run_dir / f"eval_{label}"
    argv = [PY, "-m", "env_server.evaluate", "--split", "test", "--limit", str(cfg.eval_samples),
            "--inference-url", vllm_url, "--data-dir", str(DATA_DIR), "--tokenizer", model,
            "--out-dir", str(out)]  # fmt: skip
    run_step(f"eval_{label}", argv, run_dir / f"eval_{label}.log")
    return json.loads((out / "metrics.json").read_text())


def eval_table(sft: dict, rl: dict, note: str) -> str:
    rows = ["| metric | SFT | RL | change |", "|---|---|---|---|"]
    for key, label in METRICS:
        a, b = float(sft[key]), float(rl[key])
        rel = f"{100 * (b - a) / a:+.0f}%" if a else "n/a"
        fmt = "{:.2f}" if key == "mean_reward" else "{:.1%}"
        rows.append(f"| {label} | {fmt.format(a)} | {fmt.format(b)} | {rel} |")
    return "\n".join(rows) + f"\n\n{note}\n"


def reward_curve(metrics_path: Path, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r["step"] for r in rows], [r["score_mean"] for r in rows], marker="o")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("mean reward of the batch")
    ax.set_title("Shop-R1 reward")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def trainer_argv(cfg: RunAllConfig, preset: Preset, model: str, api_url: str, vllm_url: str,
                 token: str, save: Path) -> list[str]:  # fmt: skip
    device = preset.trainer_device
    if cfg.single_copy and device.startswith("cuda"):
        device = "cuda:0"  # single copy: the trainer shares vLLM's GPU (CUDA IPC)
    argv = [
        PY, "-m", "trainer", "grpo", "--model-name", model, "--save-path", str(save),
        "--api-url", api_url, "--weight-bridge-mode", cfg.weight_bridge_mode,
        "--server-urls", vllm_url, "--bridge-token", token, "--device", device,
        "--training-steps", str(cfg.steps), "--batch-size", str(preset.group_size * preset.batch_groups),
        "--lr", str(preset.lr), "--no-tensorboard", "--overwrite",
    ]  # fmt: skip
    if cfg.single_copy:
        argv.append("--single-copy")
    if cfg.weight_bridge_mode == "lora_only":
        argv += ["--lora-r", "8"]
    return argv


def launch(cfg: RunAllConfig, stack: Stack, run_dir: Path) -> int:
    from vllm_patching.launcher import start_bridge_server

    preset = PRESETS[cfg.preset]
    model = cfg.model or preset.model
    if preset.build_embedded and cfg.model is None:
        prepare_embedded(cfg, run_dir)
    token = secrets.token_hex(16)
    api_port = cfg.api_port or free_port()
    api_url = f"http://127.0.0.1:{api_port}"
    logs = " ".join(str(run_dir / f"{n}.log") for n in ("api", "vllm", "env", "trainer"))
    print(f"[run_all] run dir {run_dir}\n[run_all] follow it: tail -f {logs}", flush=True)

    api = stack.start("api", [PY, "-m", "api", "--port", str(api_port),
                              "--db-path", str(run_dir / "api.sqlite")])  # fmt: skip
    wait_http(api, f"{api_url}/health", 60)
    print(f"[run_all] api up at {api_url} (pid {api.pid})", flush=True)

    print(f"[run_all] starting vLLM ({cfg.weight_bridge_mode}) on {model}...", flush=True)
    try:
        server = start_bridge_server(
            model, cfg.weight_bridge_mode, run_dir / "vllm.log", token=token,
            single_copy=cfg.single_copy, extra=preset.vllm_extra, port=cfg.vllm_port or free_port(),
            timeout=cfg.health_timeout,
        )  # fmt: skip
    except (RuntimeError, TimeoutError) as e:
        raise ServiceFailed(f"vllm did not come up: {e}") from e
    stack.add(server.proc)
    server.proc.name = "vllm"
    stack.write_pids()
    print(f"[run_all] vllm up at {server.base_url} (pid {server.proc.pid})", flush=True)

    sft_metrics = (
        evaluate("sft", server.base_url, cfg, run_dir, model) if cfg.eval_samples else None
    )

    env_argv = [
        PY, "-m", "env_server", "--api-url", api_url, "--inference-url", server.base_url,
        "--tokenizer", model, "--data-dir", str(DATA_DIR), "--group-size", str(preset.group_size),
        "--max-tokens", str(preset.max_tokens), "--metrics-path", str(run_dir / "env_metrics.jsonl"),
    ]  # fmt: skip
    if cfg.keep_constant_groups:
        env_argv.append("--no-drop-constant-groups")
    stack.start("env", env_argv)
    save = run_dir / "trainer"
    trainer = stack.start(
        "trainer", trainer_argv(cfg, preset, model, api_url, server.base_url, token, save)
    )
    print(f"[run_all] env + trainer started; training {cfg.steps} steps", flush=True)
    while trainer.alive():
        stack.check_alive("api", "vllm", "env")
        time.sleep(1.0)
    if trainer.popen.returncode != 0:
        raise ServiceFailed(
            f"trainer exited with {trainer.popen.returncode}; read {trainer.log_path}:\n"
            f"{tail(trainer.log_path, 20)}"
        )
    stack.stop("env")  # no more rollouts: vLLM now serves the trainer's final weights
    print(f"[run_all] trainer done; final model in {save}", flush=True)

    reward_curve(save / "metrics.jsonl", run_dir / "reward_curve.png")
    if sft_metrics is not None:
        health = httpx.get(f"{server.base_url}/bridge/health", timeout=10).json()
        rl_metrics = evaluate("rl", server.base_url, cfg, run_dir, model)
        note = (
            f"{cfg.eval_samples} test steps, greedy. SFT = {model}; RL = the trainer's final "
            f"weights ({save}) as served by vLLM after the last sync "
            f"(weight version {health.get('weight_version')}, mode {cfg.weight_bridge_mode})."
        )
        table = eval_table(sft_metrics, rl_metrics, note)
        (run_dir / "eval.md").write_text(table)
        print(table, flush=True)
    print(f"[run_all] reward curve: {run_dir / 'reward_curve.png'}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    run_dir = cfg.run_dir or RUNS_DIR / datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir = run_dir.resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    stack = Stack(run_dir)
    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        return launch(cfg, stack, run_dir)
    except ServiceFailed as e:
        print(f"[run_all] FAILED: {e}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print("[run_all] interrupted; stopping the services", file=sys.stderr, flush=True)
        return 130
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # let the shutdown finish
        stack.stop_all()
        print(f"[run_all] stopped {[p.pid for p in stack.procs]}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
