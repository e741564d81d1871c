"""The virtualenv verifiers runs in (``artifacts/venvs/verifiers``), made on first use.

verifiers 0.4.0 cannot share the main virtualenv: it pins ``openai<3`` and ``mcp==2.0.0``,
and pip would downgrade the main venv's openai 3.57 and mcp 2.3 under vLLM 0.32
(docs/VERIFIERS.md, "Where verifiers lives"). Its own venv holds verifiers with its
dependencies (no torch: ~360 MB) plus ``uv``, which verifiers' harnesses use to prepare
their chat program. Made with uv (else pip; ``procutil.pip_install``) under a file lock, so
parallel test workers or envs share one build; checked by importing verifiers at the pinned
version.

Imports nothing heavy: ``python -m env_server.verifiers`` calls :func:`ensure_venv` from
any interpreter, then runs the service with the venv's Python (``__main__.py``).
"""

from __future__ import annotations

import fcntl
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

from procutil import pip_install
from settings.paths import ARTIFACTS

VERIFIERS_VERSION = "0.4.0"
UV_VERSION = "0.13.9"
PYDANTIC_SETTINGS = "pydantic-settings==2.16.3"  # as requirements.txt
VENV = Path(os.environ.get("SHOP_R1_VERIFIERS_VENV", ARTIFACTS / "venvs" / "verifiers"))
"""Where the venv lives (``$SHOP_R1_VERIFIERS_VENV`` overrides)."""
REPO_ROOT = Path(__file__).resolve().parents[2]
log = logging.getLogger("env_server.verifiers")


def venv_python(venv: Path = VENV) -> Path:
    return venv / "bin" / "python"


def _ready(py: Path) -> bool:
    """Whether the venv has verifiers at the pinned version and the rest, read from the
    installed metadata (importing verifiers costs seconds of CPU; this, a fraction)."""
    check = (
        "import importlib.metadata as m, importlib.util as u; "
        f"assert m.version('verifiers') == '{VERIFIERS_VERSION}'; "
        "assert all(u.find_spec(x) for x in ('verifiers', 'renderers', 'pydantic_settings'))"
    )
    if not py.exists():
        return False
    return subprocess.run([str(py), "-c", check], capture_output=True).returncode == 0


def ensure_venv(venv: Path = VENV, extra: list[str] | None = None) -> Path:
    """The venv's Python, creating the venv with ``verifiers==VERIFIERS_VERSION`` and ``uv``
    if missing (``extra``: more pip requirements, e.g. ``-e path/to/my_env``). Returns at
    once when it is there; logs the install's seconds when it builds."""
    py = venv_python(venv)
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f"{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _ready(py):
            t0 = time.monotonic()
            base = Path(getattr(sys, "_base_executable", sys.executable))
            subprocess.run([str(base), "-m", "venv", "--clear", str(venv)], check=True)
            # no bytecode up front: only the modules a run imports compile (on first use)
            install = pip_install.install_command(py)
            # pydantic-settings: our flags (settings/cli.py) in the service
            reqs = [f"verifiers=={VERIFIERS_VERSION}", f"uv=={UV_VERSION}", PYDANTIC_SETTINGS]
            subprocess.run([*install, *reqs], check=True)
            log.warning("built %s in %.0f s", venv, time.monotonic() - t0)
        if extra:
            subprocess.run([*pip_install.install_command(py), *extra], check=True)
    return py


def venv_environ(venv: Path = VENV, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment the service runs with in the venv: this repository importable (the
    API client, the protocol) and the venv's ``bin`` (``uv``) first on ``PATH``."""
    env = dict(os.environ if environ is None else environ)
    paths = [str(REPO_ROOT), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env["PATH"] = os.pathsep.join([str(venv / "bin"), env.get("PATH", "")])
    env.pop("VIRTUAL_ENV", None)
    return env
