"""Shared fixtures: the embedded tiny model and a real vLLM server on a free port.

Servers are started as child processes in their own process group and stopped by PID.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from launch.paths import TINY_MODEL_DIR
from launch.procs import ManagedProcess, free_port
from vllm_patching.launcher import cpu_env


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip `gpu` tests when CUDA is not there (the CPU default and CI)."""
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:  # pragma: no cover - torch missing is a setup error shown elsewhere
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The embedded tiny Qwen2 model; built on first use (deterministic, ~seconds)."""
    from trainer.tiny_model import build_tiny_model, is_built

    if not is_built(TINY_MODEL_DIR):
        build_tiny_model(TINY_MODEL_DIR)
    return TINY_MODEL_DIR


@dataclass
class VllmServer:
    base_url: str
    model: str
    proc: ManagedProcess
    port: int


def start_plain_vllm(model_dir: Path, log_path: Path, extra: list[str] | None = None) -> VllmServer:
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--enforce-eager",
        "--dtype",
        "float32",
        "--max-model-len",
        "2048",
        "--served-model-name",
        "tiny",
        *(extra or []),
    ]
    proc = ManagedProcess("vllm", argv, log_path, env=cpu_env(None)).start()
    try:
        proc.wait_http(f"http://127.0.0.1:{port}/health", timeout=600)
    except BaseException:
        proc.stop()
        raise
    return VllmServer(base_url=f"http://127.0.0.1:{port}", model="tiny", proc=proc, port=port)


@pytest.fixture(scope="session")
def vllm_server(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmServer]:
    """A real vLLM OpenAI server (CPU) serving the tiny model, shared by a test session."""
    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    server = start_plain_vllm(tiny_model_dir, log)
    try:
        yield server
    finally:
        server.proc.stop()
