"""A SIGTERM while the vLLM server starts ends it at once (``vllm_patching.serve``).

vLLM 0.32's API server answers a SIGTERM that arrives before uvicorn runs by raising
``KeyboardInterrupt`` from its handler (``run_server``'s ``_interrupt_init`` in
``vllm/entrypoints/launchers/api_server/entry.py``). Under uvloop that does not end the
process once its engine core is starting: the engine core shuts down on its own SIGTERM and
the API server then waits for it for good (measured on the tiny model, plain and forked
starts alike: no exit 25 s after the signal; the launcher's stop waited its 20 s and
SIGKILLed it, so a Ctrl-C during a run's start took 20 s more than it should).

Until uvicorn installs its own handlers (from then on a SIGTERM stops the server gracefully,
as before), :func:`end_the_start` takes SIGTERM instead: it passes the signal on to the
server's child processes (its engine core, which shuts down on it), waits up to
``CHILDREN_GRACE`` seconds for them, kills what is left (and waits for it to go), and ends
this process by the same signal, so whoever started it sees it killed by SIGTERM (exit -15), as a start interrupted
during vLLM's imports already was.
"""

from __future__ import annotations

import contextlib
import os
import signal
from types import FrameType
from typing import Any

CHILDREN_GRACE = 5.0
"""Seconds the server's children get to exit on SIGTERM before they are killed."""
_MARK = "_shop_r1_ends_start_on_sigterm"


def end_the_start(signum: int = signal.SIGTERM, frame: FrameType | None = None) -> None:
    """SIGTERM's handler until uvicorn runs: stop the children, then die by the signal."""
    import psutil

    children = psutil.Process().children(recursive=True)
    for child in children:
        with contextlib.suppress(psutil.Error):
            child.send_signal(signal.SIGTERM)
    _, alive = psutil.wait_procs(children, timeout=CHILDREN_GRACE)
    for child in alive:
        with contextlib.suppress(psutil.Error):
            child.kill()
    psutil.wait_procs(alive, timeout=CHILDREN_GRACE)  # gone (reaped) before this process is
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def install() -> None:
    """Have vLLM's ``run_server`` install :func:`end_the_start` right after its own SIGTERM
    handler: its ``setup_server`` (called next) is wrapped. Idempotent."""
    from vllm.entrypoints.launchers.api_server import entry

    original = entry.setup_server
    if getattr(original, _MARK, False):
        return

    def setup_server(*args: Any, **kwargs: Any) -> Any:
        signal.signal(signal.SIGTERM, end_the_start)
        return original(*args, **kwargs)

    setattr(setup_server, _MARK, True)
    entry.setup_server = setup_server
