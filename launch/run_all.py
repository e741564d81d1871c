"""``launch/run_all.sh``: the four services together (API -> vLLM -> env -> trainer), then
the SFT-vs-RL evaluation table, the reward curve and the run's page (report.html).

    launch/run_all.sh                                  # cpu-tiny, shared_vllm, 120 GRPO steps
    launch/run_all.sh --weight-bridge-mode none --steps 5 --run-dir runs/try
    launch/run_all.sh --num-inference-servers 2        # one trainer broadcast feeds both

Every process is a ``ManagedProcess`` (own process group, own log under the run dir) and is
stopped by its PID on Ctrl-C / SIGTERM, when a service dies, or when the trainer is done; if
the launcher itself dies (SIGKILL included), they die with it (``launch.lifeline``). Each
gets a share of the cores (``launch.threads``).

This module is the command line and the order of the run; the rest lives beside it:
launch/supervisor.py (the processes it keeps and stops), launch/prepare.py (base model,
dataset, SFT cold start), launch/evaluation.py (the SFT and RL evaluations),
launch/eval_table.py (the SFT-vs-RL table), launch/reward_curve.py (the reward plot) and
launch/report.py (the run's page). docs/CODE_MAP.md maps the whole tree.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shlex
import signal
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Literal

import httpx
from pydantic import BaseModel, Field, FilePath, ValidationError

from launch import progress
from launch.eval_table import eval_table
from launch.evaluation import evaluate
from launch.follow import LogSource, grpo_source
from launch.paths import DATA_DIR, RUNS_DIR
from launch.placement import (
    Placement,
    PlacementError,
    num_servers_from_env,
    plan_placement,
    visible_gpus,
)
from launch.prepare import context_warning, prepare_embedded
from launch.presets import PRESETS, Preset
from launch.procs import free_port, tail
from launch.report import build_report
from launch.reward_curve import reward_curve
from launch.run_all_help import HELP_EPILOG, flag_help
from launch.supervisor import PY, ServiceFailed, Stack, wait_http
from launch.threads import ThreadPlan, available_cores, plan_threads
from launch.trainer_node import launcher_argv, publish_trainer_argv
from launch.vllm_server import BridgeServer, server_env, spawn_bridge_server


class RunAllConfig(BaseModel):
    """Options of launch/run_all.sh."""

    preset: Literal["cpu-tiny", "cpu-smol", "gpu-0.5b", "gpu-3b"] = Field(
        "cpu-tiny", description="Model/device preset (launch/presets.py)."
    )
    model: str | None = Field(None, description="Override the preset's model (dir or hub id).")
    weight_bridge_mode: Literal["shared_vllm", "lora_only", "none"] = Field(
        "shared_vllm", description="How trainer weights reach vLLM (docs/BRIDGE.md)."
    )
    single_copy: bool = Field(False, description="shared_vllm: one weight copy in shared memory.")
    steps: int = Field(120, ge=1, description="GRPO training steps.")
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
    eval_samples: int = Field(
        512, ge=0, description="Test-split steps to evaluate (0: skip); 512 gives ~±3 points."
    )
    run_dir: Path | None = Field(None, description="Run directory (default runs/<timestamp>).")
    api_port: int | None = Field(None, description="API port (default: a free one).")
    vllm_port: int | None = Field(
        None, description="Port of the first vLLM server (default: a free one; others: free)."
    )
    num_inference_servers: int = Field(
        default_factory=num_servers_from_env,
        ge=1,
        description="vLLM servers to start, all synced by the trainer and sampled by the env "
        "(default: $NUM_INFERENCE_NODES as in Atropos, unset or 0 = 1).",
    )
    tensor_parallel_size: int = Field(
        1, ge=1, description="vLLM --tensor-parallel-size of each server (GPUs per server)."
    )
    trainer_procs: int = Field(
        1,
        ge=1,
        description="Trainer processes on this node: >1 runs the trainer under torchrun, "
        "sharded with FSDP2 (one GPU each on CUDA). Several nodes: set NNODES, NODE_RANK, "
        "MASTER_ADDR, MASTER_PORT (docs/MULTINODE.md).",
    )
    vllm_args: str | None = Field(
        None,
        description="More vLLM flags for every server, one quoted string after '=' (e.g. "
        "--vllm-args='--gpu-memory-utilization 0.3'); they win over the preset's.",
    )
    env_args: str | None = Field(
        None,
        description="More `python -m env_server` flags, one quoted string after '=' (e.g. "
        "--env-args='--group-size 8'); they win over the preset's and the recipe's.",
    )
    trainer_args: str | None = Field(
        None,
        description="More `python -m trainer grpo` flags, one quoted string after '=' (e.g. "
        "--trainer-args='--lr 1e-4 --kl-beta 0.05'); they win over the preset's and the recipe's.",
    )
    gpus: str | None = Field(
        None,
        description="GPU presets: comma-separated GPU ids to place the servers and the trainer "
        "on (default: $CUDA_VISIBLE_DEVICES, else every GPU nvidia-smi lists).",
    )
    prepare_only: bool = Field(
        False, description="Build the tiny model, dataset and SFT checkpoint if missing, then exit."
    )
    health_timeout: float = Field(600.0, description="Seconds to wait for each health check.")
    recipe: FilePath | None = Field(
        None, description="Recipe passed to every service (recipes/<model>/<task>/*.yaml, "
        "docs/RECIPES.md); the launcher's own flags (ports, paths, preset values) still win."
    )  # fmt: skip


def recipe_args(cfg: RunAllConfig) -> list[str]:
    """``--recipe PATH`` for a service command line (nothing without a recipe)."""
    return ["--recipe", str(cfg.recipe.resolve())] if cfg.recipe else []


def parse_args(argv: list[str] | None = None) -> RunAllConfig:
    p = argparse.ArgumentParser(
        prog="launch/run_all.sh",
        description=__doc__.split("\n\n")[0],
        epilog=HELP_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    for name, field in RunAllConfig.model_fields.items():
        flag = "--" + name.replace("_", "-")
        if field.annotation is bool:
            p.add_argument(flag, action="store_true", help=field.description)
        else:
            p.add_argument(flag, default=None, **flag_help(field))
    given = {k: v for k, v in vars(p.parse_args(argv)).items() if v not in (None, False)}
    try:
        return RunAllConfig(**given)
    except (ValidationError, PlacementError) as e:  # a bad value or a bad NUM_INFERENCE_NODES
        p.error(str(e))


def _raise_interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def vllm_names(n: int) -> list[str]:
    """Service names (= log names) of ``n`` vLLM servers: vllm, vllm1, vllm2, ..."""
    return ["vllm"] + [f"vllm{i}" for i in range(1, n)]


def placement(cfg: RunAllConfig, preset: Preset) -> Placement:
    """Devices of every process (launch/placement.py); fails before anything starts."""
    device = "cuda" if preset.trainer_device.startswith("cuda") else "cpu"
    gpus = [g.strip() for g in cfg.gpus.split(",") if g.strip()] if cfg.gpus else None
    if device == "cuda" and gpus is None:
        gpus = visible_gpus()
    try:
        return plan_placement(device, cfg.weight_bridge_mode, cfg.single_copy,
                              cfg.num_inference_servers, cfg.tensor_parallel_size, gpus or [],
                              cfg.trainer_procs)  # fmt: skip
    except PlacementError as e:
        raise ServiceFailed(f"cannot place the processes of preset {cfg.preset}: {e}") from e


def vllm_extra(cfg: RunAllConfig, preset: Preset) -> list[str]:
    """Flags every vLLM server gets beyond the launcher's defaults."""
    extra = list(preset.vllm_extra)
    if cfg.tensor_parallel_size > 1:
        extra += ["--tensor-parallel-size", str(cfg.tensor_parallel_size)]
    return extra + shlex.split(cfg.vllm_args or "")  # last: vLLM takes the last value of a flag


