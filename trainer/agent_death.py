"""A torchrun rank dies with its torchrun.

torch elastic (``torchrun``) starts every rank in a session of its own (``Popen(...,
start_new_session=True)`` in ``torch/distributed/elastic/multiprocessing/subprocess_handler``),
so a signal sent to torchrun's process group reaches torchrun alone. SIGKILL there -- the
OOM killer or a user taking torchrun, the launcher's reaper once its grace is over, a fault
harness -- used to leave the ranks running as orphans: still leasing, training, acking and
writing checkpoints into the save path that a restarted trainer then resumes from and cleans
(docs/FAULT_TOLERANCE.md, "A torn checkpoint": two trainers in one lineage).

``die_with_agent`` asks the kernel to SIGKILL this rank when its parent, torchrun's agent,
exits (``procutil.parent_death.die_with``: ``prctl(PR_SET_PDEATHSIG)``, the primitive the
launcher's children use too; the agent starts its ranks from its main thread, the one the
kernel watches). No torch import: ``python -m trainer`` calls it first thing.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from procutil import parent_death

AGENT_VAR = "TORCHELASTIC_RUN_ID"
"""Set by torch elastic's agent (torchrun) in every rank's environment, and only there."""


def started_by_agent(environ: Mapping[str, str] | None = None) -> bool:
    """Was this process started as a rank by torch elastic's agent (torchrun)?"""
    env = os.environ if environ is None else environ
    return bool(env.get(AGENT_VAR))


def die_with_agent(parent: int, environ: Mapping[str, str] | None = None) -> bool:
    """Under torchrun on Linux: SIGKILL this rank when its parent exits, and now if
    ``parent`` is already gone (this process was reparented). ``parent``: ``os.getppid()``
    read as early as possible (``trainer.PARENT_AT_START``, read as the package loads).
    Returns whether the request was made (False: not a torchrun rank, or not Linux)."""
    if not started_by_agent(environ) or not parent_death.SUPPORTED:
        return False
    if err := parent_death.die_with(parent):  # torchrun already gone: SIGKILLed in there
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG): {os.strerror(err)}")
    return True
