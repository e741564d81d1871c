"""Installing packages into a virtualenv as ``make setup`` does: with uv
(https://docs.astral.sh/uv/) where it is installed, given pip's settings, else with pip.

uv installs the same set as pip, faster (docs/results/suite_timings.md): the suite's
atroposlib and verifiers venvs took ~50 CPU-seconds each with pip. uv reads no pip
configuration, so :func:`uv_flags` turns pip's settings (pip.conf and ``PIP_*`` variables,
ranked as pip ranks them: ``:env:`` over ``install`` over ``global``) into uv's flags. pip
takes the best file of the best version across all indexes; uv, with ``unsafe-best-match``,
the best version across all, but its files only from the first index that has that
version, so pip's main index (PyPI unless set) goes first: extra indexes that mirror part
of it then change no wheel. pip splits these settings on whitespace, so no value holds a
space.

Standard library only: the Makefile runs this file as a script (``python
procutil/pip_install.py``, also ``python -m procutil.pip_install``, prints the flags) before
the project is installed.
"""

from __future__ import annotations

import argparse
import ast
import shutil
import subprocess
import sys
from pathlib import Path

PYPI = "https://pypi.org/simple"
RANK = {"global": 0, "install": 1, ":env:": 2}
"""pip's configuration scopes, lowest first."""


def uv_flags(listing: str | None = None) -> list[str]:
    """uv's flags for pip's settings (``listing``: ``pip config list``'s output; read from
    this interpreter's pip when not given)."""
    if listing is None:
        listing = subprocess.run(
            [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True
        ).stdout
    conf: dict[str, tuple[int, str]] = {}
    for line in listing.splitlines():
        key, _, value = line.partition("=")
        scope, _, name = key.rpartition(".")
        if scope in RANK and RANK[scope] >= conf.get(name, (-1, ""))[0]:
            conf[name] = (RANK[scope], ast.literal_eval(value))

    def values(name: str) -> list[str]:
        return conf.get(name, (0, ""))[1].split()

    flags = [f"--find-links={v}" for v in values("find-links")]
    flags += [f"--constraints={v}" for v in values("constraint")]
    main, extra = values("index-url")[:1], values("extra-index-url")
    if extra:
        flags += [f"--extra-index-url={v}" for v in (main or [PYPI]) + extra]
    flags += [f"--index-url={v}" for v in main]
    return flags


def find_uv() -> Path | None:
    """uv beside this interpreter (``make setup`` puts it in the project's venv), else on
    ``PATH``."""
    beside = Path(sys.executable).parent / "uv"
    if beside.exists():
        return beside
    found = shutil.which("uv")
    return Path(found) if found else None


def install_command(python: Path | str, quiet: bool = True) -> list[str]:
    """The command that installs requirements (appended to it) into the venv of ``python``,
    writing no bytecode up front (the few modules a run imports compile on first use)."""
    uv = find_uv()
    if uv is not None:
        argv = [str(uv), "pip", "install", "--python", str(python)]
        argv += ["--index-strategy", "unsafe-best-match", *uv_flags()]
    else:
        argv = [str(python), "-m", "pip", "install", "--no-compile"]
        argv += ["--disable-pip-version-check"]
    return [*argv, "--quiet"] if quiet else argv


def main(argv: list[str] | None = None) -> None:
    """Print pip's settings as uv's flags, on one line (what ``make setup`` hands uv)."""
    argparse.ArgumentParser(
        "python -m procutil.pip_install",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    ).parse_args(argv)
    print(" ".join(uv_flags()))


if __name__ == "__main__":
    main()
