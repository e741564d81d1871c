"""env_server/lockstep.py: the rules that make a seeded run sample the same batches."""

from __future__ import annotations

import asyncio

import pytest

from env_server.lockstep import Lockstep, PushOrder, sample_seed

pytestmark = pytest.mark.unit


def test_a_seed_per_draw_the_same_every_run() -> None:
    seeds = [sample_seed(0, k) for k in range(1000)]
    assert seeds == [sample_seed(0, k) for k in range(1000)]
    assert len(set(seeds)) == 1000  # no two draws of a run share a seed
    assert sample_seed(1, 0) != sample_seed(0, 0)
    assert all(0 <= s < 2**31 - 1024 for s in seeds)  # + a group's index stays an int32


def test_a_batch_is_sampled_once_its_version_is_live() -> None:
    lock = Lockstep(groups=3)
    assert lock.room((0, 0), in_flight=0) == 3
    assert lock.room((0, 0), in_flight=3) == 0
    lock.pushed_one()
    assert lock.room((0, 0), in_flight=1) == 1  # one of the three was dropped: draw another
    lock.pushed_one()
    lock.pushed_one()
    assert lock.room((0, 0), in_flight=0) == 0  # the batch is whole: wait for version 1
    assert lock.room((1, 0), in_flight=0) == 3
    lock.pushed_one()
    # the trainer skipped the batch (version unchanged): another batch at version 1, but
    # only once the draws still running for the skipped one have ended
    assert lock.room((1, 1), in_flight=2) == 0
    assert lock.room((1, 1), in_flight=0) == 3
    with pytest.raises(ValueError, match="at least one group"):
        Lockstep(0)


def test_pushes_keep_the_order_drawn_whatever_finishes_first() -> None:
    async def main() -> list[int]:
        order, pushed = PushOrder(), []

        async def rollout(draw: int, sampling_s: float, push: bool) -> None:
            try:
                await asyncio.sleep(sampling_s)
                if push:
                    await order.turn(draw)
                    pushed.append(draw)
            finally:
                order.finish(draw)

        # later draws finish sampling first; draw 2 is dropped (never pushes)
        times = [0.05, 0.04, 0.0, 0.02, 0.01, 0.0]
        await asyncio.gather(*(rollout(k, t, k != 2) for k, t in enumerate(times)))
        assert order.next == len(times)
        return pushed

    assert asyncio.run(main()) == [0, 1, 3, 4, 5]
