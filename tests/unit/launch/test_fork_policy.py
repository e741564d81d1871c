"""Which starts fork (launch/forked.py): ``forked`` as given, else ``forking``'s setting for
the forkable commands -- ``python -m MODULE`` with this interpreter, not a verifiers service
nor torchrun."""

from __future__ import annotations

import importlib.machinery
import sys
import types

import pytest

from launch import forked
from launch.forked import forkable, forking, forks

pytestmark = pytest.mark.unit
PY = sys.executable


@pytest.mark.parametrize(
    ("argv", "want"),
    [
        ([PY, "-m", "trainer", "grpo", "--config", "x.yaml"], True),
        ([PY, "-m", "vllm_patching.serve", "--model", "m"], True),
        ([PY, "-m", "env_server.evaluate", "--split", "test"], True),
        ([PY, "-m", "env_server.verifiers", "--config", "v.yaml"], False),  # another venv
        ([PY, "-m", "env_server.verifiers.evaluate", "vf_guess"], False),
        ([PY, "-m", "env_server.verifiersx"], True),  # a module of that prefix, not below it
        ([PY, "-m", "torch.distributed.run", "--nproc-per-node=2", "-m", "trainer"], False),
        (["/other/venv/bin/python", "-m", "trainer"], False),
        ([PY, "-u", "-m", "trainer"], False),
        ([PY, "script.py"], False),
        (["torchrun", "-m", "trainer"], False),
        ([PY, "-m"], False),
    ],
)
def test_forkable(argv: list[str], want: bool) -> None:
    assert forkable(argv) is want


def test_forked_as_given_else_as_forking_says() -> None:
    argv, plain = [PY, "-m", "trainer"], ["torchrun", "-m", "trainer"]
    assert not forks(argv, None)  # the default outside forking: plainly
    assert forks(argv, True) and not forks(argv, False)
    with forking(True):
        assert forks(argv, None) and not forks(plain, None) and not forks(argv, False)
        with forking(False):
            assert not forks(argv, None)
        assert forks(argv, None)  # the outer setting again
    assert not forks(argv, None)


def test_forking_is_undone_when_its_block_raises() -> None:
    with pytest.raises(RuntimeError), forking(True):
        raise RuntimeError("the run failed")
    assert not forks([PY, "-m", "trainer"], None)


@pytest.mark.parametrize(
    ("spec_name", "want"),
    [("launch.run_all", ["launch.run_all"]), ("trainer.__main__", []), (None, [])],
)
def test_the_template_preloads_a_python_m_starters_module(
    monkeypatch: pytest.MonkeyPatch, spec_name: str | None, want: list[str]
) -> None:
    """multiprocessing runs a ``python -m pkg.mod`` starter's module again in each child: the
    template imports it once. A package's ``__main__`` (multiprocessing skips it) or a main
    with no module spec (a script, pytest-xdist's worker) adds nothing."""
    main = types.ModuleType("__main__")
    main.__spec__ = None if spec_name is None else importlib.machinery.ModuleSpec(spec_name, None)
    monkeypatch.setitem(sys.modules, "__main__", main)
    assert forked.starters_main() == want
