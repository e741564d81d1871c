"""Reproducible sampling: what makes two runs of one seed train on the same groups.

Three things make a run's batches depend on timing, and each has its counterpart here:

- **which samples**: vLLM draws an unseeded request's tokens from its one random stream, in the
  order it schedules concurrent requests. Every rollout asks with a seed of its own instead
  (``sample_seed``: the env's seed and the rollout's draw number; vLLM seeds a group's i-th
  completion with seed + i), so the same weights give the same completions.
- **which weights**: an env that samples ahead while the trainer trains gets some groups from
  the old weights and some from the new, as the sync happens to fall. ``Lockstep`` samples a
  batch's groups only once the version they are for is live, and exactly the trainer's batch.
- **which batch**: the API forms batches in arrival order, and concurrent rollouts arrive as
  they finish. ``PushOrder`` pushes them in the order they were drawn.

The launcher turns all three on with ``--reproducible`` (docs/RUNNING.md, "Reproducible runs").
"""

from __future__ import annotations

import asyncio
import random

__all__ = ["Lockstep", "PushOrder", "sample_seed"]


def sample_seed(seed: int, draw: int) -> int:
    """vLLM's seed for the env's ``draw``-th rollout (0-based) under the env's ``seed``."""
    return random.Random(f"rollout-{seed}-{draw}").randrange(2**31 - 1024)


class Lockstep:
    """How many more rollouts may start: ``groups`` pushed per batch, a batch sampled only at
    its own policy version. A batch is keyed by (policy version, batches skipped): the trainer
    takes it, trains, syncs and reports the next version; or skips it (a non-finite gradient,
    the version unchanged) and waits for another at the same version."""

    def __init__(self, groups: int) -> None:
        if groups < 1:
            raise ValueError(f"lockstep needs at least one group a batch, got {groups}")
        self.groups = groups
        self.key: tuple[int, int] | None = None
        self.pushed = 0

    def room(self, key: tuple[int, int], in_flight: int) -> int:
        """Rollouts that may start now for the batch ``key`` (the API's live version and its
        count of skipped batches) with ``in_flight`` still running. A new key starts a new
        batch once the last one's rollouts have all ended (none of them counts for it)."""
        if key != self.key:
            if in_flight:
                return 0
            self.key, self.pushed = key, 0
        return max(0, self.groups - self.pushed - in_flight)

    def pushed_one(self) -> None:
        """A rollout of the current batch reached the API (a dropped or failed one did not)."""
        self.pushed += 1


class PushOrder:
    """Rollouts pushed in the order they were drawn: draw ``k`` pushes once every earlier draw
    has pushed, been dropped or failed (``finish``), whichever finishes sampling first."""

    def __init__(self) -> None:
        self.next = 0
        self._done: set[int] = set()
        self._waiting: dict[int, asyncio.Event] = {}

    async def turn(self, draw: int) -> None:
        """Wait until ``draw`` is the earliest draw not finished."""
        if draw != self.next:
            await self._waiting.setdefault(draw, asyncio.Event()).wait()

    def finish(self, draw: int) -> None:
        """``draw`` is done (pushed, dropped or failed); wakes the next one if it waits."""
        self._done.add(draw)
        while self.next in self._done:
            self._done.remove(self.next)
            self.next += 1
        event = self._waiting.pop(self.next, None)
        if event is not None:
            event.set()
