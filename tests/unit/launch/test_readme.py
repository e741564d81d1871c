"""README.md is a front door a newcomer follows verbatim (issue 47): every link it gives
resolves, every ``make`` target it names exists, every ``launch/run_all.sh`` line in its code
blocks is accepted by the launcher's own parser and resolves to a run config, and every
``python -m`` module it names is importable. The same for the pages it sends people to first."""

from __future__ import annotations

import importlib.util
import re
import shlex
from pathlib import Path

import pytest

from launch.run_config import resolve_run
from settings.paths import REPO_ROOT

pytestmark = pytest.mark.unit
PAGES = [REPO_ROOT / "README.md", REPO_ROOT / "docs" / "RUNNING.md"]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def _code_lines(page: Path) -> list[str]:
    """The lines of a page's fenced code blocks, continuation lines joined."""
    text, out = page.read_text(), []
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S):
        out += block.replace("\\\n", " ").splitlines()
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_link_resolves(page: Path) -> None:
    for target in LINK.findall(page.read_text()):
        if target.startswith(("http://", "https://")):
            continue
        assert (page.parent / target).exists(), f"{page.name} links {target}, which is missing"


def test_every_make_target_exists() -> None:
    makefile = (REPO_ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z][a-z-]*):", makefile, flags=re.M))
    named = set(re.findall(r"`make ([a-z][a-z-]*)", (REPO_ROOT / "README.md").read_text()))
    assert named and named <= targets, named - targets


def test_every_run_all_line_in_the_readme_resolves() -> None:
    lines = [x for x in _code_lines(REPO_ROOT / "README.md") if x.startswith("launch/run_all.sh")]
    assert len(lines) >= 5
    for line in lines:
        argv = shlex.split(line.split("#", 1)[0])[1:]
        resolve_run(argv, environ={})  # an unknown flag or a bad value exits with its name


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_python_module_named_exists(page: Path) -> None:
    text = page.read_text()
    modules = set(re.findall(r"python -m ([a-z_][a-z0-9_.]*)", text))
    assert modules
    for name in modules:
        assert importlib.util.find_spec(name) is not None, f"{page.name}: python -m {name}"
