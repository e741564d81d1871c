"""``launch/run_all.sh``: the four services together (API -> vLLM -> env -> trainer), then
the SFT-vs-RL evaluation table, the reward curve and the run's page (report.html).

    launch/run_all.sh                                  # cpu-tiny, shared_vllm, 120 GRPO steps
    launch/run_all.sh --recipe recipes/tiny-qwen2/shop-r1/grpo.yaml   # preset < recipe < flags
    launch/run_all.sh --weight-bridge-mode none --training-steps 5 --run-dir runs/try
    launch/run_all.sh --num-inference-servers 2        # one trainer broadcast feeds both

Every process is a ``ManagedProcess`` (own process group, own log under the run dir) and is
stopped by its PID on Ctrl-C / SIGTERM, when a service dies, or when the trainer is done; if
the launcher itself dies (SIGKILL included), they die with it (``launch.lifeline``). Each
gets a share of the cores (``launch.threads``). Each service's config is resolved once (preset
< recipe < flags, ``launch.configs``) and handed to it as ``<run>/config/<service>.yaml``.
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
from typing import Any, Literal

import httpx
from pydantic import BaseModel, Field, FilePath, ValidationError

from launch import progress
from launch.configs import (
    Layers,
    run_model,
    service_configs,
    sft_config,
    write_service_config,
    write_vllm_config,
)
from launch.follow import LogSource, Source, eval_source, grpo_source, sft_source
from launch.placement import (
    Placement,
    PlacementError,
    num_servers_from_env,
    plan_placement,
    visible_gpus,
)
from launch.presets import Preset, PresetName, load_preset
from launch.procs import ManagedProcess, tail
from launch.report import build_report
from launch.run_all_help import HELP_EPILOG
from launch.threads import ThreadPlan, available_cores, light_env, plan_threads
from launch.trainer_node import launcher_argv, publish_trainer_argv
from settings.cli import add_config_flags, flag_values
from settings.paths import DATA_DIR, RUNS_DIR
from settings.ports import free_port
from vllm_patching.launcher import BridgeServer

PY = sys.executable
METRICS = [
    ("exact_match", "exact match", "pct"),
    ("type_accuracy", "type accuracy", "pct"),
    ("macro_f1", "macro-F1", "pct"),
    ("format_rate", "format rate", "pct"),
    ("mean_reward", "mean reward (paper: DARS 1000)", "reward"),
    ("reward_components.format", "reward part: format (0.5)", "part"),
    ("reward_components.type", "reward part: type (0.3)", "part"),
    ("reward_components.attr_presence", "reward part: attribute presence", "part"),
    ("reward_components.attr_rouge", "reward part: attribute ROUGE-L (unscaled)", "part"),
    ("reward_components.dars", "reward part: DARS x ROUGE-L (hard attribute)", "reward"),
    ("reward_components.no_dars", "reward without the DARS part", "part"),
    ("binary_reward", "binary reward (exact action, paper ablation)", "part"),
]
"""Rows of the SFT-vs-RL table: (key in env_server.evaluate's metrics.json, dotted for nested
keys; label; how to print it). A key missing from either side's metrics is left out."""


class RunAllConfig(BaseModel):
    """Options of launch/run_all.sh."""

    preset: PresetName = Field(
        "cpu-tiny",
        description="Model/device preset (recipes/presets/<name>.yaml; the lowest layer: "
        "--recipe and flags override it).",
    )
    model: str | None = Field(None, description="Override the preset's model (dir or hub id).")
    weight_bridge_mode: Literal["shared_vllm", "lora_only", "none"] = Field(
        "shared_vllm", description="How trainer weights reach vLLM (docs/BRIDGE.md)."
    )
    single_copy: bool = Field(False, description="shared_vllm: one weight copy in shared memory.")
    training_steps: int = Field(120, ge=1, description="GRPO training steps.")
    sft_steps: int | None = Field(
        None, ge=1, description="SFT steps if SFT must run (default: trainer's)."
    )
    num_sessions: int | None = Field(
        None,
        ge=10,
        description="Sessions of the dataset, built if missing (default: the recipe's, "
        "else the dataset on disk, else 3000); a dataset of another size is an error.",
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
        "--vllm-args='--gpu-memory-utilization 0.3'); they win over the preset's and the "
        "recipe's.",
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
        None,
        description="Recipe over the preset for every service (recipes/<model>/<task>/*.yaml, "
        "docs/RECIPES.md); the launcher's flags, ports and paths win over it.",
    )