def trainer_env(place: Placement) -> dict[str, str]:
    """The trainer's environment: its own GPU(s) on CUDA; MASTER_ADDR/MASTER_PORT pass
    through (the broadcast rendezvous, trainer/bridge)."""
    env = dict(os.environ)
    if place.trainer_gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(place.trainer_gpus)
    return env


def trainer_launcher(cfg: RunAllConfig, environ: dict[str, str] | None = None) -> list[str]:
    """``python``, or torchrun for ``--trainer-procs N`` / several nodes (launch/trainer_node.py)."""
    try:
        return launcher_argv(PY, cfg.trainer_procs, os.environ if environ is None else environ)
    except ValueError as e:
        raise ServiceFailed(str(e)) from e


def trainer_argv(cfg: RunAllConfig, preset: Preset, model: str, api_url: str,
                 vllm_urls: list[str], token: str, save: Path,
                 device: str = "cpu") -> list[str]:  # fmt: skip
    argv = [
        *trainer_launcher(cfg), "-m", "trainer", "grpo", *recipe_args(cfg), "--model-name", model, "--save-path", str(save),
        "--api-url", api_url, "--weight-bridge-mode", cfg.weight_bridge_mode,
        "--server-urls", *vllm_urls, "--bridge-token", token, "--device", device,
        "--training-steps", str(cfg.steps), "--batch-size", str(preset.group_size * preset.batch_groups),
        "--lr", str(preset.lr), "--overwrite",
    ]  # fmt: skip
    argv += preset.trainer_extra
    if cfg.single_copy:
        argv.append("--single-copy")
    if cfg.weight_bridge_mode == "lora_only":
        argv += ["--lora-r", "8"]
    return argv + shlex.split(cfg.trainer_args or "")  # last: the trainer takes the last value


