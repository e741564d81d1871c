"""Batch formation, fair share, staleness, leases and backpressure on the storage layer."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from api.protocol import ScoredGroup
from api.store import Store, UnknownBatch

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.t = 1_000_000.0

    def __call__(self) -> float:
        return self.t


def group(gid: str, env: str = "a", version: int = 0, n_seqs: int = 2, length: int = 10):
    seq = {
        "tokens": list(range(length)),
        "mask": [0] * (length - 1) + [1],
        "logprobs": [0.0] * length,
        "score": 1.0,
    }
    return ScoredGroup.model_validate(
        {"group_id": gid, "env": env, "policy_version": version, "sequences": [seq] * n_seqs}
    )


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def store(tmp_path: Path, clock: Clock) -> Store:
    s = Store(tmp_path / "api.sqlite", max_staleness=2, synchronous="NORMAL", clock=clock)
    yield s
    s.close()


def served_ids(batch) -> list[str]:
    import json

    return [json.loads(p)["group_id"] for p in batch.payloads]


def test_duplicates_are_stored_once(store: Store) -> None:
    r = store.ingest([group("g1"), group("g2"), group("g1")])
    assert (r.accepted, r.duplicates) == (2, 1)
    assert store.ingest([group("g2")]).duplicates == 1
    status = store.status()
    assert status["queued_groups"] == 2
    assert status["envs"][0]["duplicate_groups"] == 2


def test_sequence_budget_never_splits_groups(store: Store) -> None:
    store.ingest([group(f"g{i}", n_seqs=3) for i in range(5)])
    batch = store.lease(None, 7, 60)  # 3 + 3 fit, a third group would make 9
    assert served_ids(batch) == ["g0", "g1"]
    assert store.status()["envs"][0]["leased_groups"] == 2


def test_token_budget(store: Store) -> None:
    store.ingest([group(f"g{i}", n_seqs=2, length=10) for i in range(6)])  # 20 tokens each
    batch = store.lease(50, None, 60)
    assert served_ids(batch) == ["g0", "g1"]
    both = store.lease(1000, 3, 60)  # the tighter budget wins: one 2-sequence group
    assert served_ids(both) == ["g2"]


def test_not_enough_data_returns_none_unless_partial(store: Store) -> None:
    store.ingest([group("g0", n_seqs=2)])
    assert store.lease(None, 8, 60) is None
    assert store.status()["queued_groups"] == 1  # nothing was taken
    assert served_ids(store.lease(None, 8, 60, allow_partial=True)) == ["g0"]


def test_oversized_group_is_served_alone_instead_of_blocking(store: Store) -> None:
    store.ingest([group("big", n_seqs=10), group("small", n_seqs=1)])
    assert served_ids(store.lease(None, 4, 60)) == ["big"]
    assert served_ids(store.lease(None, 1, 60)) == ["small"]


def test_weighted_fair_share(store: Store) -> None:
    store.register_env("a", weight=3.0, group_size=1)
    store.register_env("b", weight=1.0, group_size=1)
    store.ingest([group(f"a{i}", env="a", n_seqs=1) for i in range(200)])
    store.ingest([group(f"b{i}", env="b", n_seqs=1) for i in range(200)])
    counts: Counter[str] = Counter()
    for _ in range(20):  # many small batches: the share must hold across batches too
        for gid in served_ids(store.lease(None, 4, 60)):
            counts[gid[0]] += 1
    assert counts["a"] + counts["b"] == 80
    assert counts["a"] == pytest.approx(60, abs=2)


def test_an_env_without_data_does_not_stall_batches(store: Store) -> None:
    store.register_env("idle", weight=100.0, group_size=4)
    store.ingest([group(f"g{i}", env="busy", n_seqs=1) for i in range(4)])
    assert len(served_ids(store.lease(None, 4, 60))) == 4


def test_returning_env_gets_no_burst_of_old_credit(store: Store) -> None:
    store.register_env("a", 1.0, 1)
    store.register_env("b", 1.0, 1)
    store.ingest([group(f"a{i}", env="a", n_seqs=1) for i in range(100)])
    for _ in range(10):  # only a has data for a while
        store.lease(None, 4, 60)
    store.ingest([group(f"b{i}", env="b", n_seqs=1) for i in range(100)])
    ids = served_ids(store.lease(None, 10, 60))
    assert sum(i.startswith("b") for i in ids) == 5  # an equal split, not 10 b's


def test_stale_groups_are_dropped_and_counted(store: Store) -> None:
    store.ingest([group("v0", version=0), group("v3", version=3)])
    assert store.set_policy_version(3) == 1  # v0 is 3 behind, max_staleness is 2
    late = store.ingest([group("late", version=0)])  # already too old on arrival
    assert (late.accepted, late.stale) == (1, 1)
    assert served_ids(store.lease(None, 100, 60, allow_partial=True)) == ["v3"]
    status = store.status()
    assert status["dropped_groups"] == 2
    assert status["envs"][0]["dropped_groups"] == 2


def test_expired_lease_returns_groups(store: Store, clock: Clock) -> None:
    store.ingest([group("g0"), group("g1")])
    first = store.lease(None, 4, lease_seconds=10)
    assert store.lease(None, 4, 10) is None  # all leased
    clock.t += 11
    second = store.lease(None, 4, 10)
    assert served_ids(second) == ["g0", "g1"]
    assert store.status()["expired_leases"] == 1
    # The late ack of the first batch finds its groups leased again: it acks none of them.
    assert store.ack(first.batch_id) == ("acked_late", 0)
    assert store.ack(second.batch_id) == ("acked", 2)


def test_late_ack_acks_groups_still_queued(store: Store, clock: Clock) -> None:
    store.ingest([group("g0")])
    batch = store.lease(None, 2, lease_seconds=5)
    clock.t += 6
    assert store.status()["expired_leases"] == 1  # expiry is applied by the next lease/status
    assert store.ack(batch.batch_id) == ("acked_late", 1)
    assert store.lease(None, 2, 5, allow_partial=True) is None


def test_ack_is_idempotent_and_unknown_batches_raise(store: Store) -> None:
    store.ingest([group("g0")])
    batch = store.lease(None, 2, 60)
    assert store.ack(batch.batch_id) == ("acked", 1)
    assert store.ack(batch.batch_id) == ("already_acked", 0)
    with pytest.raises(UnknownBatch):
        store.ack("nope")


def test_skip_marks_a_batch_untrained_and_never_serves_it_again(store: Store, clock: Clock) -> None:
    """A batch the trainer could not train on (non-finite gradient): skipped, not acked, gone
    from the queue, counted apart; skipping is idempotent and cannot undo an ack."""
    store.ingest([group("g0"), group("g1")])
    batch = store.lease(None, 2, 60)
    assert store.skip(batch.batch_id) == ("skipped", 1)
    assert store.skip(batch.batch_id) == ("already_skipped", 0)
    assert store.ack(batch.batch_id) == ("already_skipped", 0)  # never turned into trained
    status = store.status()
    assert status["skipped_batches"] == 1 and status["envs"][0]["skipped_groups"] == 1
    assert status["acked_batches"] == 0 and status["envs"][0]["acked_groups"] == 0
    nxt = store.lease(None, 2, 60)
    assert served_ids(nxt) == ["g1"]  # g0 is never served again
    assert store.ack(nxt.batch_id) == ("acked", 1)
    assert store.skip(nxt.batch_id) == ("already_acked", 0)  # an ack stays an ack
    store.ingest([group("g2")])
    late = store.lease(None, 2, lease_seconds=5)
    clock.t += 6
    assert store.status()["expired_leases"] == 1  # applied by the next lease/status call
    assert store.skip(late.batch_id) == ("skipped_late", 1)
    with pytest.raises(UnknownBatch):
        store.skip("nope")


def test_backpressure_bounds_the_queue_by_staleness(store: Store) -> None:
    store.register_env("a", 1.0, group_size=4)
    store.register_env("b", 1.0, group_size=4)
    store.lease(None, 16, 60)  # the trainer's batch size: 16 sequences
    capacity = (2 + 1) * 16  # max_staleness 2 -> at most 3 batches queued
    wanted_a, version = store.wanted("a")
    assert (wanted_a, version) == (capacity // 2 // 4, 0)
    store.ingest([group(f"a{i}", env="a", n_seqs=4) for i in range(wanted_a)])
    assert store.wanted("a")[0] == 0
    assert store.wanted("b")[0] == capacity // 2 // 4
    store.set_connected("b", False)  # b leaves: a may use the whole room
    assert store.wanted("a")[0] == (capacity - wanted_a * 4) // 4


def test_state_survives_reopen(tmp_path: Path, clock: Clock) -> None:
    path = tmp_path / "db.sqlite"
    s = Store(path, clock=clock)
    s.register_env("a", 2.0, 1)
    s.ingest([group("g0", env="a"), group("g1", env="a")])
    s.set_policy_version(5)  # version 0 < 5 - max_staleness: both dropped
    s.ingest([group("g2", env="a", version=5)])
    batch = s.lease(None, 2, 60)
    s.close()
    s2 = Store(path, clock=clock)
    assert s2.policy_version == 5
    assert s2.ack(batch.batch_id) == ("acked", 1)
    assert s2.ingest([group("g0", env="a")]).duplicates == 1
    env = s2.status()["envs"][0]
    assert (env["weight"], env["dropped_groups"], env["acked_groups"]) == (2.0, 2, 1)
    s2.close()


NATIVE_LEASE_OF_AN_ATROPOS_GROUP = """
import json, sys
from api import routes  # the native routes, as the API's app includes them
from api.protocol import ScoredGroup
from api.store import Row, Store

