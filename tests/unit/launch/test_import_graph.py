"""No import cycles in the packages (issue #19, item 9), read from the source with ``ast``:
between modules (every import, the lazy ones inside functions too), among the imports that
run when a module is loaded, and between packages.

The cycles that exist today are listed in ``KNOWN_*`` and must match exactly: a new cycle
fails, and so does a listed one that is gone (then remove it from the list).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from launch.procs import REPO_ROOT

pytestmark = pytest.mark.unit
PACKAGES = ("api", "env_server", "launch", "procutil", "settings", "trainer", "vllm_patching")
KNOWN_MODULE_CYCLES: list[list[str]] = []
"""Lazy imports that go both ways (issue #19, item 9): none left."""
KNOWN_PACKAGE_CYCLES: list[list[str]] = []
"""The shared plumbing (configs, paths, ports, ``free_port``) is in ``settings``, which imports
no service; ``launch`` imports the services and no service imports ``launch``."""


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (REPO_ROOT / pkg).rglob("*.py"):
            parts = path.relative_to(REPO_ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path], top_only: bool) -> set[str]:
    """The first-party modules ``name`` imports (``top_only``: at module level only)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_only else list(ast.walk(tree))
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # an attribute: its module
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while (w := stack.pop()) != v:
                comp.append(w)
            if comp:
                out.append(sorted([v, *comp]))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def _graph(top_only: bool) -> dict[str, set[str]]:
    modules = _modules()
    return {m: _imports(m, p, modules, top_only) for m, p in modules.items()}


def test_the_graph_sees_imports() -> None:
    """A guard against a reader that finds nothing: known edges are there."""
    graph = _graph(top_only=False)
    assert "launch.supervisor" in graph["launch.run_all"]
    assert "trainer.rollout_log" in graph["trainer.grpo"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_cycle_among_the_imports_that_run_at_load_time() -> None:
    assert _cycles(_graph(top_only=True)) == []


def test_module_cycles_are_only_the_known_ones() -> None:
    assert _cycles(_graph(top_only=False)) == KNOWN_MODULE_CYCLES


def test_package_cycles_are_only_the_known_ones() -> None:
    packages: dict[str, set[str]] = {p: set() for p in PACKAGES}
    for module, targets in _graph(top_only=False).items():
        for target in targets:
            a, b = module.split(".")[0], target.split(".")[0]
            if a != b:
                packages[a].add(b)
    assert _cycles(packages) == KNOWN_PACKAGE_CYCLES


def test_procutil_imports_no_package_of_ours() -> None:
    """``procutil`` is shared by ``launch`` and the services (the trainer): it must stay a
    leaf, or a service would import ``launch`` through it."""
    graph = _graph(top_only=False)
    for module, targets in graph.items():
        if module.split(".")[0] == "procutil":
            assert {t.split(".")[0] for t in targets} <= {"procutil"}, (module, targets)
    assert "procutil.parent_death" in graph["trainer.agent_death"]
    assert "procutil.parent_death" in graph["launch.lifeline"]
