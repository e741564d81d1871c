"""procutil.pip_install: pip's settings as uv's flags (ranked as pip ranks them, PyPI first)
and the install command with uv or, without it, pip."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from procutil import pip_install

pytestmark = pytest.mark.unit

LISTING = """global.extra-index-url='file:///opt/pypi/simple file:///opt/more/simple'
global.find-links='/global/wheels'
global.constraint='/etc/xdg/pip/constraints.txt'
:env:.find-links='/opt/wheels'
:env:.default-timeout='180'
"""


def test_pips_settings_become_uvs_flags_env_over_global_pypi_first() -> None:
    assert pip_install.uv_flags(LISTING) == [
        "--find-links=/opt/wheels",  # :env: beats global
        "--constraints=/etc/xdg/pip/constraints.txt",
        "--extra-index-url=https://pypi.org/simple",  # pip's main index goes first
        "--extra-index-url=file:///opt/pypi/simple",
        "--extra-index-url=file:///opt/more/simple",
    ]


def test_a_main_index_is_kept_first_and_nothing_set_is_no_flag() -> None:
    listing = "install.index-url='https://mirror/simple'\nglobal.extra-index-url='file:///x'\n"
    assert pip_install.uv_flags(listing) == [
        "--extra-index-url=https://mirror/simple",
        "--extra-index-url=file:///x",
        "--index-url=https://mirror/simple",
    ]
    assert pip_install.uv_flags("") == []


def test_the_install_command_uses_uv_and_else_pip(monkeypatch: pytest.MonkeyPatch) -> None:
    py = Path("/venv/bin/python")
    monkeypatch.setattr(pip_install, "uv_flags", lambda: ["--find-links=/w"])
    monkeypatch.setattr(pip_install, "find_uv", lambda: Path("/bin/uv"))
    assert pip_install.install_command(py) == [
        "/bin/uv",
        "pip",
        "install",
        "--python",
        str(py),
        "--index-strategy",
        "unsafe-best-match",
        "--find-links=/w",
        "--quiet",
    ]
    monkeypatch.setattr(pip_install, "find_uv", lambda: None)
    assert pip_install.install_command(py, quiet=False) == [
        str(py),
        "-m",
        "pip",
        "install",
        "--no-compile",
        "--disable-pip-version-check",
    ]


def test_uv_is_found_beside_this_interpreter_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "python").touch()
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    assert pip_install.find_uv() is None
    (tmp_path / "uv").touch()
    assert pip_install.find_uv() == tmp_path / "uv"