payload = sys.stdin.read()
store = Store(sys.argv[1], synchronous="NORMAL")
store.ingest_rows([Row("a1", None, 0, 2, 8, payload, "atropos", 0)])
batch = store.lease(None, 2, 30.0)
group = ScoredGroup.model_validate_json(batch.payloads[0])
store.close()
print(json.dumps({"group_id": group.group_id, "masks": [s.mask for s in group.sequences],
                  "loaded": sorted(m for m in sys.modules if m in ("api.atropos_wire", "msgspec"))}))
"""


def test_the_native_lease_path_does_not_load_the_atropos_wire_parser(tmp_path: Path) -> None:
    """A fresh interpreter serves an Atropos group (stored as the Atropos route stores it)
    on a native lease without importing ``api.atropos_wire`` (or msgspec): the conversion is
    ``api.atropos_convert``."""
    import json
    import subprocess
    import sys

    import msgspec

    from api import atropos_wire
    from launch.procs import REPO_ROOT

    item = {"tokens": [[1, 2, 3, 4]] * 2, "masks": [[-100, -100, 3, 4]] * 2, "scores": [1, 0]}
    posted = atropos_wire.prepare(msgspec.Raw(json.dumps(item).encode()), "zeros")
    out = subprocess.run(
        [sys.executable, "-c", NATIVE_LEASE_OF_AN_ATROPOS_GROUP, str(tmp_path / "api.sqlite")],
        input=posted.payload,
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        check=True,
        timeout=120,
    )
    got = json.loads(out.stdout)
    assert got == {"group_id": "a1", "masks": [[0, 0, 1, 1]] * 2, "loaded": []}
