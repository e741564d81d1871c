"""The launcher lets its services write bytecode caches where the environment says not to
(``PYTHONDONTWRITEBYTECODE=1``, as some sandboxes set): the install compiles none (Makefile),
so the first service that imports a module must be able to write its ``.pyc``. The services
inherit the launcher's environment, so the variable must be gone from it before anything
starts -- checked with ``--help``, which parses the options and starts nothing."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from launch.run_all import main

pytestmark = pytest.mark.unit


def test_the_launcher_drops_the_no_bytecode_variable_before_it_starts_anything(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0 and "--preset" in capsys.readouterr().out
    assert "PYTHONDONTWRITEBYTECODE" not in os.environ
    child = [sys.executable, "-c", "import sys; print(sys.dont_write_bytecode)"]
    assert subprocess.run(child, capture_output=True, text=True, check=True).stdout == "False\n"
