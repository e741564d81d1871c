"""The API as a real uvicorn process: kill -9 durability, leases, bad input, the token guard."""

from __future__ import annotations

import sys
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

import httpx
import pytest

from api.client import ApiClient, ApiError, bearer
from launch.procs import ManagedProcess
from settings.ports import free_port

pytestmark = pytest.mark.integration


def start_api(
    db: Path, log: Path, *flags: str, token: str | None = None
) -> tuple[ManagedProcess, str]:
    port = free_port()
    argv = [sys.executable, "-m", "api", "--port", str(port), "--db-path", str(db), *flags]
    env = {k: v for k, v in __import__("os").environ.items() if k != "SHOP_R1_API_TOKEN"}
    if token:
        env["SHOP_R1_API_TOKEN"] = token
    proc = ManagedProcess("api", argv, log, env=env, forked=True).start()
    url = f"http://127.0.0.1:{port}"
    try:  # /health needs the token too: the launcher's wait (launch/run_all.py wait_api)
        proc.wait_http(url + "/health", timeout=60, interval=0.1, headers=bearer(token))
    except BaseException:
        proc.stop()
        raise
    return proc, url


def make_group(gid: str, env: str = "shop_r1", n_seqs: int = 4, length: int = 64) -> dict:
    seq = {
        "tokens": list(range(length)),
        "mask": [0] * (length // 2) + [1] * (length // 2),
        "logprobs": [-0.25] * length,
        "score": 0.5,
        "spans": {"rationale": [0] * length},
    }
    return {
        "group_id": gid,
        "env": env,
        "policy_version": 0,
        "sequences": [seq] * n_seqs,
        "metrics": {"format": 0.5},
    }


def drain(api: ApiClient) -> list[str]:
    served = []
    while (lease := api.lease(max_sequences=400, lease_seconds=60, allow_partial=True)) is not None:
        served += [g.group_id for g in lease.groups]
        api.ack(lease.batch_id)
    return served


def test_kill9_during_ingest_loses_no_acknowledged_group(tmp_path: Path) -> None:
    db, total, per_push = tmp_path / "api.sqlite", 3000, 20
    ids = [uuid.uuid4().hex for _ in range(total)]
    proc, url = start_api(db, tmp_path / "api1.log")
    acknowledged: list[str] = []
    try:
        api = ApiClient(url, retries=0, timeout=10)
        api.push_groups([make_group(i) for i in ids[:8]])
        acknowledged += ids[:8]
        unacked = api.lease(max_sequences=16, lease_seconds=1.0)  # taken, never acked
        assert unacked is not None and len(unacked.groups) == 4

        def pusher() -> None:
            for start in range(8, total, per_push):
                chunk = ids[start : start + per_push]
                try:
                    api.push_groups([make_group(i) for i in chunk])
                except ApiError:
                    return  # the server died under us: this push is not acknowledged
                acknowledged.extend(chunk)

        thread = threading.Thread(target=pusher)
        thread.start()
        while len(acknowledged) < total // 3 and thread.is_alive():
            time.sleep(0.01)
        assert thread.is_alive(), f"the pusher stopped after {len(acknowledged)} groups"
        proc.kill9()  # mid-ingest: requests are in flight
        thread.join(timeout=30)
        assert 0 < len(acknowledged) < total
    finally:
        proc.stop()

    proc, url = start_api(db, tmp_path / "api2.log")
    try:
        api = ApiClient(url)
        rest = [i for i in ids if i not in set(acknowledged)]
        for start in range(0, len(rest), 200):  # the envs retry what was never acknowledged
            api.push_groups([make_group(i) for i in rest[start : start + 200]])
        time.sleep(1.1)  # the lease taken before the crash expires: its groups come back
        served = drain(api)
        counts = Counter(served)
        assert max(counts.values()) == 1, "a group was served twice"
        assert set(acknowledged) <= set(served), "an acknowledged group was lost"
        assert set(served) == set(ids)
        status = api.status()
        assert status.queued_groups == 0 and status.expired_leases == 1
        assert status.envs[0].acked_groups == total
    finally:
        proc.stop()


def test_bad_input_leases_and_token_on_a_live_server(tmp_path: Path) -> None:
    token = "t0ken"
    proc, url = start_api(
        tmp_path / "api.sqlite",
        tmp_path / "api.log",
        "--max-body-bytes",
        str(256 * 1024),
        token=token,
    )
    try:
        anonymous = ApiClient(url, retries=0)
        with pytest.raises(ApiError) as err:
            anonymous.status()
        assert err.value.status_code == 401
        with pytest.raises(TimeoutError, match="HTTP 401"):  # a wait without the header
            proc.wait_http(url + "/health", timeout=1)
        api = ApiClient(url, token=token)
        api.register_env("shop_r1", weight=1.0, group_size=4)
        assert api.push_groups([make_group("g1"), make_group("g2")]).accepted == 2
        assert api.push_groups([make_group("g1")]).duplicates == 1

        headers = {**bearer(token), "content-type": "application/json"}
        bad = httpx.post(url + "/groups", content=b'{"groups": [{"group_id": 1}]}', headers=headers)
        assert bad.status_code == 422
        huge = [make_group(f"h{i}", length=2048) for i in range(8)]  # ~1 MB of JSON, gzipped
        with pytest.raises(ApiError) as err:
            api.push_groups(huge)
        assert err.value.status_code == 413
        raw = httpx.post(url + "/groups", content=b"[" * 300_000, headers=headers)
        assert raw.status_code == 413

        first = api.lease(max_sequences=8, lease_seconds=0.5)
        assert first is not None and [g.group_id for g in first.groups] == ["g1", "g2"]
        assert first.groups[0].sequences[0].spans["rationale"][0] == 0
        time.sleep(0.7)  # the 0.5 s lease expired: its groups go out again
        again = api.lease(max_sequences=8, lease_seconds=30)
        assert again is not None and [g.group_id for g in again.groups] == ["g1", "g2"]
        # while a lease holds them they are not leased twice (asked under the 30 s lease, not
        # the 0.5 s one, which a slow fsync on a loaded box could outlast)
        assert api.lease(max_sequences=8) is None
        assert api.ack(again.batch_id).status == "acked"
        assert api.ack(first.batch_id).groups_acked == 0  # late, and its groups went elsewhere
        assert api.set_policy_version(1).version == 1
        bp = api.wanted("shop_r1")
        assert bp.policy_version == 1 and bp.wanted == (2 + 1) * 8 // 4
        assert api.health()
    finally:
        proc.stop()