def layers(cfg: RunAllConfig, preset: Preset) -> Layers:
    """The preset, the recipe and the launcher's own settings of every service (their
    precedence: launch/configs.py). A launcher flag left at its default counts under the
    recipe; given on the command line, over it."""
    given = cfg.model_fields_set
    defaults: dict[str, dict] = {"trainer.grpo": {}}
    flags: dict[str, dict] = {"trainer.grpo": {}, "trainer.sft": {}, "env": {}}
    steps = flags if "training_steps" in given else defaults
    steps["trainer.grpo"]["training_steps"] = cfg.training_steps
    if cfg.weight_bridge_mode == "lora_only":
        defaults["trainer.grpo"]["lora_r"] = 8
    if cfg.keep_constant_groups:
        flags["env"]["drop_constant_groups"] = False
    if cfg.num_sessions:
        flags["env"]["num_sessions"] = flags["trainer.sft"]["num_sessions"] = cfg.num_sessions
    if cfg.sft_steps:
        flags["trainer.sft"]["training_steps"] = cfg.sft_steps
    recipe = cfg.recipe.resolve() if cfg.recipe else None
    return Layers(preset, recipe, defaults, flags)


def parse_args(argv: list[str] | None = None) -> RunAllConfig:
    """One flag per :class:`RunAllConfig` field (settings/cli.py: choices and defaults in
    ``--help``); the fields given are ``model_fields_set`` (they count over the recipe)."""
    p = argparse.ArgumentParser(
        prog="launch/run_all.sh",
        description=__doc__.split("\n\n")[0],
        epilog=HELP_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_flags(p, RunAllConfig, files=False)
    ns = p.parse_args(argv)
    try:  # a bad value or a bad NUM_INFERENCE_NODES
        return RunAllConfig.model_validate(flag_values(RunAllConfig, ns))
    except (ValidationError, PlacementError) as e:
        p.error(str(e))


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
        tmp = self.run_dir / "pids.json.tmp"  # atomic: a reader never sees half a file
        tmp.write_text(json.dumps(pids, indent=2) + "\n")
        os.replace(tmp, self.run_dir / "pids.json")


def _raise_interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def run_step(
    name: str,
    argv: list[str],
    log: Path,
    env: dict[str, str] | None = None,
    title: str | None = None,
    source: Source | None = None,
) -> None:
    """A preparation command in the foreground (stopped by PID if we are interrupted), shown
    on the console as phase ``title`` (launch/progress.py; ``source``: its latest log line)."""
    print(f"[run_all] {name}: {' '.join(argv[1:])}  (log: {log})", flush=True)
    proc = ManagedProcess(name, argv, log, env=env).start()
    try:
        with progress.phase(title or name, source=source or LogSource(log)):
            rc = proc.popen.wait()
    finally:
        proc.stop()
    if rc != 0:
        raise ServiceFailed(f"{name} failed (exit {rc}); read {log}:\n{tail(log, 20)}")


def prepare_embedded(
    cfg: RunAllConfig, lay: Layers, num_sessions: int | None, run_dir: Path
) -> None:
    """The preset's base model (the tiny model, or SmolLM2 for cpu-smol), the dataset and the
    SFT cold start, each only if missing."""
    launch_cfg = lay.preset.launch
    base, sft_dir = Path(launch_cfg.base_model), Path(lay.preset.model)
    if not (base / "config.json").exists():
        name = launch_cfg.build_module.rsplit(".", 1)[-1]
        argv = [PY, "-m", launch_cfg.build_module, "--out", str(base)]
        run_step(name, argv, run_dir / f"{name}.log", title=f"build {name.replace('_', ' ')}")
    if not (DATA_DIR / "test.jsonl").exists():
        argv = [PY, "-m", "env_server.data", "build", "--out", str(DATA_DIR)]
        if num_sessions:
            argv += ["--num-sessions", str(num_sessions)]
        run_step("dataset", argv, run_dir / "dataset.log", title="build dataset")
    if not (sft_dir / "model.safetensors").exists():
        # An interrupted SFT left checkpoints: continue it rather than start over.
        resume = (sft_dir / "checkpoints").is_dir()
        path = write_service_config(run_dir, "trainer_sft", sft_config(lay, sft_dir, resume))
        argv = [PY, "-m", "trainer", "sft", "--config", str(path)]
        source = sft_source(sft_dir, cfg.sft_steps)
        run_step("sft", argv, run_dir / "sft.log", title="SFT", source=source)


def wait_http(proc: ManagedProcess, url: str, timeout: float) -> None:
    try:
        proc.wait_http(url, timeout=timeout)
    except (RuntimeError, TimeoutError) as e:
        raise ServiceFailed(str(e)) from e


def evaluate(
    label: str, vllm_url: str, cfg: RunAllConfig, run_dir: Path, model: str, env_cfg: Any
) -> dict:
    """The SFT-vs-RL evaluation with the rollouts' budgets and dataset (the env's config)."""
    out = run_dir / f"eval_{label}"
    argv = [
        PY,
        "-m",
        "env_server.evaluate",
        "--split",
        "test",
        "--limit",
        str(cfg.eval_samples),
        "--inference-url",
        vllm_url,
        "--data-dir",
        str(env_cfg.data_dir),
        "--tokenizer",
        model,
        "--max-prompt-tokens",
        str(env_cfg.max_prompt_tokens),
        "--max-tokens",
        str(env_cfg.max_tokens),
        "--out-dir",
        str(out),
    ]
    log = run_dir / f"eval_{label}.log"
    env = {**os.environ, **light_env()}
    run_step(f"eval_{label}", argv, log, env, f"evaluate {label.upper()}", eval_source(log))
    return json.loads((out / "metrics.json").read_text())


def _metric(m: dict, key: str) -> float | None:
    for part in key.split("."):
        if not isinstance(m, dict) or part not in m:
            return None
        m = m[part]
    return float(m)  # type: ignore[arg-type]


def _cell(m: dict, key: str, kind: str) -> str:
    v = _metric(m, key)
    assert v is not None
    if kind == "pct":
        ci = m.get(f"{key}_ci95")
        return f"{v:.1%}" + (f" [{ci[0]:.1%}, {ci[1]:.1%}]" if ci else "")
    if kind == "reward":
        se = m.get(f"{key}_se")
        return f"{v:.2f}" + (f" ± {se:.2f}" if se is not None else "")
    return f"{v:.3f}"


def _paired_line(sft: dict, rl: dict, key: str, label: str, scale: float, unit: str) -> str:
    from env_server.evaluate import paired_difference

    a, b = sft.get("per_sample", {}).get(key), rl.get("per_sample", {}).get(key)
    if not a or not b or len(a) != len(b):
        return ""
    d, se = paired_difference(a, b)
    z = f", {d / se:+.1f} SE" if se else ""
    return (f"- {label}, RL - SFT on the same {len(a)} rows (paired): "
            f"{scale * d:+.2f}{unit} ± {scale * se:.2f}{unit} (SE){z}\n")  # fmt: skip


def eval_table(sft: dict, rl: dict, note: str) -> str:
    """Markdown table of every metric for SFT and RL (95% CI for exact match, ± SE for the
    reward), the relative change, then the paired differences of exact match and reward."""
    rows = ["| metric | SFT | RL | change |", "|---|---|---|---|"]
    for key, label, kind in METRICS:
        a, b = _metric(sft, key), _metric(rl, key)
        if a is None or b is None:
            continue
        rel = f"{100 * (b - a) / abs(a):+.0f}%" if a else "n/a"
        if kind == "pct":
            rel = f"{100 * (b - a):+.1f} pts ({rel})"
        rows.append(f"| {label} | {_cell(sft, key, kind)} | {_cell(rl, key, kind)} | {rel} |")
    paired = _paired_line(sft, rl, "exact", "exact match", 100, " points")
    paired += _paired_line(sft, rl, "reward", "mean reward", 1, "")
    oracle = sft.get("oracle_exact_match")
    if oracle is not None:
        paired += f"- best reachable exact match on these rows (simulated users): {oracle:.1%}\n"
    return "\n".join(rows) + "\n\n" + paired + f"\n{note}\n"


def _env_rates(env_metrics: Path) -> dict[str, list[tuple[int, float]]]:
    """Per policy version, the mean over the env's pushed groups of each [0, 1] rate."""
    by_version: dict[int, list[dict]] = {}
    for line in env_metrics.read_text().splitlines():
        row = json.loads(line) if line.strip() else {}
        if row.get("kind") == "group":
            by_version.setdefault(int(row["policy_version"]), []).append(row)
    out: dict[str, list[tuple[int, float]]] = {}
    for key in ("valid", "type_match", "exact_match"):
        out[key] = [(v, sum(float(r.get(key, 0.0)) for r in rs) / len(rs))
                    for v, rs in sorted(by_version.items())]  # fmt: skip
    return out


def reward_curve(metrics_path: Path, png: Path, env_metrics: Path | None = None) -> None:
    """The trainer's batch reward per step and, from the env's group metrics
    (``env_metrics.jsonl`` beside ``png`` unless given), the format / type / exact-match rates
    of the rollouts per policy version."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    env_metrics = env_metrics or png.parent / "env_metrics.jsonl"
    rates = _env_rates(env_metrics) if env_metrics.exists() else {}
    fig, axes = plt.subplots(1, 2 if rates else 1, figsize=(11 if rates else 6, 3.8))
    ax = axes[0] if rates else axes
    steps = [r["step"] for r in rows]
    ax.plot(steps, [r["score_mean"] for r in rows], marker="o", ms=3, label="batch mean")
    k = max(1, len(rows) // 10)  # a running mean: one batch is a handful of prompts
    run = [sum(r["score_mean"] for r in rows[max(0, i - k + 1) : i + 1]) / min(k, i + 1)
           for i in range(len(rows))]  # fmt: skip
    ax.plot(steps, run, lw=2, label=f"running mean ({k})")
    if max(r["score_mean"] for r in rows) > 10:  # DARS: one ROUGE hit is worth ~1000
        ax.set_yscale("symlog", linthresh=1.0)
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("Shop-R1 reward (symlog above 1)")
    ax.set_title("Training batches: total reward")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    if rates:
        labels = {"valid": "valid format", "type_match": "type match", "exact_match": "exact"}
        for key, pts in rates.items():
            axes[1].plot([v for v, _ in pts], [y for _, y in pts], marker="o", ms=3,
                         label=labels[key])  # fmt: skip
        axes[1].set_ylim(0, 1)
        axes[1].set_xlabel("policy version of the rollouts")
        axes[1].set_ylabel("rate in the env's pushed groups")
        axes[1].set_title("Rollouts: reward components")
        axes[1].legend(fontsize=8)
        axes[1].grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def vllm_names(n: int) -> list[str]:
    """Service names (= log names) of ``n`` vLLM servers: vllm, vllm1, vllm2, ..."""
    return ["vllm"] + [f"vllm{i}" for i in range(1, n)]


def placement(cfg: RunAllConfig, preset: Preset) -> Placement:
    """Devices of every process (launch/placement.py); fails before anything starts."""
    device = preset.launch.trainer_device
    gpus = [g.strip() for g in cfg.gpus.split(",") if g.strip()] if cfg.gpus else None
    if device == "cuda" and gpus is None:
        gpus = visible_gpus()
    try:
        return plan_placement(device, cfg.weight_bridge_mode, cfg.single_copy,
                              cfg.num_inference_servers, cfg.tensor_parallel_size, gpus or [],
                              cfg.trainer_procs)  # fmt: skip
    except PlacementError as e:
        raise ServiceFailed(f"cannot place the processes of preset {cfg.preset}: {e}") from e


def vllm_extra(cfg: RunAllConfig) -> list[str]:
    """Flags every vLLM server gets after its config file (they win over it)."""
    extra: list[str] = []
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


def trainer_argv(cfg: RunAllConfig, config: Path, token: str) -> list[str]:
    """``python -m trainer grpo --config <run>/config/trainer_grpo.yaml`` (under torchrun for
    several ranks); the bridge token on the command line, never in the file."""
    return [
        *trainer_launcher(cfg),
        "-m",
        "trainer",
        "grpo",
        "--config",
        str(config),
        "--bridge-token",
        token,
    ]


def start_vllm_servers(cfg: RunAllConfig, ports: list[int], config: Path, place: Placement,
                       model: str, token: str, stack: Stack, run_dir: Path,
                       threads: ThreadPlan | None = None) -> list[BridgeServer]:  # fmt: skip
    """Start every vLLM server side by side (recorded in the stack at once), then wait for
    each health check."""
    from vllm_patching.launcher import server_env, spawn_bridge_server

    device = "cuda" if place.trainer_device.startswith("cuda") else "cpu"
    servers = []
    for i, name in enumerate(vllm_names(cfg.num_inference_servers)):
        port = ports[i]
        env = server_env(token, device, place.server_gpus[i])
        env.update(threads.for_server(i) if threads else {})
        server = spawn_bridge_server(
            model, cfg.weight_bridge_mode, run_dir / f"{name}.log", token=token,
            single_copy=cfg.single_copy, extra=["--config", str(config), *vllm_extra(cfg)], port=port,
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


def context_warning(model: str, max_prompt_tokens: int, max_tokens: int) -> str | None:
    """A warning when rollouts and evaluation would reach past the sequences ``model`` was
    fine-tuned on (its ``trainer_config.json``, written by ``python -m trainer sft``).

    A tiny model trained from scratch has never seen the positions beyond them: at a
    1536-token budget the embedded SFT model scored a mean reward of 6.5 against 45.7 at
    928 (env_server.config.DEFAULT_MAX_PROMPT_TOKENS).
    """
    path = Path(model) / "trainer_config.json"
    try:
        trained = int(json.loads(path.read_text())["max_seq_len"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # a hub model or no SFT record: nothing to compare with
    need = max_prompt_tokens + max_tokens
    if need <= trained:
        return None
    return (f"{model} was fine-tuned on sequences of {trained} tokens, but prompts of up to "
            f"{max_prompt_tokens} + completions of {max_tokens} tokens reach "
            f"position {need}: the model has never seen those positions. Lower the env's "
            f"max_prompt_tokens or fine-tune with a larger --max-seq-len.")  # fmt: skip


def launch(cfg: RunAllConfig, stack: Stack, run_dir: Path) -> int:
    preset = load_preset(cfg.preset)
    lay = layers(cfg, preset)
    model = run_model(lay, cfg.model)
    place = placement(cfg, preset)
    device = "cuda" if place.trainer_device.startswith("cuda") else "cpu"
    threads = plan_threads(available_cores(), cfg.num_inference_servers, device)
    light = {**os.environ, **threads.light_env}
    api_url = f"http://127.0.0.1:{cfg.api_port or free_port()}"
    ports = [cfg.vllm_port or free_port()]
    ports += [free_port() for _ in range(cfg.num_inference_servers - 1)]
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    save = run_dir / "trainer"
    # every config resolved (and checked) before anything starts
    confs = service_configs(
        lay,
        model,
        api_url,
        urls,
        save,
        run_dir,
        place.trainer_device,
        weight_bridge_mode=cfg.weight_bridge_mode,
        single_copy=cfg.single_copy,
        env_args=cfg.env_args,
        trainer_args=cfg.trainer_args,
    )
    env_cfg, steps = confs["env"].config, confs["trainer_grpo"].config.training_steps
    if preset.launch.build_embedded and model == preset.model:
        prepare_embedded(cfg, lay, env_cfg.num_sessions, run_dir)
    budget = (env_cfg.max_prompt_tokens, env_cfg.max_tokens)
    if (warning := context_warning(model, *budget)) is not None:
        print(f"[run_all] WARNING: {warning}", flush=True)
    if cfg.prepare_only:
        print(f"[run_all] prepared {model}", flush=True)
        return 0
    files = {name: write_service_config(run_dir, name, r) for name, r in confs.items()}
    files["vllm"] = write_vllm_config(lay, run_dir)
    print(
        f"[run_all] configs: {run_dir / 'config'} (preset {preset.name}"
        f"{f', recipe {cfg.recipe}' if cfg.recipe else ''})",
        flush=True,
    )
    token = secrets.token_hex(16)
    names = ["api", *vllm_names(cfg.num_inference_servers), "env", "trainer"]
    logs = " ".join(str(run_dir / f"{n}.log") for n in names)
    print(f"[run_all] run dir {run_dir}\n[run_all] follow it: tail -f {logs}", flush=True)
    print(f"[run_all] {threads.describe()} (launch/threads.py)", flush=True)

    vllm_log = LogSource(run_dir / "vllm.log")  # what the first server is doing
    services = progress.phase("start API + vLLM", 1 + cfg.num_inference_servers, "up", vllm_log)
    services.start()
    api = stack.start("api", [PY, "-m", "api", "--config", str(files["api"])], light)
    wait_http(api, f"{api_url}/health", 60)
    print(f"[run_all] api up at {api_url} (pid {api.pid})", flush=True)
    services.advance()

    print(f"[run_all] starting {cfg.num_inference_servers} vLLM server(s) "
          f"({cfg.weight_bridge_mode}{', single copy' if cfg.single_copy else ''}) on {model}...",
          flush=True)  # fmt: skip
    servers = start_vllm_servers(
        cfg, ports, files["vllm"], place, model, token, stack, run_dir, threads
    )
    services.advance(len(servers))
    services.finish()
    server = servers[0]  # the evaluations ask the first one

    sft_metrics = (
        evaluate("sft", server.base_url, cfg, run_dir, model, env_cfg) if cfg.eval_samples else None
    )

    stack.start("env", [PY, "-m", "env_server", "--config", str(files["env"])], light)
    argv = trainer_argv(cfg, files["trainer_grpo"], token)
    if int(os.environ.get("NNODES") or 1) > 1:  # the other nodes' ranks (launch/trainer_node.py)
        publish_trainer_argv(run_dir, argv)
    trainer = stack.start("trainer", argv, env={**trainer_env(place), **threads.trainer_env})
    where = f" on GPU {','.join(place.trainer_gpus)}" if place.trainer_gpus else ""
    print(f"[run_all] env + trainer{where} started; training {steps} steps", flush=True)
    with progress.phase("GRPO", steps, "steps", grpo_source(save, steps)):
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
        rl_metrics = evaluate("rl", server.base_url, cfg, run_dir, model, env_cfg)
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
