"""docs/CODE_MAP.md matches the tree: every file, folder and module it names in backticks
exists, and README.md links it (issue #19, item 9)."""

from __future__ import annotations

import re

import pytest

from launch.procs import REPO_ROOT

pytestmark = pytest.mark.unit
CODE_MAP = REPO_ROOT / "docs" / "CODE_MAP.md"
PACKAGES = ("api", "env_server", "launch", "procutil", "settings", "trainer", "vllm_patching")
FILE = re.compile(r"[\w./]+\.(py|sh|md|yaml)|[\w/]+/")
"""A file (``api/store.py``, ``parse.py``) or a folder (``trainer/gail/``)."""
MODULE = re.compile(rf"(?:{'|'.join(PACKAGES)})(?:\.\w+)+")
"""A dotted first-party module (``launch.vllm_server``), possibly ending in an attribute."""


def _names() -> list[str]:
    return re.findall(r"`([^`\s]+)`", CODE_MAP.read_text())


def _first_party_names() -> set[str]:
    """Names a row of the map may use relative to its package: ``parse.py``, ``gail/``."""
    out = set()
    for top in (*PACKAGES, "tests"):
        for p in (REPO_ROOT / top).rglob("*"):
            if "__pycache__" not in p.parts:
                out.add(p.name + "/" if p.is_dir() else p.name)
    return out


def _module_exists(dotted: str) -> bool:
    """``a.b.c`` is a module or package, or ``a.b`` is one that defines ``c``."""
    parts = dotted.split(".")
    base = REPO_ROOT.joinpath(*parts)
    if base.with_suffix(".py").is_file() or (base / "__init__.py").is_file():
        return True
    parent = REPO_ROOT.joinpath(*parts[:-1])
    for source in (parent.with_suffix(".py"), parent / "__init__.py"):
        if source.is_file():
            return (
                re.search(rf"^(def|class) {parts[-1]}\b|^{parts[-1]} =", source.read_text(), re.M)
                is not None
            )
    return False


def test_the_map_names_only_what_exists() -> None:
    relative = _first_party_names()
    missing = []
    for name in _names():
        if name.startswith("/") or name.startswith("<"):
            continue  # a route or a placeholder, not a path
        if FILE.fullmatch(name):
            nested = "/" in name.rstrip("/")  # a path from the repository's root
            if not (REPO_ROOT / name).exists() and (nested or name not in relative):
                missing.append(name)
        elif MODULE.fullmatch(name) and not _module_exists(name):
            missing.append(name)
    assert missing == []


def test_the_map_sees_the_paths() -> None:
    """A guard against a pattern that matches nothing."""
    names = _names()
    assert "api/store.py" in names and "vllm_patching.protocol" in names
    assert all(FILE.fullmatch(n) for n in ("trainer/gail/", "parse.py", "launch/run_all.sh"))


def test_readme_and_interfaces_link_the_map() -> None:
    assert "docs/CODE_MAP.md" in (REPO_ROOT / "README.md").read_text()
    assert "CODE_MAP.md" in (REPO_ROOT / "docs" / "INTERFACES.md").read_text()
