"""The servers ``bench/api/throughput.py`` measures, each a real uvicorn process on a free
port: atroposlib's ``run-api`` (from its own virtualenv) or ours (``python -m api``).
"""

from __future__ import annotations

import argparse
import fcntl
import subprocess
import sys
from pathlib import Path

from launch.procs import ManagedProcess
from procutil import pip_install
from settings.paths import ARTIFACTS
from settings.ports import free_port

ATROPOS_VERSION = "0.4.0"
ATROPOS_VENV = ARTIFACTS / "venvs" / "atropos"


def ensure_atropos(python: Path | None = None) -> Path:
    """The Python of a virtualenv with atroposlib (created with uv, else pip, if missing,
    under ``$SHOP_R1_ARTIFACTS/venvs/atropos``; a file lock lets parallel test workers share
    one build)."""
    if python is not None:
        return python
    py = ATROPOS_VENV / "bin" / "python"
    check = [
        str(py),
        "-c",
        f"import atroposlib.api; import importlib.metadata as m; "
        f"assert m.version('atroposlib') == '{ATROPOS_VERSION}'",
    ]
    ATROPOS_VENV.parent.mkdir(parents=True, exist_ok=True)
    with open(ATROPOS_VENV.parent / "atropos.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if py.exists() and subprocess.run(check, capture_output=True).returncode == 0:
            return py
        base = Path(getattr(sys, "_base_executable", sys.executable))
        subprocess.run([str(base), "-m", "venv", "--clear", str(ATROPOS_VENV)], check=True)
        # no bytecode for its ~1 GB of packages up front: the modules a run imports compile
        # on first use
        install = pip_install.install_command(py)
        subprocess.run([*install, f"atroposlib=={ATROPOS_VERSION}"], check=True)
    return py


def atropos_api_argv(python: Path, port: int) -> list[str]:
    """atroposlib's ``run-api`` app under uvicorn, from its virtualenv's ``python``."""
    return [
        str(python),
        "-m",
        "uvicorn",
        "atroposlib.api:app",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "warning",
    ]


def start_server(target: str, work: Path, args: argparse.Namespace) -> tuple[ManagedProcess, str]:
    port = free_port()
    if target == "atropos":
        argv = atropos_api_argv(args.atropos_python, port)
    else:
        argv = [
            sys.executable,
            "-m",
            "api",
            "--port",
            str(port),
            "--synchronous",
            args.synchronous,
            "--db-path",
            str(work / f"{target}-{port}.sqlite"),
            "--log-level",
            "warning",
            "--max-body-bytes",
            str(1 << 30),
        ]
    proc = ManagedProcess(target, argv, work / f"{target}-{port}.log").start()
    url = f"http://127.0.0.1:{port}"
    try:
        proc.wait_http(url + ("/" if target == "atropos" else "/health"), timeout=60)
    except BaseException:
        proc.stop()
        raise
    return proc, url
