"""What the GRPO integration tests share: a token-guarded API and the trainer CLI run to the end.

Both ``test_trainer_grpo.py`` and ``test_trainer_gail.py`` drive the real batching API, a real
patched vLLM server (bridge mode ``none``: the session's ``none_server``, tests/conftest.py,
reset to the start weights at version 0 before each test) and ``python -m trainer grpo`` the
same way; only their groups and checks differ.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from api.client import ApiClient, bearer
from launch.procs import ManagedProcess
from launch.vllm_server import BridgeServer
from settings.ports import free_port

TOKEN = "trainer-test-token"
GROUP = 4


def reset_none_server(server: BridgeServer, model: Path) -> BridgeServer:
    """Reload ``model`` into the session's ``none`` server as version 0, what a fresh start
    serves (the ``none_server`` fixture before each test; test_checkpoint_faults' module)."""
    import httpx

    from vllm_patching.protocol import TOKEN_HEADER

    url = server.base_url
    body = {"path": str(model), "version": 0}
    r = httpx.post(f"{url}/bridge/reload", json=body, headers={TOKEN_HEADER: TOKEN}, timeout=300)
    r.raise_for_status()
    assert httpx.get(f"{url}/bridge/health", timeout=30).json()["weight_version"] == "0"
    return server


def start_api(tmp_path: Path, timeout: float = 60.0) -> tuple[ManagedProcess, ApiClient, str]:
    """Start the API with TOKEN on a free port (forked from the test session's template, as
    the launcher's CPU runs start theirs); return it, a client and its URL once /health
    answers (with the token: /health needs it). The caller stops the process (also when this
    raises: it is returned only once healthy, so on failure it is stopped here).
    """
    port = free_port()
    argv = [sys.executable, "-m", "api", "--port", str(port)]
    argv += ["--db-path", str(tmp_path / "api.sqlite"), "--token", TOKEN]
    api = ManagedProcess("api", argv, tmp_path / "api.log", forked=True).start()
    url = f"http://127.0.0.1:{port}"
    try:
        api.wait_http(f"{url}/health", timeout, interval=0.3, headers=bearer(TOKEN))
    except BaseException:
        api.stop()
        raise
    return api, ApiClient(url, token=TOKEN), url


def run_trainer(
    model_dir: Path,
    save: Path,
    api_url: str,
    vllm_url: str,
    steps: int,
    *extra: str,
    env: dict[str, str] | None = None,
) -> str:
    """``trainer grpo`` for ``steps`` steps (bridge mode none); asserts it exits 0, returns its log."""
    argv = [
        sys.executable,
        "-m",
        "trainer",
        "grpo",
        "--model-name",
        str(model_dir),
        "--save-path",
        str(save),
        "--api-url",
        api_url,
        "--api-token",
        TOKEN,
        "--weight-bridge-mode",
        "none",
        "--inference-url",
        vllm_url,
        "--bridge-token",
        TOKEN,
        "--training-steps",
        str(steps),
        "--batch-size",
        str(2 * GROUP),
        "--lr",
        "1e-3",
        "--wait-timeout",
        "60",
        "--poll-interval",
        "0.2",
        "--no-tensorboard",
        "--precision",
        "fp32",
        *extra,  # the same on every CPU (auto: bf16 where native)
    ]
    log = save.parent / f"trainer-{steps}.log"
    proc_env = {**os.environ, **env} if env else None
    proc = ManagedProcess("trainer", argv, log, env=proc_env, forked=True).start()
    try:
        rc = proc.wait_exit()  # fails only when its log stops growing (a busy box is slow)
    finally:
        proc.stop()
    text = log.read_text()
    assert rc == 0, text[-3000:]
    return text
