"""Every entry point answers ``--help`` with its usage and options, exit 0, starting nothing:
each ``python -m`` module of the packages (found by its ``__main__`` guard, so a new one is
covered without editing this file; the benchmarks of bench/ among them), the console scripts
of pyproject.toml and launch/run_all.sh (which also shows defaults and choices)."""

from __future__ import annotations

import ast
import functools
import os
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

import pytest

from launch.procs import REPO_ROOT

pytestmark = pytest.mark.unit
PACKAGES = (
    "api",
    "bench",
    "env_server",
    "launch",
    "procutil",
    "settings",
    "trainer",
    "vllm_patching",
)
ENTRY = "tests.unit.console_entry"


def _has_main_guard(path: Path) -> bool:
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
            return True
    return False


def _modules() -> list[str]:
    """Dotted names of the package modules runnable with ``python -m``."""
    out = []
    for pkg in PACKAGES:
        for path in sorted((REPO_ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(REPO_ROOT).with_suffix("")
            if path.name == "__main__.py":
                out.append(".".join(rel.parts[:-1]))
            elif _has_main_guard(path):
                out.append(".".join(rel.parts))
    return out


def _scripts() -> dict[str, str]:
    """pyproject's console scripts: name -> ``module:function``."""
    return tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["scripts"]


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return _run_once(tuple(argv))


@functools.cache  # `serve --help` imports vLLM: two tests read one run
def _run_once(argv: tuple[str, ...]) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1")
    if any(a.startswith("vllm_patching.serve") for a in argv):  # `-m` or a console script
        return _forked(argv, env)
    return subprocess.run(argv, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)


def _forked(argv: tuple[str, ...], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``python -m`` forked from the template that imported vLLM once (launch/forked.py, as
    the test session's servers are): ~1 s, not vLLM's ~12 s of imports. Its output and
    errors share one log, given as both."""
    from launch.procs import ManagedProcess

    with tempfile.TemporaryDirectory() as tmp:
        proc = ManagedProcess("help", argv, Path(tmp) / "help.log", env=env, forked=True)
        try:
            rc = proc.start().wait_exit(stall=300)
        finally:
            proc.stop()
        out = proc.log_path.read_text(errors="replace")
    return subprocess.CompletedProcess(argv, rc, out, out)


def _check(done: subprocess.CompletedProcess[str], what: str) -> str:
    assert done.returncode == 0, f"{what} --help exited {done.returncode}:\n{done.stderr[-3000:]}"
    assert done.stdout.lstrip().startswith("usage:"), f"{what}: {done.stdout[:500]!r}"
    assert "-h, --help" in done.stdout or "--help" in done.stdout, what
    return done.stdout


def test_every_runnable_module_is_found() -> None:
    """The discovery below sees the documented entry points (a guard against a silent miss)."""
    found = set(_modules())
    for name in (
        "api",
        "env_server",
        "trainer",
        "vllm_patching.serve",
        "env_server.evaluate",
        "env_server.data",
        "trainer.tiny_model",
        "launch.run_all",
        "launch.report",
        "bench.sync.bridge_sync",
        "bench.peers.peer_trl",
        "bench.report.build",
    ):
        assert name in found, (name, sorted(found))


@pytest.mark.parametrize("module", _modules())
def test_module_help(module: str) -> None:
    out = _check(_run([sys.executable, "-m", module, "--help"]), f"python -m {module}")
    assert "--" in out.split("usage:", 1)[1]  # it lists options
    prog = "launch/run_all.sh" if module == "launch.run_all" else f"python -m {module}"
    assert out.startswith(f"usage: {prog} "), out.splitlines()[0]  # how to call it


@pytest.mark.parametrize("command", ["sft", "grpo"])
def test_trainer_command_help(command: str) -> None:
    out = _check(_run([sys.executable, "-m", "trainer", command, "--help"]), f"trainer {command}")
    assert "--training-steps" in out and "--save-path" in out
    assert "--clip-eps" not in out  # one name per setting: --clip-low, --clip-high


@pytest.mark.parametrize("name", sorted(_scripts()))
def test_console_script_help(name: str) -> None:
    """The function pyproject.toml installs as ``name``, called as that script is."""
    _check(_run([sys.executable, "-m", ENTRY, _scripts()[name], name, "--help"]), name)


def test_serve_help_shows_the_bridge_options_and_vllms() -> None:
    """It used to exit with "--model is required"; now the bridge's options, then vLLM's."""
    out = _check(_run([sys.executable, "-m", "vllm_patching.serve", "--help"]), "serve")
    for flag in (
        "--weight-bridge-mode",
        "--single-copy",
        "--bridge-lora-keep",
        "--recipe",
        "--model",
    ):
        assert flag in out
    assert "vLLM's options" in out and "--tensor-parallel-size" in out  # vLLM's own help


def test_serve_without_model_names_help() -> None:
    done = _run([sys.executable, "-m", "vllm_patching.serve", "--weight-bridge-mode", "none"])
    assert done.returncode != 0
    assert "--model is required (--help lists the options)" in done.stderr


def test_run_all_sh_help_shows_defaults_and_choices() -> None:
    out = _check(_run([str(REPO_ROOT / "launch" / "run_all.sh"), "--help"]), "run_all.sh")
    assert "--preset {cpu-tiny,cpu-smol,gpu-0.5b,gpu-3b}" in out
    assert "--weight-bridge-mode {shared_vllm,lora_only,none}" in out
    flat = " ".join(out.split())
    assert "--training-steps int GRPO training steps (``trainer.grpo.training_steps``)" in flat
    assert "--trainer.grpo.lr float" in flat and "--env.group-size int" in flat  # dotted
    assert "--trainer.grpo.clip-low float" in flat and "clip-eps" not in flat
    assert "(default: shared_vllm)" in flat and "(default: cpu-tiny)" in flat
    assert "report.html" in flat and "SHOP_R1_PROGRESS" in flat
