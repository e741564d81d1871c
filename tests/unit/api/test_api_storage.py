"""A full disk at the API, in-process (api/storage.py): the reserve refuses pushes with 507
while leases and acks go on, and SQLite's own ``SQLITE_FULL`` (made real with
``PRAGMA max_page_count``, SQLite's cap on the database's size) is a 507 whose transaction
was rolled back, leaving the store usable. The real full filesystem (a tmpfs that fills up,
the API in its own process, the env's client retrying) is
tests/integration/api/test_api_disk_full.py."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from api.config import ApiConfig
from api.retry import is_transient
from api.storage import is_storage_error
from api.store import Store

pytestmark = pytest.mark.unit


def grp(gid: str, n_tokens: int = 8, n_seqs: int = 2) -> dict:
    seq = {
        "tokens": list(range(n_tokens)),
        "mask": [0] * (n_tokens - 1) + [1],
        "logprobs": [-0.5] * n_tokens,
        "score": 1.0,
    }
    return {"group_id": gid, "env": "e", "policy_version": 0, "sequences": [seq] * n_seqs}


def stored_ids(store: Store) -> set[str]:
    with store.db.locked() as db:
        return {r[0] for r in db.execute("SELECT group_id FROM groups")}


def test_below_the_reserve_pushes_get_507_while_leases_and_acks_go_on(tmp_path: Path) -> None:
    app = create_app(ApiConfig(db_path=tmp_path / "api.sqlite"))
    store: Store = app.state.store
    with TestClient(app) as c:
        assert c.post("/groups", json={"groups": [grp("a"), grp("b")]}).status_code == 200
        free = store.disk.free_bytes()
        assert free is not None and store.disk.min_free_bytes == 64 * 2**20  # the default
        store.disk.min_free_bytes = free + 2**40  # the disk is now "below the reserve"
        r = c.post("/groups", json={"groups": [grp("c")]})
        assert r.status_code == 507 and r.headers["retry-after"] == "5"
        detail = r.json()["detail"]
        assert "below the" in detail and "reserve" in detail and str(tmp_path) in detail
        assert "nothing of this request was stored" in detail
        assert c.get("/backpressure", params={"env": "e"}).json()["wanted"] == 0
        lease = c.post("/batches/lease", json={"max_sequences": 2, "lease_seconds": 30}).json()
        assert c.post(f"/batches/{lease['batch_id']}/ack").json()["status"] == "acked"
        status = c.get("/status").json()
        assert status["storage_low"] is True and status["storage_refusals"] == 1
        assert status["acked_batches"] == 1 and status["queued_groups"] == 1
        assert stored_ids(store) == {"a", "b"}

        store.disk.min_free_bytes = 0  # space is back: taken again, nothing to restart
        assert c.post("/groups", json={"groups": [grp("c")]}).json()["accepted"] == 1
        assert c.get("/backpressure", params={"env": "e"}).json()["wanted"] > 0
        assert c.get("/status").json()["storage_low"] is False
    store.close()


def test_sqlite_full_is_a_507_rolled_back_and_the_store_goes_on(tmp_path: Path) -> None:
    app = create_app(ApiConfig(db_path=tmp_path / "api.sqlite", min_free_mb=0))
    store: Store = app.state.store
    with TestClient(app) as c:
        assert (
            c.post("/groups", json={"groups": [grp(f"ok{i}") for i in range(5)]}).json()["accepted"]
            == 5
        )
        with store.db.locked() as db:
            pages = db.execute("PRAGMA page_count").fetchone()[0]
            db.execute(f"PRAGMA max_page_count={pages + 2}")  # the "disk" is full
        big = [grp(f"big{i}", n_tokens=2000) for i in range(4)]
        r = c.post("/groups", json={"groups": big})
        assert r.status_code == 507, r.text
        assert "SQLITE_FULL" in r.json()["detail"] and "rolled back" in r.json()["detail"]
        with store.db.locked() as db:
            assert not db.in_transaction  # the next transaction can begin
        assert stored_ids(store) == {f"ok{i}" for i in range(5)}  # none of the refused push

        # Concurrent pushes share one group commit: each gets all-or-nothing.
        replies: dict[str, int] = {}

        def push(name: str, groups: list[dict]) -> None:
            replies[name] = c.post("/groups", json={"groups": groups}).status_code

        threads = [
            threading.Thread(
                target=push, args=(f"p{i}", [grp(f"p{i}-{j}", 1500) for j in range(2)])
            )
            for i in range(4)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert set(replies.values()) <= {200, 507}, replies
        stored = stored_ids(store)
        for name, code in replies.items():
            mine = {f"{name}-0", f"{name}-1"}
            assert mine <= stored if code == 200 else not (mine & stored), (name, code)

        lease = c.post("/batches/lease", json={"max_sequences": 4, "lease_seconds": 30})
        assert lease.status_code in (200, 507)  # a lease may need a page too
        with store.db.locked() as db:
            db.execute("PRAGMA max_page_count=1073741823")  # space is back
        r = c.post("/groups", json={"groups": big})
        assert r.json()["accepted"] == 4, r.text
        assert c.get("/status").json()["storage_refusals"] >= 1
        with store.db.locked() as db:
            assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    store.close()


def test_507_is_retried_like_503_by_every_call() -> None:
    request = httpx.Request("POST", "http://x/batches/lease")
    for code in (503, 507):
        err = httpx.HTTPStatusError("x", request=request, response=httpx.Response(code))
        assert is_transient(err, idempotent=False)  # not processed: even a lease is resent
    err = httpx.HTTPStatusError("x", request=request, response=httpx.Response(500))
    assert not is_transient(err, idempotent=False)


def test_which_sqlite_errors_a_disk_explains(tmp_path: Path) -> None:
    db = sqlite3.connect(tmp_path / "t.db")
    db.execute("CREATE TABLE t(x)")
    db.execute("PRAGMA max_page_count=2")
    with pytest.raises(sqlite3.OperationalError) as full:
        db.executemany("INSERT INTO t VALUES(?)", [("x" * 4000,)] * 8)
    assert is_storage_error(full.value)
    with pytest.raises(sqlite3.OperationalError) as syntax:
        db.execute("SELEC 1")
    assert not is_storage_error(syntax.value)  # a bug stays a bug (a 500)
