"""The four services of bench/faults/soak.py, as ``launch/run_all.sh`` runs them on a preset (the same
resolved configs, thread plan and vLLM flags: launch/configs.py, launch/threads.py), but each
one restartable with the same arguments after it is killed (the trainer with ``--resume``).

The API's database and the trainer's run directory live on one "data disk": a tmpfs of
``disk_bytes`` (bench/faults/small_disk.py) where this process may mount one, else a plain folder (no
full-disk episode then). Every process is a ``ManagedProcess``: own session, stopped by PID,
dies with the soak (launch/lifeline.py).
"""

from __future__ import annotations

import json
import os
import secrets
import sys
from collections import Counter
from pathlib import Path

import httpx

from api.client import bearer
from bench.faults.small_disk import SmallDisk
from launch.configs import resolve_for_run, write_service_configs
from launch.procs import ManagedProcess
from launch.threads import available_cores, plan_threads
from launch.vllm_server import BridgeServer, server_env, spawn_bridge_server
from settings.ports import free_ports

SERVICES = ("api", "vllm", "env", "trainer")
PY = sys.executable


class SoakStack:
    def __init__(self, run_dir: Path, preset: str, disk_bytes: int, training_steps: int) -> None:
        self.run_dir = run_dir
        self.disk = SmallDisk(run_dir / "disk", disk_bytes) if SmallDisk.can_mount() else None
        self.data = run_dir / "disk"
        self.data.mkdir(parents=True, exist_ok=True)
        if self.disk is not None:
            self.disk.__enter__()
        api_port, self.vllm_port = free_ports(2)  # distinct: neither is bound yet
        self.api_url = f"http://127.0.0.1:{api_port}"
        self.vllm_url = f"http://127.0.0.1:{self.vllm_port}"
        self.save = self.data / "trainer"
        argv = ["--preset", preset, "--run-dir", str(run_dir)]
        argv += [
            "--training-steps",
            str(training_steps),
            "--trainer.grpo.save-path",
            str(self.save),
        ]
        argv += ["--api.db-path", str(self.data / "api.sqlite")]
        cfg = resolve_for_run(argv, self.api_url, [self.vllm_url], run_dir, "cpu")
        self.model = str(cfg.model)
        self.files = write_service_configs(run_dir, cfg)
        self.env_metrics = Path(cfg.env.metrics_path)
        self.db = Path(cfg.api.db_path)
        self.token = secrets.token_hex(16)
        self.threads = plan_threads(available_cores(), 1, "cpu")
        self.procs: dict[str, ManagedProcess] = {}
        self.vllm: BridgeServer | None = None
        self.starts: Counter[str] = Counter()
        self.history: list[ManagedProcess] = []

    def log(self, name: str) -> Path:
        return self.run_dir / f"{name}.{self.starts[name]}.log"

    def start(self, name: str, **trainer_flags: str) -> None:
        """Start (or restart) ``name``; the trainer resumes once it has been started before."""
        self.starts[name] += 1
        light = {**os.environ, **self.threads.light_env}
        if name == "vllm":
            env = {**server_env(self.token, "cpu"), **self.threads.for_server(0)}
            extra = ["--config", str(self.files["vllm"])]
            self.vllm = spawn_bridge_server(
                self.model,
                "shared_vllm",
                self.log(name),
                token=self.token,
                extra=extra,
                port=self.vllm_port,
                timeout=900,
                env=env,
                name="vllm",
            )
            proc = self.vllm.proc
        elif name == "api":
            argv = [PY, "-m", "api", "--config", str(self.files["api"])]
            proc = ManagedProcess("api", argv, self.log(name), env=light).start()
        elif name == "env":
            argv = [PY, "-m", "env_server", "--config", str(self.files["env"])]
            proc = ManagedProcess("env", argv, self.log(name), env=light).start()
        else:
            argv = [PY, "-m", "trainer", "grpo", "--config", str(self.files["trainer_grpo"])]
            argv += ["--bridge-token", self.token]
            argv += ["--resume"] if self.starts[name] > 1 else []
            for flag, value in trainer_flags.items():
                argv += [f"--{flag.replace('_', '-')}", value]
            env = {**os.environ, **self.threads.trainer_env}
            proc = ManagedProcess("trainer", argv, self.log(name), env=env).start()
        self.procs[name] = proc
        self.history.append(proc)

    def healthy(self, name: str) -> bool:
        """``name`` answers its health route (the env and the trainer: alive)."""
        if not self.procs[name].alive():
            return False
        url = {"api": f"{self.api_url}/health", "vllm": f"{self.vllm_url}/bridge/health"}
        if name not in url:
            return True
        headers = bearer(self.token) if name == "vllm" else {}
        try:
            return httpx.get(url[name], timeout=5, headers=headers).status_code == 200
        except httpx.HTTPError:
            return False

    def stop_all(self) -> None:
        for name in ("trainer", "env", "vllm", "api"):
            if name in self.procs:
                self.procs[name].stop()
        if self.disk is not None:
            self.disk.unmount()

    # -- what the run left -------------------------------------------------------------------
    def latest_state(self) -> tuple[int, list[dict]] | None:
        """(step, recent_batches) of the newest checkpoint, None before the first."""
        ckpts = sorted((self.save / "checkpoints").glob("step_*"))
        for ckpt in reversed(ckpts):
            try:
                state = json.loads((ckpt / "trainer_state.json").read_text())
            except (OSError, ValueError):  # pruned or replaced while we read: the next one
                continue
            return int(state["step"]), state["recent_batches"]
        return None