def start_vllm_servers(cfg: RunAllConfig, preset: Preset, place: Placement, model: str,
                       token: str, stack: Stack, run_dir: Path,
                       threads: ThreadPlan | None = None) -> list[BridgeServer]:  # fmt: skip
    """Start every vLLM server side by side (recorded in the stack at once), then wait for
    each health check."""
    device = "cuda" if place.trainer_device.startswith("cuda") else "cpu"
    servers = []
    for i, name in enumerate(vllm_names(cfg.num_inference_servers)):
        port = cfg.vllm_port if (i == 0 and cfg.vllm_port) else free_port()
        env = server_env(token, device, place.server_gpus[i])
        env.update(threads.for_server(i) if threads else {})
        server = spawn_bridge_server(
            model, cfg.weight_bridge_mode, run_dir / f"{name}.log", token=token,
            single_copy=cfg.single_copy, extra=[*recipe_args(cfg), *vllm_extra(cfg, preset)], port=port,
            timeout=cfg.health_timeout, env=env, name=name,
        )  # fmt: skip
        stack.add(server.proc)
        servers.append(server)
    for server, gpu_ids in zip(servers, place.server_gpus, strict=True):
        try:
            server.wait(cfg.health_timeout)
        except (RuntimeError, TimeoutError) as e:
            raise ServiceFailed(f"{server.proc.name} did not come up: {e}") from e
        gpus = f" on GPU {','.join(gpu_ids)}" if gpu_ids else ""
        print(f"[run_all] {server.proc.name} up at {server.base_url}{gpus} "
              f"(pid {server.proc.pid})", flush=True)  # fmt: skip
    return servers


def weight_versions(servers: list[BridgeServer]) -> dict[str, str | None]:
    """Each server's current weight version (its /bridge/health), by service name."""
    out: dict[str, str | None] = {}
    for s in servers:
        try:
            health = httpx.get(f"{s.base_url}/bridge/health", timeout=10).json()
            out[s.proc.name] = health.get("weight_version")
        except (httpx.HTTPError, ValueError):
            out[s.proc.name] = None
    return out


