"""``POST /batches/{batch_id}/reject``: the trainer refuses some groups of a leased batch (a
field it cannot honour). They are kept with their reason, never served again, counted in
``/status``; the rest of the batch is acked as usual; idempotent; unknown ids say so."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from api.config import ApiConfig
from api.store import Store, UnknownBatch
from tests.unit.api.test_api_routes import grp
from tests.unit.api.test_api_store import Clock, clock, group, served_ids, store  # noqa: F401

pytestmark = pytest.mark.unit


def test_reject_keeps_the_group_out_of_every_later_batch(tmp_path: Path) -> None:
    with TestClient(create_app(ApiConfig(db_path=tmp_path / "r.sqlite"))) as c:
        c.post("/groups", json={"groups": [grp("a"), grp("b"), grp("c")]})
        lease = c.post("/batches/lease", json={"max_sequences": 4}).json()
        bid = lease["batch_id"]
        assert [g["group_id"] for g in lease["groups"]] == ["a", "b"]
        body = {"groups": [{"group_id": "a", "reason": "images: multimodal"}]}
        r = c.post(f"/batches/{bid}/reject", json=body)
        assert r.json() == {"batch_id": bid, "groups_rejected": 1, "not_in_batch": []}
        assert c.post(f"/batches/{bid}/reject", json=body).json()["groups_rejected"] == 1
        stranger = {"groups": [{"group_id": "c", "reason": "x"}, {"group_id": "zz", "reason": "y"}]}
        assert c.post(f"/batches/{bid}/reject", json=stranger).json()["not_in_batch"] == ["c", "zz"]
        ack = c.post(f"/batches/{bid}/ack").json()
        assert ack["status"] == "acked" and ack["groups_acked"] == 1  # b only
        status = c.get("/status").json()
        assert status["rejected_groups"] == 1 and status["envs"][0]["rejected_groups"] == 1
        assert status["envs"][0]["acked_groups"] == 1
        rest = c.post("/batches/lease", json={"max_sequences": 4, "allow_partial": True}).json()
        assert [g["group_id"] for g in rest["groups"]] == ["c"]  # a is never served again
        assert c.post("/batches/nope/reject", json=body).status_code == 404
        assert c.post(f"/batches/{bid}/reject", json={"groups": []}).status_code == 422
        long = {"groups": [{"group_id": "b", "reason": "x" * 2001}]}
        assert c.post(f"/batches/{bid}/reject", json=long).status_code == 422
        assert c.app.state.store.rejections() == {"a": "images: multimodal"}


def test_store_reject_after_an_expired_lease(store: Store, clock: Clock) -> None:  # noqa: F811
    """A lease that expired put the group back in the queue: the trainer that saw it may
    still refuse it (same batch id); once leased again elsewhere, it is not that batch's."""
    store.ingest([group("g0"), group("g1")])
    first = store.lease(None, 2, lease_seconds=5)
    clock.t += 6
    store.status()  # expires the lease: g0 queued again
    assert store.reject(first.batch_id, {"g0": "why"}) == (1, [])
    store.ingest([group("g2")])
    second = store.lease(None, 4, 60, allow_partial=True)
    assert served_ids(second) == ["g1", "g2"]  # g0 is never served again
    assert store.reject(first.batch_id, {"g1": "why"}) == (0, ["g1"])  # second's now
    with pytest.raises(UnknownBatch):
        store.reject("nope", {"g0": "x"})
