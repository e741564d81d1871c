"""Test-only fault points: freeze chosen processes when a process reaches a chosen point, for
certain rather than by timing.

``SHOP_R1_TEST_FAULT=<point>:<pid>[,<pid>...]`` makes the process that reaches ``<point>``
SIGSTOP those processes (``self``: itself) the first time it reaches it. The points:

- a weight sync's phases in the trainer (``check``, ``connect``, ``stage``, ``transfer``,
  ``apply``, ``close``; trainer/bridge/deadline.py): just before the phase's first call, so
  the phase meets a frozen server (tests/integration/trainer/test_sync_deadlines.py);
- ``checkpointed``: right after the trainer wrote a checkpoint (GRPO: and acked its batches),
  before the next step, in GRPO and SFT alike (tests/integration/launch/test_launch_oom.py:
  the trainer stops itself there, the test moves it into a memory cgroup and continues it,
  so its next step runs out of memory whatever the box's speed;
  tests/integration/trainer/test_trainer_sft.py kills the stopped SFT and resumes it);
- ``engine_core_forked``: in vLLM's engine core, right after a CPU server forked it
  (vllm_patching/plugin.py), so the server cannot finish starting
  (tests/integration/vllm_patching/test_start_sigterm.py stops the server then).

Unset (every real run), a point costs one environment lookup. It imports no package of ours
(``procutil``), so the trainer and the vLLM plugin share it.
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