def launch(cfg: RunAllConfig, stack: Stack, run_dir: Path) -> int:
    preset = PRESETS[cfg.preset]
    model = cfg.model or preset.model
    place = placement(cfg, preset)
    device = "cuda" if place.trainer_device.startswith("cuda") else "cpu"
    threads = plan_threads(available_cores(), cfg.num_inference_servers, device)
    light = {**os.environ, **threads.light_env}
    if preset.build_embedded and cfg.model is None:
        prepare_embedded(preset, run_dir, recipe_args(cfg), cfg.num_sessions, cfg.sft_steps)
    if (warning := context_warning(model, preset)) is not None:
        print(f"[run_all] WARNING: {warning}", flush=True)
    if cfg.prepare_only:
        print(f"[run_all] prepared {model}", flush=True)
        return 0
    token = secrets.token_hex(16)
    api_port = cfg.api_port or free_port()
    api_url = f"http://127.0.0.1:{api_port}"
    names = ["api", *vllm_names(cfg.num_inference_servers), "env", "trainer"]
    logs = " ".join(str(run_dir / f"{n}.log") for n in names)
    print(f"[run_all] run dir {run_dir}\n[run_all] follow it: tail -f {logs}", flush=True)
    print(f"[run_all] {threads.describe()} (launch/threads.py)", flush=True)

    vllm_log = LogSource(run_dir / "vllm.log")  # what the first server is doing
    services = progress.phase("start API + vLLM", 1 + cfg.num_inference_servers, "up", vllm_log)
    services.start()
    api = stack.start("api", [PY, "-m", "api", *recipe_args(cfg), "--port", str(api_port),
                              "--db-path", str(run_dir / "api.sqlite")], light)  # fmt: skip
    wait_http(api, f"{api_url}/health", 60)
    print(f"[run_all] api up at {api_url} (pid {api.pid})", flush=True)
    services.advance()

    print(f"[run_all] starting {cfg.num_inference_servers} vLLM server(s) "
          f"({cfg.weight_bridge_mode}{', single copy' if cfg.single_copy else ''}) on {model}...",
          flush=True)  # fmt: skip
    servers = start_vllm_servers(cfg, preset, place, model, token, stack, run_dir, threads)
    services.advance(len(servers))
    services.finish()
    server = servers[0]  # the evaluations ask the first one
    urls = [s.base_url for s in servers]

    sft_metrics = (
        evaluate("sft", server.base_url, preset, cfg.eval_samples, run_dir, model)
        if cfg.eval_samples
        else None
    )

    env_argv = [
        PY, "-m", "env_server", *recipe_args(cfg), "--api-url", api_url,
        "--inference-url", ",".join(urls),
        "--tokenizer", model, "--data-dir", str(DATA_DIR), "--group-size", str(preset.group_size),
        "--max-tokens", str(preset.max_tokens), "--max-prompt-tokens", str(preset.max_prompt_tokens),
        "--metrics-path", str(run_dir / "env_metrics.jsonl"),
        *preset.env_extra,
    ]  # fmt: skip
    if cfg.keep_constant_groups:
        env_argv.append("--no-drop-constant-groups")
    env_argv += shlex.split(cfg.env_args or "")  # last: the env takes the last value
    stack.start("env", env_argv, light)
    save = run_dir / "trainer"
    argv = trainer_argv(cfg, preset, model, api_url, urls, token, save, place.trainer_device)
    if int(os.environ.get("NNODES") or 1) > 1:  # the other nodes' ranks (launch/trainer_node.py)
        publish_trainer_argv(run_dir, argv)
    trainer = stack.start("trainer", argv, env={**trainer_env(place), **threads.trainer_env})
    where = f" on GPU {','.join(place.trainer_gpus)}" if place.trainer_gpus else ""
    print(f"[run_all] env + trainer{where} started; training {cfg.steps} steps", flush=True)
    with progress.phase("GRPO", cfg.steps, "steps", grpo_source(save, cfg.steps)):
        while trainer.alive():
            stack.check_alive("api", *vllm_names(cfg.num_inference_servers), "env")
            time.sleep(1.0)
    if trainer.popen.returncode != 0:
        raise ServiceFailed(
            f"trainer exited with {trainer.popen.returncode}; read {trainer.log_path}:\n"
            f"{tail(trainer.log_path, 20)}"
        )
    stack.stop("env")  # no more rollouts: vLLM now serves the trainer's final weights
    versions = weight_versions(servers)
    (run_dir / "weight_versions.json").write_text(json.dumps(versions, indent=2) + "\n")
    print(f"[run_all] trainer done; final model in {save}; weight version per server: "
          f"{versions}", flush=True)  # fmt: skip

    reward_curve(save / "metrics.jsonl", run_dir / "reward_curve.png")
    if sft_metrics is not None:
        health = httpx.get(f"{server.base_url}/bridge/health", timeout=10).json()
        rl_metrics = evaluate("rl", server.base_url, preset, cfg.eval_samples, run_dir, model)
        note = (
            f"{cfg.eval_samples} test steps, greedy. SFT = {model}; RL = the trainer's final "
            f"weights ({save}) as served by vLLM after the last sync "
            f"(weight version {health.get('weight_version')}, mode {cfg.weight_bridge_mode})."
        )
        table = eval_table(sft_metrics, rl_metrics, note)
        (run_dir / "eval.md").write_text(table)
        print(table, flush=True)
    print(f"[run_all] reward curve: {run_dir / 'reward_curve.png'}", flush=True)
    print(f"[run_all] the run's page: {build_report(run_dir)} (open it in a browser)", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    run_dir = cfg.run_dir or RUNS_DIR / datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir = run_dir.resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    stack = Stack(run_dir)
    # Ctrl-C and SIGTERM stop exactly what was started. SIGINT explicitly too: Python only
    # raises KeyboardInterrupt when SIGINT was not ignored at its start, and a parent that
    # ignores it (a pytest-xdist worker, `cmd &` in a script) would leave it ignored.
    signal.signal(signal.SIGTERM, _raise_interrupt)
    signal.signal(signal.SIGINT, _raise_interrupt)
    try:
        with progress.session():
            return launch(cfg, stack, run_dir)
    except ServiceFailed as e:
        print(f"[run_all] FAILED: {e}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print("[run_all] interrupted; stopping the services", file=sys.stderr, flush=True)
        return 130
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # let the shutdown finish
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        stack.stop_all()
        print(f"[run_all] stopped {[p.pid for p in stack.procs]}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
