"""``python -m MODULE ARGS`` run as a fork of a template process that imported vLLM once
(multiprocessing's ``forkserver`` with ``PRELOAD``), for a process that starts many Python
services one after another: the test session's vLLM servers, trainers and env services
(docs/TESTING.md).

Importing vLLM is most of a CPU server's start (~14 of ~17 s CPU on the tiny model), and
torch with transformers most of a trainer's (~5 of ~7 s); a fork of the template skips both
(what a trainer or env imports beyond vLLM's imports costs it ~0.5 s). The forked child is
what ``python -m`` would run -- the module as ``__main__`` with ``sys.argv``, the given
environment and working directory, its output in its log, a session (process group) of its
own, torch's thread count from its ``OMP_NUM_THREADS`` -- and is handled like a ``Popen``:
its PID, ``poll``/``wait`` and exit code (negative: the signal that killed it). It dies with the
template (a parent-death signal), and the template with the process that started it (its pipe
closes; the children let go of their copies of it); ``launch.procs.ManagedProcess`` also
registers it with the lifeline's reaper.
As with multiprocessing's spawn, the child imports the starter's main script (if it is one):
a script that starts forked servers keeps its work under ``if __name__ == "__main__"``.

Who forks: a ``ManagedProcess`` given ``forked=True`` (the tests' fixtures), and, within
``forking(True)``, every ``ManagedProcess`` that says neither way and runs a forkable command
(``forks``): the launcher's CPU runs (``launch.fork_services``), whose API, vLLM servers,
env, trainer, evaluations and preparation steps then share one import of vLLM, torch and
transformers instead of paying it in each (docs/results/launcher_fork.md).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from multiprocessing.context import ForkServerContext
from pathlib import Path

from procutil import parent_death

PRELOAD = ["launch.forked", "vllm.entrypoints.openai.api_server", "vllm_patching.serve"]
"""What the template imports once: this module (for its warnings filter, below), vLLM's
OpenAI server (torch, transformers) and ours."""
UNFORKED = ("env_server.verifiers", "torch.distributed.run")
"""Modules (and their submodules) that always start plainly: verifiers' services put another
venv's packages first on their path, which the template's already imported ones would shadow;
torchrun's agent starts its ranks itself (plainly) and owns their signals."""
# A preloaded module that runs again (the starter's main module, which multiprocessing runs in
# every child as spawn does, and the child's own module) makes runpy warn that it is already
# imported. Its first run is in the child before the child's output goes to its log, so the
# warning reached the starter's terminal: 13 lines in a `make run`. Set at import, the filter
# is the template's (it preloads this module) and so every child's from its first line.
warnings.filterwarnings(
    "ignore", r"'.*' found in sys\.modules after import", RuntimeWarning, "runpy"
)
_context: ForkServerContext | None = None
_running: list[ForkedPopen] = []
_by_default = False


def starters_main() -> list[str]:
    """The starting process's main module when it runs as ``python -m PACKAGE.MODULE`` (the
    launcher: ``launch.run_all``), else nothing. multiprocessing runs that module again in
    every child it starts (as ``__mp_main__``, spawn's rule, kept by the forkserver); with it
    in the template's preload the child finds its imports done and only re-runs its body
    (the launcher's children each imported its config and env modules anew, ~1 CPU-s)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    name = getattr(spec, "name", None) or ""
    return [name] if name and not name.endswith("__main__") else []


def forkable(argv: Sequence[str]) -> bool:
    """``argv`` is ``python -m MODULE ...`` with this interpreter, MODULE not in ``UNFORKED``
    (torchrun, another venv's Python or a script start plainly)."""
    if len(argv) < 3 or argv[0] != sys.executable or argv[1] != "-m":
        return False
    return not any(argv[2] == m or argv[2].startswith(m + ".") for m in UNFORKED)


def forks(argv: Sequence[str], forked: bool | None) -> bool:
    """Whether a start of ``argv`` forks: as ``forked`` says, else as ``forking`` set it for
    the forkable commands."""
    return forked if forked is not None else _by_default and forkable(argv)


@contextlib.contextmanager
def forking(on: bool) -> Iterator[None]:
    """Within it, starts that say neither way fork when their command is forkable (``on``)
    or start plainly; the setting before it afterwards."""
    global _by_default
    before, _by_default = _by_default, on
    try:
        yield
    finally:
        _by_default = before


def _let_go_of_the_template() -> None:
    """In the forked child: close the write end of the template's "alive" pipe, which
    multiprocessing hands every child of the template. The template exits when every write
    end is closed; while a child held one, a starter that died before registering that child
    with the reaper (a launcher stopped while forking) left the template, its resource
    tracker and the child running for good. Nothing in the child needs it: a child that
    starts its own forkserver children gets a fresh template (``_forkserver_pid`` is unset)."""
    from multiprocessing import forkserver

    fd = forkserver._forkserver._forkserver_alive_fd
    forkserver._forkserver._forkserver_alive_fd = None
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)


