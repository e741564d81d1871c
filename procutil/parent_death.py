"""A process dies with its parent: ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` (Linux), then a
SIGKILL to itself if the parent has already changed (it died before the request, so the
kernel will never send the signal).

Two callers: ``launch.lifeline.die_with_parent`` runs ``die_with`` between fork and exec (a
``preexec_fn``), and ``trainer.agent_death.die_with_agent`` runs it as a torchrun rank starts.
So ``die_with`` takes no lock, logs nothing and imports nothing: libc is resolved when this
module loads, not at the call.

The kernel watches the parent *thread* that forked the child: a child started from a
thread that ends is killed then, although its parent process runs on. Callers see to it
(the lifeline only asks from the main thread; torchrun's agent starts its ranks from its
main thread).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import signal
import sys

PR_SET_PDEATHSIG = 1

_prctl = None
if sys.platform.startswith("linux"):
    with contextlib.suppress(OSError):
        _prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here, never at fork time

SUPPORTED = _prctl is not None
"""Whether ``die_with`` can work here (Linux, with a libc that has ``prctl``)."""


def die_with(parent: int) -> int:
    """Ask for SIGKILL when this process's parent exits, and SIGKILL this process now if
    its parent is no longer ``parent`` (read before: the starter's PID, or ``os.getppid()``
    as early as possible). Safe between fork and exec (no lock, no logging, no import).
    Returns 0, or the errno of a failed request (``ENOSYS`` where not ``SUPPORTED``)."""
    if _prctl is None:
        return errno.ENOSYS
    failed = _prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0
    err = ctypes.get_errno() if failed else 0
    if os.getppid() != parent:  # the parent died before the request: nobody will signal us
        os.kill(os.getpid(), signal.SIGKILL)
    return err
