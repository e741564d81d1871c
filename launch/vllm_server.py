"""Start/stop a patched vLLM server (``python -m vllm_patching.serve``) as a child process:
launch/run_all.py, the tests, the benchmarks and the trainer's restart mode
(trainer/bridge/reload.py). docs/BRIDGE.md describes the server's bridge.

The process runs in its own process group, is stopped by its PID, and dies with the process
that started it, engine core and worker included (launch.procs, launch.lifeline).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launch.procs import ManagedProcess
from settings.ports import free_port
from vllm_patching.protocol import TOKEN_ENV
from vllm_patching.serve import expand_files


@dataclass
class BridgeServer:
    """A running ``vllm_patching.serve`` process."""

    proc: ManagedProcess
    port: int
    served_model_name: str
    config_path: Path
    launch: dict
    """The keyword arguments it was started with (what a restart reuses)."""

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.proc.stop()

    def restart(self, model: str | Path, initial_version: int) -> BridgeServer:
        """This server stopped and started again from ``model`` (``restart_bridge_server``):
        what the trainer's restart mode calls (trainer/bridge/reload.py), so the trainer
        needs no import of the launcher."""
        return restart_bridge_server(self, model, initial_version)

    def wait(self, timeout: float = 600.0) -> None:
        """Until /bridge/health answers; on failure (or Ctrl-C) the server is stopped and
        the error names its log."""
        try:
            self.proc.wait_http(f"{self.base_url}/bridge/health", timeout=timeout)
        except BaseException:
            self.proc.stop()
            raise


RENDEZVOUS_ENV = ("MASTER_ADDR", "MASTER_PORT")
"""The trainer's weight-broadcast rendezvous (Atropos' names); the trainer reads them, a vLLM
server must not (torch would take them for its own process group's address)."""


def cpu_env(token: str | None) -> dict[str, str]:
    """vLLM-on-CPU environment: small KV cache, offline, no usage stats, our token."""
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_TARGET_DEVICE", "cpu")
    # One process fewer per server: vLLM's CPU platform runs the model's worker inside the
    # engine core's process (its ``uni`` executor, the default at world size 1) only when this
    # is 0; otherwise it spawns the worker as a third process that imports vLLM and torch
    # again. The OpenAI server still runs its engine core as a process of its own.
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # The engine core forked from the OpenAI server, not spawned: it skips importing vLLM and
    # torch a second time (vllm_patching.plugin.keep_fork_on_cpu; docs/TESTING.md).
    env.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "fork")
    env["VLLM_NO_USAGE_STATS"] = "1"
    env["HF_HUB_OFFLINE"] = "1"
    env["TRANSFORMERS_OFFLINE"] = "1"
    if token is not None:
        env[TOKEN_ENV] = token
    return env


def server_env(
    token: str | None,
    device: str = "cpu",
    cuda_visible_devices: Sequence[str] = (),
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Environment of one vLLM server: ``cpu_env`` on CPU; on CUDA the caller's environment
    (hub downloads allowed) restricted to ``cuda_visible_devices`` (its own GPUs)."""
    if device == "cpu":
        env = cpu_env(token)
        if base is not None:
            env.update(base)
    else:
        env = dict(os.environ if base is None else base)
        env["VLLM_NO_USAGE_STATS"] = "1"
        if env.get("VLLM_TARGET_DEVICE") == "cpu":  # would force vLLM's CPU platform
            del env["VLLM_TARGET_DEVICE"]
        if cuda_visible_devices:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(cuda_visible_devices)
        if token is not None:
            env[TOKEN_ENV] = token
    for name in RENDEZVOUS_ENV:
        env.pop(name, None)
    return env


CPU_MAX_MODEL_LEN = 2048
"""A CPU server's context length where its file and flags set none."""
SERVER_DEFAULTS = [
    "--enforce-eager",
    "--dtype",
    "float32",
    "--max-model-len",
    str(CPU_MAX_MODEL_LEN),
]
"""vLLM options of a server on the CPU, for what its file and flags leave unset (a server on
CUDA gets none of them: CUDA graphs, the model's dtype and its context length stay vLLM's)."""


def server_argv(
    model: str | Path,
    port: int,
    mode: str,
    config_path: Path,
    single_copy: bool = False,
    served_model_name: str = "tiny",
    initial_version: int = 0,
    extra: Sequence[str] = (),
    cpu: bool = True,
) -> list[str]:
    argv = [
        sys.executable,
        "-m",
        "vllm_patching.serve",
        "--model",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        served_model_name,
        "--weight-bridge-mode",
        mode,
        "--bridge-config",
        str(config_path),
        "--bridge-initial-version",
        str(initial_version),
    ]
    if single_copy:
        argv.append("--single-copy")
    # on the CPU, the defaults under ``extra``'s files (--config), which are under its flags:
    # vLLM keeps the last value of an option
    return [*argv, *(SERVER_DEFAULTS if cpu else []), *expand_files(list(extra))]


def spawn_bridge_server(
    model: str | Path,
    mode: str,
    log_path: Path,
    *,
    token: str | None = None,
    single_copy: bool = False,
    served_model_name: str = "tiny",
    initial_version: int = 0,
    extra: Sequence[str] = (),
    port: int | None = None,
    timeout: float = 600.0,
    env: Mapping[str, str] | None = None,
    name: str | None = None,
    forked: bool | None = None,
) -> BridgeServer:
    """Start the server without waiting for it (``BridgeServer.wait``): several servers can
    start side by side. ``env`` defaults to ``cpu_env(token)`` (see ``server_env``); ``forked``
    forks it from a template that imported vLLM once (``launch.forked``: many starts in one
    process; None: as the process's ``forking`` setting says, the launcher's)."""
    launch = dict(
        model=model,
        mode=mode,
        log_path=log_path,
        token=token,
        single_copy=single_copy,
        served_model_name=served_model_name,
        extra=list(extra),
        timeout=timeout,
        env=None if env is None else dict(env),
        name=name,
        forked=forked,
    )
    port = port or free_port()
    config_path = log_path.parent / f"vllm_bridge_config.{port}.json"
    env = cpu_env(token) if env is None else dict(env)
    cpu = env.get("VLLM_TARGET_DEVICE") == "cpu"  # server_env leaves it out for CUDA
    argv = server_argv(
        model, port, mode, config_path, single_copy, served_model_name, initial_version, extra, cpu
    )
    name = name or f"vllm-bridge-{mode}"
    proc = ManagedProcess(name, argv, log_path, env=env, forked=forked).start()
    return BridgeServer(proc, port, served_model_name, config_path, launch)


def start_bridge_server(
    model: str | Path, mode: str, log_path: Path, **kwargs: Any
) -> BridgeServer:
    """Start the server and wait until /bridge/health answers (fails fast if it dies).

    Keyword arguments: those of ``spawn_bridge_server``."""
    server = spawn_bridge_server(model, mode, log_path, **kwargs)
    server.wait(server.launch["timeout"])
    return server


def restart_bridge_server(
    server: BridgeServer, model: str | Path, initial_version: int
) -> BridgeServer:
    """Stop ``server`` by its PID and start it again on the same port from ``model``.

    A checkpoint folder holds weights and config only, so the original model keeps
    providing the tokenizer. The new run gets a new run id and config file.
    """
    launch = dict(server.launch)
    extra = list(launch.pop("extra"))
    if "--tokenizer" not in extra:
        extra += ["--tokenizer", str(launch["model"])]
    launch["model"] = model
    server.stop()
    return start_bridge_server(
        **launch, extra=extra, port=server.port, initial_version=initial_version
    )