def _run_module(module: str, args: list[str], env: dict, cwd: str, log_path: str) -> None:
    """In the forked child: ``python -m module *args`` with ``env``, ``cwd`` and the log.

    The objects inherited from the template (vLLM's, torch's and transformers' modules) go to
    the garbage collector's permanent generation (``gc.freeze``), as a pre-fork server does:
    a full collection then skips them, where it walked them all (vLLM collects several times
    while a server starts, ~0.5 CPU-s each over the template's heap)."""
    gc.freeze()
    _let_go_of_the_template()
    os.setsid()  # its own process group: stopped as a whole, by its PID
    if parent_death.SUPPORTED:
        parent_death.die_with(os.getppid())  # the template
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    with contextlib.suppress(ImportError):  # ps shows the command, not the template's; and
        import setproctitle  # its first call must see the environment as the process began

        setproctitle.setproctitle(" ".join([sys.executable, "-m", module, *args]))
    os.environ.clear()
    os.environ.update(env)
    torch, threads = sys.modules.get("torch"), env.get("OMP_NUM_THREADS", "")
    if torch is not None and threads.isdigit() and int(threads) > 0:
        # OpenMP read the template's environment when torch loaded it: the child's own count
        torch.set_num_threads(int(threads))
    os.chdir(cwd)
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


class ForkedPopen:
    """The parts of ``subprocess.Popen`` that ``ManagedProcess`` uses, for a forked child."""

    def __init__(self, process: multiprocessing.process.BaseProcess) -> None:
        self._process = process
        self.pid = int(process.pid or 0)
        self.args = process.name

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return None if self._process.is_alive() else self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self._process.exitcode


def _kill_left_running() -> None:
    """At exit (before multiprocessing's own hook would wait for them): the children still
    running get SIGKILL, their groups included."""
    for child in _running:
        if child.poll() is None:
            try:
                os.killpg(child.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            child.wait(10)


LEADS_GROUP_WAIT_S = 60.0
"""How long :func:`fork_module` waits for the child to make its own process group."""


def _until_it_leads_its_group(process: multiprocessing.process.BaseProcess) -> None:
    """Until the forked child has made its own process group (or exited), as a ``Popen`` with
    a new session has when it returns: the child gets there only after multiprocessing's
    start-up in it (which may import the starter's main script), and a group signal sent
    before that found no group and was lost (``signal_group`` ignores a missing group): a
    server stopped right after its start got no SIGTERM and was SIGKILLed after the stop's
    20 s wait. Best effort after ``LEADS_GROUP_WAIT_S``."""
    deadline = time.monotonic() + LEADS_GROUP_WAIT_S
    while process.exitcode is None and time.monotonic() < deadline:
        try:
            if os.getpgid(int(process.pid or 0)) == process.pid:
                return
        except ProcessLookupError:
            return
        time.sleep(0.005)


def fork_module(
    argv: Sequence[str], env: Mapping[str, str], cwd: Path | str, log_path: Path | str
) -> ForkedPopen:
    """Start ``argv`` (``[python, "-m", module, *args]``) as a fork of the template."""
    global _context
    if len(argv) < 3 or argv[1] != "-m":
        raise ValueError(f"a forked start runs `python -m MODULE ...`, not {list(argv)[:3]}")
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload([*PRELOAD, *starters_main()])
        atexit.register(_kill_left_running)
    module, args = argv[2], list(argv[3:])
    # the log exists when this returns, as with a Popen whose output goes to it
    os.close(os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644))
    process = _context.Process(
        target=_run_module,
        args=(module, args, dict(env), str(cwd), str(log_path)),
        name=f"{module} (forked)",
    )
    process.start()
    _until_it_leads_its_group(process)
    child = ForkedPopen(process)
    _running[:] = [c for c in _running if c.poll() is None] + [child]
    return child
