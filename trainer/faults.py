"""Test-only fault points: freeze chosen processes when the trainer reaches a chosen point,
for certain rather than by timing.

``SHOP_R1_TEST_FAULT=<point>:<pid>[,<pid>...]`` makes the trainer SIGSTOP those processes
(``self``: the trainer process that reaches the point) the first time it reaches
``<point>``. The points:

- a weight sync's phases (``check``, ``connect``, ``stage``, ``transfer``, ``apply``,
  ``close``; trainer/bridge/deadline.py): just before the phase's first call, so the phase
  meets a frozen server (tests/integration/trainer/test_sync_deadlines.py);
- ``checkpointed``: right after a checkpoint is written (GRPO: and its batches acked),
  before the next step, in GRPO and SFT alike (tests/integration/launch/test_launch_oom.py:
  the trainer stops itself there, the test moves it into a memory cgroup and continues it,
  so its next step runs out of memory whatever the box's speed;
  tests/integration/trainer/test_trainer_sft.py kills the stopped SFT and resumes it).

Unset (every real run), a point costs one environment lookup.
"""

from __future__ import annotations

import logging
import os
import signal

__all__ = ["FAULT_ENV", "fault_point", "reset_faults"]

FAULT_ENV = "SHOP_R1_TEST_FAULT"

log = logging.getLogger(__name__)
_fired: set[str] = set()


def fault_point(point: str) -> None:
    """SIGSTOP the processes ``FAULT_ENV`` names if it names ``point`` (once per setting)."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    want, _, pids = spec.partition(":")
    if want != point or spec in _fired:
        return
    _fired.add(spec)
    for name in (p.strip() for p in pids.split(",") if p.strip()):
        pid = os.getpid() if name == "self" else int(name)
        log.warning("test fault (%s): SIGSTOP pid %d at %r", FAULT_ENV, pid, point)
        for h in logging.getLogger().handlers:  # in the log before the process stops
            h.flush()
        os.kill(pid, signal.SIGSTOP)


def reset_faults() -> None:
    """Forget which settings fired (a test that sets ``FAULT_ENV`` again in one process)."""
    _fired.clear()
