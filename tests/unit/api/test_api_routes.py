"""HTTP behaviour of the API in-process (FastAPI TestClient): validation, limits, token, Atropos."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from api.client import ApiClient, ApiError
from api.config import ApiConfig, parse_config
from settings.ports import free_port

pytestmark = pytest.mark.unit


def seq(n: int = 4, score: float = 1.0) -> dict:
    return {
        "tokens": list(range(n)),
        "mask": [0] * (n - 1) + [1],
        "logprobs": [-0.5] * n,
        "score": score,
    }


def grp(gid: str, env: str = "e", n_seqs: int = 2, **kw) -> dict:
    return {
        "group_id": gid,
        "env": env,
        "policy_version": 0,
        "sequences": [seq(**kw) for _ in range(n_seqs)],
    }


def make_client(tmp_path: Path, **cfg) -> TestClient:
    return TestClient(create_app(ApiConfig(db_path=tmp_path / "api.sqlite", **cfg)))


@pytest.fixture
def client(tmp_path: Path) -> TestClient:
    with make_client(tmp_path, max_body_bytes=64 * 1024) as c:
        yield c


def test_push_lease_ack_roundtrip(client: TestClient) -> None:
    r = client.post("/groups", json={"groups": [grp("a"), grp("b"), grp("a")]})
    assert r.json() == {"accepted": 2, "duplicates": 1, "stale": 0}
    lease = client.post("/batches/lease", json={"max_sequences": 4, "lease_seconds": 30})
    assert lease.status_code == 200
    body = lease.json()
    assert [g["group_id"] for g in body["groups"]] == ["a", "b"]
    assert body["groups"][0]["sequences"][0] == {**seq(), "logprobs": [-0.5] * 4, "spans": {}}
    assert client.post("/batches/lease", json={"max_sequences": 4}).status_code == 204
    assert client.post(f"/batches/{body['batch_id']}/ack").json()["status"] == "acked"
    assert client.post(f"/batches/{body['batch_id']}/ack").json()["status"] == "already_acked"
    assert client.post("/batches/nope/ack").status_code == 404


def test_skip_route_marks_a_batch_not_trained(client: TestClient) -> None:
    client.post("/groups", json={"groups": [grp("s1"), grp("s2")]})
    bid = client.post("/batches/lease", json={"max_sequences": 2}).json()["batch_id"]
    assert client.post(f"/batches/{bid}/skip").json() == {
        "batch_id": bid,
        "status": "skipped",
        "groups_skipped": 1,
    }
    assert client.post(f"/batches/{bid}/ack").json()["status"] == "already_skipped"
    status = client.get("/status").json()
    assert status["skipped_batches"] == 1 and status["acked_batches"] == 0
    assert client.post("/batches/nope/skip").status_code == 404


@pytest.mark.parametrize(
    "bad, fragment",
    [
        ({"groups": []}, "at least 1"),
        ({"groups": [grp("x", n_seqs=0)]}, "at least 1"),
        ({"groups": [{**grp("x"), "sequences": [{**seq(), "mask": [1]}]}]}, "equal lengths"),
        ({"groups": [{**grp("x"), "sequences": [{**seq(), "logprobs": [0.0]}]}]}, "equal lengths"),
        ({"groups": [{**grp("x"), "sequences": [{**seq(), "mask": [0, 2, 1, 1]}]}]}, "mask"),
        ({"groups": [{**grp("x"), "policy_version": -1}]}, "policy_version"),
        ({"groups": [{**grp("x"), "env": "bad name!"}]}, "env"),
        ({"groups": [{**grp("x"), "surprise": 1}]}, "surprise"),
    ],
)
def test_malformed_groups_get_422_and_store_nothing(client: TestClient, bad, fragment) -> None:
    r = client.post("/groups", json=bad)
    assert r.status_code == 422, r.text
    assert fragment in r.text
    assert client.get("/status").json()["queued_groups"] == 0


def test_non_finite_scores_are_rejected(client: TestClient) -> None:
    body = json.dumps({"groups": [grp("x", score=float("nan"))]})  # Python writes NaN
    r = client.post("/groups", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 422 and "finite" in r.text
    r = client.post(
        "/groups",
        content=body.replace("NaN", "Infinity"),
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 422 and "finite" in r.text


def test_invalid_json_is_a_4xx(client: TestClient) -> None:
    r = client.post("/groups", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 422
    assert client.get("/health").status_code == 200


def test_gzip_body_and_limits_after_decompression(client: TestClient) -> None:
    small = json.dumps({"groups": [grp("z")]}).encode()
    r = client.post(
        "/groups",
        content=gzip.compress(small),
        headers={"content-encoding": "gzip", "content-type": "application/json"},
    )
    assert r.json()["accepted"] == 1
    # 10 MB of zeros gzips to ~10 KB: under the limit on the wire, far over it inflated.
    bomb = gzip.compress(b"0" * 10_000_000)
    assert len(bomb) < 64 * 1024
    r = client.post("/groups", content=bomb, headers={"content-encoding": "gzip"})
    assert r.status_code == 413
    r = client.post(
        "/groups", content=b"x" * (65 * 1024), headers={"content-type": "application/json"}
    )
    assert r.status_code == 413
    r = client.post("/groups", content=b"not gzip", headers={"content-encoding": "gzip"})
    assert r.status_code == 400
    r = client.post("/groups", content=small, headers={"content-encoding": "br"})
    assert r.status_code == 415
    assert client.get("/status").json()["queued_groups"] == 1


def test_token_guards_every_route(tmp_path: Path) -> None:
    with make_client(tmp_path, token="s3cret") as c:
        for method, path in [
            ("GET", "/health"),
            ("GET", "/docs"),
            ("GET", "/openapi.json"),
            ("GET", "/status"),
            ("POST", "/groups"),
            ("GET", "/batch"),
            ("POST", "/scored_data"),
            ("GET", "/reset_data"),
        ]:
            assert c.request(method, path).status_code == 401, path
            wrong = {"Authorization": "Bearer nope"}
            assert c.request(method, path, headers=wrong).status_code == 401, path
        assert c.get("/health", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert c.get("/health", headers={"X-API-Token": "s3cret"}).status_code == 200


def test_openapi_lists_the_native_and_atropos_routes(client: TestClient) -> None:
    paths = client.get("/openapi.json").json()["paths"]
    for p in [
        "/groups",
        "/envs/register",
        "/backpressure",
        "/batches/lease",
        "/batches/{batch_id}/ack",
        "/batches/{batch_id}/skip",
        "/policy_version",
        "/status",
        "/health",
        "/register",
        "/register-env",
        "/scored_data",
        "/scored_data_list",
        "/batch",
        "/status-env",
        "/info",
        "/wandb_info",
        "/disconnect-env",
        "/latest_example",
    ]:
        assert p in paths, p
    assert client.get("/docs").status_code == 200


def test_versions_staleness_and_backpressure(client: TestClient) -> None:
    client.post("/envs/register", json={"name": "e", "weight": 1.0, "group_size": 2})
    assert client.get("/backpressure", params={"env": "e"}).json() == {
        "wanted": (2 + 1) * 64 // 2,
        "policy_version": 0,
        "skipped_batches": 0,
    }
    client.post("/groups", json={"groups": [grp("old")]})
    r = client.post("/policy_version", json={"version": 3})
    assert r.json() == {"version": 3, "dropped": 1}
    status = client.get("/status").json()
    assert status["policy_version"] == 3 and status["dropped_groups"] == 1
    assert client.get("/backpressure", params={"env": "bad name"}).status_code == 422
    # a batch the trainer skips (non-finite gradient) is counted: a lockstep env samples again
    client.post("/groups", json={"groups": [{**grp("new"), "policy_version": 3}]})
    lease = client.post("/batches/lease", json={"max_sequences": 2}).json()
    assert client.post(f"/batches/{lease['batch_id']}/skip").status_code == 200
    bp = client.get("/backpressure", params={"env": "e"}).json()
    assert bp["policy_version"] == 3 and bp["skipped_batches"] == 1


def atropos_item(n: int = 2, **kw) -> dict:
    tokens = [[1, 2, 3, 4] for _ in range(n)]
    return {
        "tokens": tokens,
        "masks": [[-100, -100, 3, 4]] * n,
        "scores": [1.0, -1.0][:n],
        "inference_logprobs": [[1.0, 1.0, -0.2, -0.3]] * n,
        **kw,
    }


def test_atropos_env_and_trainer_flow(client: TestClient) -> None:
    assert client.post(
        "/register-env",
        json={"max_token_length": 512, "desired_name": "gsm8k", "weight": 1.0, "group_size": 2},
    ).json() == {"status": "wait for trainer to start"}
    reg = {
        "wandb_group": "g",
        "wandb_project": "p",
        "batch_size": 4,
        "max_token_len": 512,
        "checkpoint_dir": "/tmp/ck",
        "save_checkpoint_interval": 10,
        "starting_step": 0,
        "num_steps": 100,
    }
    assert "uuid" in client.post("/register", json=reg).json()
    assert client.get("/batch").json() == {"batch": None}  # the trainer has started
    env = client.post(
        "/register-env",
        json={"max_token_length": 512, "desired_name": "gsm8k", "weight": 1.0, "group_size": 2},
    ).json()
    assert env["status"] == "success" and env["wandb_name"] == "gsm8k_0"
    assert env["checkpoint_dir"] == "/tmp/ck" and env["num_steps"] == 100
    eid = env["env_id"]
    assert client.post("/scored_data", json=atropos_item(env_id=eid)).json()["status"] == "received"
    r = client.post(
        "/scored_data_list",
        json=[atropos_item(env_id=eid, scores=[0.5, 0.25]), atropos_item(env_id=eid)],
    )
    assert r.json() == {"status": "received", "groups_processed": 2}  # one was a retry (dedup)
    assert client.get("/status").json()["queued_groups"] == 2
    senv = client.request("GET", "/status-env", json={"env_id": eid}).json()
    assert senv["self_queue_size"] == 2 and senv["env_weight"] == 1.0
    batch = client.get("/batch").json()["batch"]
    assert len(batch) == 2 and batch[0]["masks"][0] == [-100, -100, 3, 4]
    assert batch[0]["inference_logprobs"][0] == [1.0, 1.0, -0.2, -0.3]
    assert batch[0]["env_id"] == eid
    assert client.get("/info").json() == {"batch_size": 4, "max_token_len": 512}
    assert client.get("/wandb_info").json()["group"] == "g"
    assert client.get("/batch").json() == {"batch": None}  # acks the previous batch
    assert client.get("/status").json()["acked_batches"] == 1
    assert client.post("/disconnect-env", json={"env_id": eid}).json() == {"status": "success"}
    assert client.get("/reset_data").text == "Reset successful"
    assert client.get("/info").json() == {"batch_size": -1, "max_token_len": -1}


def test_atropos_validation(client: TestClient) -> None:
    r = client.post("/scored_data", json={**atropos_item(), "scores": [1.0]})
    assert r.status_code == 422 and "same number" in r.text
    r = client.post("/scored_data", json={**atropos_item(), "inference_logprobs": None})
    assert r.status_code == 422 and "inference_logprobs" in r.text


def test_atropos_missing_logprobs_as_zeros(tmp_path: Path) -> None:
    with make_client(tmp_path, atropos_missing_logprobs="zeros") as c:
        c.post("/register", json={"batch_size": 2})
        c.post("/scored_data", json={**atropos_item(), "inference_logprobs": None})
        batch = c.get("/batch").json()["batch"]
        assert batch[0]["inference_logprobs"] is None  # told as missing, not as zeros


def test_client_gives_up_on_unreachable_server() -> None:
    api = ApiClient(f"http://127.0.0.1:{free_port()}", retries=2, backoff=0.01)
    with pytest.raises(ApiError, match="after 3 tries"):
        api.health()


def test_config_flags_and_env_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHOP_R1_API_TOKEN", "from-env")
    cfg = parse_config(["--port", "9001", "--max-staleness", "4", "--synchronous", "NORMAL"])
    assert (cfg.port, cfg.max_staleness, cfg.synchronous, cfg.token) == (
        9001,
        4,
        "NORMAL",
        "from-env",
    )
    assert cfg.host == "127.0.0.1"
    with pytest.raises(SystemExit):
        parse_config(["--synchronous", "OFF"])
