"""The Atropos routes in-process: naming, weights, per-group rejection, pass-through fields,
Atropos's packing and step counting, the ingest buffer, redelivery and ``/status-env``."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from api.atropos_packing import QueueItem, find_groups_summing_to_target, form_batches, grab_exact
from api.config import ApiConfig
from api.store import Store

pytestmark = pytest.mark.unit

REG = {
    "wandb_group": "g",
    "wandb_project": "p",
    "batch_size": 8,
    "max_token_len": 512,
    "checkpoint_dir": "",
    "save_checkpoint_interval": -1,
    "starting_step": 0,
    "num_steps": 100,
}


def item(n: int, tag: int, env_id: int | None = None, **kw) -> dict:
    """A group of ``n`` sequences; ``tag`` makes it unique."""
    tokens = [[tag, s, 7, 8] for s in range(n)]
    return {
        "tokens": tokens,
        "masks": [[-100, -100, 7, 8]] * n,
        "scores": [float(s) for s in range(n)],
        "inference_logprobs": [[0.0, 0.0, -0.5, -0.25]] * n,
        "env_id": env_id,
        **kw,
    }


def env(name: str, **kw) -> dict:
    return {"max_token_length": 512, "desired_name": name, "weight": 1.0, "group_size": 4, **kw}


@pytest.fixture
def client(tmp_path: Path):
    cfg = ApiConfig(db_path=tmp_path / "api.sqlite", synchronous="NORMAL")
    with TestClient(create_app(cfg)) as c:
        yield c
        c.app.state.store.close()


def started(c: TestClient, **reg) -> TestClient:
    c.post("/register", json={**REG, **reg}).raise_for_status()
    assert c.get("/batch").json() == {"batch": None}
    return c


def tags(batch: list[dict]) -> list[int]:
    return [g["tokens"][0][0] for g in batch]


def test_same_name_envs_get_distinct_ids_and_names(client: TestClient) -> None:
    assert client.get("/batch").json()["status"] == "error"  # as Atropos: not registered
    started(client)
    replies = [client.post("/register-env", json=env("toy")).json() for _ in range(3)]
    other = client.post("/register-env", json=env("toy_0")).json()  # a name like a real_name
    assert [r["env_id"] for r in replies] == [0, 1, 2] and other["env_id"] == 3
    assert [r["wandb_name"] for r in replies] == ["toy_0", "toy_1", "toy_2"]
    assert other["wandb_name"] == "toy_0_0"
    for eid in range(4):
        assert client.request("GET", "/status-env", json={"env_id": eid}).status_code == 200
    names = {e["name"] for e in client.get("/status").json()["envs"]}
    assert len(names) == 4


def test_weights_as_atropos_computes_them(client: TestClient) -> None:
    started(client)
    client.post("/register-env", json=env("short", max_token_length=1024))
    client.post("/register-env", json=env("long", max_token_length=4096))
    ignored = client.post("/register-env", json=env("special", weight=-1)).json()
    assert ignored["status"] == "success"

    def status(eid: int) -> dict:
        return client.request("GET", "/status-env", json={"env_id": eid}).json()

    assert status(0)["env_weight"] == pytest.approx(0.2)
    assert status(1)["env_weight"] == pytest.approx(0.8)
    assert status(2)["env_weight"] == 0.01
    assert status(0)["unallocated_fraction"] == 1.0
    client.post("/register-env", json=env("min", min_batch_allocation=0.25))
    assert status(0)["unallocated_fraction"] == 0.75


def test_a_bad_group_is_rejected_alone(client: TestClient) -> None:
    started(client)
    eid = client.post("/register-env", json=env("e", group_size=2)).json()["env_id"]
    body = [
        item(2, 1, eid),
        {**item(2, 2, eid), "inference_logprobs": None},
        item(2, 3, eid),
        {**item(2, 4, eid), "masks": [[1]] * 2},
        item(2, 5, eid),
    ]
    r = client.post("/scored_data_list", json=body).json()
    assert r["groups_processed"] == 5
    assert [x["index"] for x in r["rejected"]] == [1, 3]
    assert "inference_logprobs" in r["rejected"][0]["reason"]
    # A NaN score (atroposlib's json.dumps writes NaN) rejects that group only.
    raw = (
        b'[{"tokens":[[9,1],[9,2]],"masks":[[-100,1],[-100,2]],"scores":[NaN,1.0],'
        b'"inference_logprobs":[[0,0],[0,0]],"env_id":0},'
        b'{"tokens":[[6,1],[6,2]],"masks":[[-100,1],[-100,2]],"scores":[0.0,1.0],'
        b'"inference_logprobs":[[0,0],[0,0]],"env_id":0}]'
    )
    r = client.post("/scored_data_list", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 200 and r.json()["rejected"][0]["index"] == 0
    assert client.get("/status").json()["queued_groups"] == 4
    r = client.post("/scored_data_list", json=[{**item(2, 7), "scores": [1.0]}])
    assert r.status_code == 422 and "same number" in r.text  # nothing to keep: 422


def test_every_atropos_field_is_served_as_posted(client: TestClient) -> None:
    started(client, batch_size=2)
    extra = {
        "distill_token_ids": [[[1, 2], [3, 4]]] * 2,
        "distill_logprobs": [[[-0.1, -0.2], [-0.3, -0.4]]] * 2,
        "advantages": [[0.5] * 4] * 2,
        "ref_logprobs": [[-1.0] * 4] * 2,
        "messages": [[{"role": "user", "content": "hi"}]] * 2,
        "generation_params": {"temperature": 0.7},
        "overrides": [{"a": 1}, {"b": 2}],
        "group_overrides": {"group_size": 2},
        "images": None,
    }
    posted = item(2, 1, **extra)
    client.post("/scored_data", json=posted).raise_for_status()
    got = client.get("/batch").json()
    assert got["batch"] == [posted] and got["batch_id"]


def test_batches_are_packed_as_atropos_packs_them(client: TestClient) -> None:
    started(client, batch_size=8)
    for tag, n in enumerate([4, 8, 4], start=1):  # no env_id: queued as they come
        client.post("/scored_data", json=item(n, tag)).raise_for_status()
    sizes = []
    while b := client.get("/batch").json()["batch"]:
        sizes.append(sum(len(g["tokens"]) for g in b))
    assert sizes == [8, 8]
    for tag in range(10, 13):  # groups of 3 never make exactly 8: Atropos serves nothing
        client.post("/scored_data", json=item(3, tag)).raise_for_status()
    client.post("/scored_data", json=item(16, 20)).raise_for_status()  # larger than a batch
    assert client.get("/batch").json()["batch"] is None
    assert client.get("/status").json()["queued_groups"] == 4


def test_batches_are_formed_at_once_and_served_last_first(client: TestClient) -> None:
    started(client, batch_size=4, starting_step=5)
    for tag in range(1, 7):
        client.post("/scored_data", json=item(2, tag)).raise_for_status()
    first = client.get("/batch").json()["batch"]
    assert client.get("/status").json()["current_step"] == 5 + 3  # all three formed at once
    assert tags(first) == [5, 6]
    assert tags(client.get("/batch").json()["batch"]) == [3, 4]
    assert tags(client.get("/batch").json()["batch"]) == [1, 2]
    assert client.get("/batch").json()["batch"] is None


def test_mixed_sizes_from_an_env_wait_in_its_buffer(client: TestClient) -> None:
    started(client, batch_size=4)
    eid = client.post("/register-env", json=env("e", group_size=4)).json()["env_id"]
    assert client.post("/scored_data", json=item(2, 1, eid)).json() == {
        "status": "buffered",
        "buffer_size": 2,
    }
    r = client.post("/scored_data_list", json=[item(3, 2, eid), item(2, 3, eid)]).json()
    assert (r["buffered"], r["last_buffer_size"]) == (2, 3)
    assert tags(client.get("/batch").json()["batch"]) == [1, 3]


def test_min_batch_allocation_packing(client: TestClient) -> None:
    started(client, batch_size=4)
    a = client.post("/register-env", json=env("a", group_size=2)).json()["env_id"]
    b = client.post("/register-env", json=env("b", group_size=2, min_batch_allocation=0.5))
    b = b.json()["env_id"]
    for tag in range(1, 4):
        client.post("/scored_data", json=item(2, tag, a)).raise_for_status()
    client.post("/scored_data", json=item(2, 9, b)).raise_for_status()
    assert sorted(tags(client.get("/batch").json()["batch"])) == [1, 9]


def test_unacked_batches_are_served_again(tmp_path: Path) -> None:
    cfg = ApiConfig(db_path=tmp_path / "api.sqlite", synchronous="NORMAL", atropos_lease_seconds=1)
    now = [1000.0]  # the store's clock: a lease expires when the test says, not by chance
    store = Store(cfg.db_path, synchronous="NORMAL", clock=lambda: now[0])
    with TestClient(create_app(cfg, store=store)) as c:
        started(c, batch_size=2)
        for tag in (1, 2):
            c.post("/scored_data", json=item(2, tag)).raise_for_status()
        assert tags(c.get("/batch").json()["batch"]) == [2]
        c.post("/register", json=REG).raise_for_status()  # the trainer restarted
        assert tags(c.get("/batch").json()["batch"]) == [2]  # again
        assert tags(c.get("/batch").json()["batch"]) == [1]  # acks [2]
        now[0] += 1.5  # the trainer went away: [1]'s lease expires, it is served again
        assert tags(c.get("/batch").json()["batch"]) == [1]
        assert c.get("/batch").json()["batch"] is None
        status = c.get("/status").json()
        assert status["acked_batches"] == 2 and status["queued_groups"] == 0
        c.app.state.store.close()


def test_status_env_does_not_wait_for_the_store_lock(client: TestClient) -> None:
    started(client)
    eid = client.post("/register-env", json=env("e")).json()["env_id"]
    store = client.app.state.store
    answered = threading.Event()

    def ask() -> None:
        client.request("GET", "/status-env", json={"env_id": eid}).raise_for_status()
        answered.set()

    with store.db.locked():  # a long write in progress
        t = threading.Thread(target=ask)
        t.start()
        assert answered.wait(60)
    t.join()


def test_packing_helpers() -> None:
    assert find_groups_summing_to_target([3, 2, 2], 4) == [1, 2]
    assert find_groups_summing_to_target([8], 4) == []
    assert grab_exact([4, 8, 4], 8) == [1]
    assert grab_exact([3, 3, 3], 6) == [0, 1]
    batches = form_batches([QueueItem(s, None) for s in (4, 8, 4)], 8, [])
    assert batches == [[1], [0, 2]]


def test_explicit_ack_mode_keeps_batches_until_acked(tmp_path: Path) -> None:
    cfg = ApiConfig(db_path=tmp_path / "api.sqlite", synchronous="NORMAL", atropos_ack="explicit")
    with TestClient(create_app(cfg)) as c:
        started(c, batch_size=2)
        for tag in (1, 2):
            c.post("/scored_data", json=item(2, tag)).raise_for_status()
        first = c.get("/batch").json()
        second = c.get("/batch").json()  # does not ack the first
        assert c.get("/status").json()["active_leases"] == 2
        assert c.post(f"/batches/{first['batch_id']}/ack").json()["status"] == "acked"
        c.post("/register", json=REG).raise_for_status()  # restart: the unacked one again
        assert c.get("/batch").json()["batch"] == second["batch"]
        c.app.state.store.close()


def test_served_groups_have_every_atropos_key_and_no_unknown_one(client: TestClient) -> None:
    started(client, batch_size=4)
    client.post("/scored_data", json=item(2, 1)).raise_for_status()  # optional keys left out
    client.post("/scored_data", json={**item(2, 2), "not_atropos": 1}).raise_for_status()
    batch = client.get("/batch").json()["batch"]
    keys = {
        "tokens",
        "masks",
        "scores",
        "advantages",
        "ref_logprobs",
        "messages",
        "generation_params",
        "inference_logprobs",
        "overrides",
        "group_overrides",
        "images",
        "env_id",
        "distill_token_ids",
        "distill_logprobs",
    }
    assert [set(g) for g in batch] == [keys, keys]
    assert sorted(tags(batch)) == [1, 2] and batch[0]["advantages"] is None


def test_a_batch_whose_trainer_left_before_the_reply_is_served_again(client: TestClient) -> None:
    started(client, batch_size=2)
    client.post("/scored_data", json=item(2, 1)).raise_for_status()
    sent: list[dict] = []
    messages = [{"type": "http.request", "body": b"", "more_body": False}]

    async def receive() -> dict:  # the client hung up while the batch was being formed
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": "/batch",
        "raw_path": b"/batch",
        "query_string": b"",
        "headers": [],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 2),
    }
    client.portal.call(client.app, scope, receive, send)
    assert sent[0]["status"] == 499
    assert tags(client.get("/batch").json()["batch"]) == [1]  # not lost


def test_info_reports_the_native_trainers_batch_size(client: TestClient) -> None:
    """No Atropos trainer registered: ``/info`` answers the batch size (sequences) the native
    trainer leases, so an atroposlib env left at ``batch_size: -1`` sizes its queue by it."""
    assert client.get("/info").json() == {"batch_size": -1, "max_token_len": -1}
    assert client.post("/batches/lease", json={"max_sequences": 16}).status_code == 204
    assert client.get("/info").json() == {"batch_size": 16, "max_token_len": -1}
    client.post("/register", json=REG)  # an Atropos trainer's registration wins
    assert client.get("/info").json() == {"batch_size": 8, "max_token_len": 512}
