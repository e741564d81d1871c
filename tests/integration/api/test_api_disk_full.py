"""A full disk at the API, for real: the API's database on a small tmpfs that fills up while
the env's client pushes and a trainer-like client leases and acks (bench/faults/small_disk.py).

1. Below the reserve (``--min-free-mb``): a push is answered 507 with ``Retry-After`` and the
   reason (free space, path, reserve); ``/backpressure`` asks for 0 groups; leases and acks
   go on. The env's client (``env_server.service.ApiLink``) backs off under the one retry
   policy, each retry logged with the API's reason.
2. The API SIGKILLed on that disk and restarted without a reserve, the disk filled to the last
   byte: a push that needs new space is SQLite's own ``SQLITE_FULL``, answered 507, rolled
   back; the API stays up.
3. The space returns: the env's pushes go through by themselves, nothing restarted.
4. Exactly once: every group acknowledged to the env is in the database and is served by the
   leases exactly once; no group was stored twice (the API counts 0 duplicates: no push was
   resent after it was stored), no 500 and no traceback in the API's log, and SQLite's
   ``integrity_check`` is ok.

Where this process may not mount a tmpfs, the same phases run with the fallback: the API's
``RLIMIT_FSIZE`` lowered to its files' current size (``prlimit``), so a write that needs new
space fails with ``EFBIG``, which SQLite reports as an I/O error: 503 instead of 507, and the
reserve phase is skipped (it needs a filesystem that really fills).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import sqlite3
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from api.client import ApiClient, bearer
from bench.faults.small_disk import SmallDisk, limit_file_size
from env_server.config import EnvConfig
from env_server.service import ApiLink
from launch.procs import ManagedProcess
from settings.ports import free_port

pytestmark = pytest.mark.integration
TOKEN = "disk-full-token"
HEADERS = bearer(TOKEN)
DISK_MB, RESERVE_MB = 32, 4


def group(gid: str, n_tokens: int = 16) -> dict:
    seq = {
        "tokens": list(range(n_tokens)),
        "mask": [0] * (n_tokens // 2) + [1] * (n_tokens - n_tokens // 2),
        "logprobs": [-0.5] * n_tokens,
        "score": 1.0,
    }
    return {"group_id": gid, "env": "e", "policy_version": 0, "sequences": [seq, seq]}


class Api:
    """The API process on ``db``, restartable on the same port."""

    def __init__(self, db: Path, tmp: Path) -> None:
        self.db, self.tmp, self.port = db, tmp, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: ManagedProcess | None = None
        self.starts = 0

    def start(self, min_free_mb: float) -> None:
        self.starts += 1
        argv = [sys.executable, "-m", "api", "--port", str(self.port), "--db-path", str(self.db)]
        argv += ["--token", TOKEN, "--max-staleness", "1000", "--min-free-mb", str(min_free_mb)]
        log = self.tmp / f"api.{self.starts}.log"
        self.proc = ManagedProcess("api", argv, log, forked=True).start()
        self.proc.wait_http(f"{self.url}/health", 120, interval=0.2, headers=bearer(TOKEN))

    def push_raw(self, groups: list[dict]) -> httpx.Response:
        body = {"groups": groups}
        return httpx.post(f"{self.url}/groups", json=body, headers=HEADERS, timeout=60)

    def logs(self) -> str:
        return "".join((self.tmp / f"api.{i}.log").read_text() for i in range(1, self.starts + 1))


class Drain:
    """A trainer's side: lease, record what was served, ack."""

    def __init__(self, url: str) -> None:
        self.client = ApiClient(url, token=TOKEN, give_up_s=60)
        self.served: list[str] = []

    def batch(self, partial: bool = False) -> bool:
        lease = self.client.lease(max_sequences=8, lease_seconds=120, allow_partial=partial)
        if lease is None:
            return False
        self.served += [g.group_id for g in lease.groups]
        assert self.client.ack(lease.batch_id).status == "acked"
        return True


class EnvPusher(threading.Thread):
    """The env's own client (``ApiLink``, retrying for ``reconnect_timeout_s``) pushing one
    group at a time; ``acked`` holds the group ids the API acknowledged."""

    def __init__(self, url: str, ids: list[str]) -> None:
        super().__init__(daemon=True)
        cfg = EnvConfig(api_url=url, api_token=TOKEN, reconnect_timeout_s=300)
        self.link, self.ids = ApiLink(cfg), ids
        self.acked: list[str] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            for gid in self.ids:
                reply = asyncio.run(self.link.push(group(gid)))
                assert reply.accepted == 1 and reply.duplicates == 0, reply
                self.acked.append(gid)
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e


def file_sizes(db: Path) -> int:
    return max(p.stat().st_size for p in db.parent.glob(db.name + "*"))


def test_full_disk_at_the_api(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="api.client")
    real = SmallDisk.can_mount()
    disk = SmallDisk(tmp_path / "disk", DISK_MB << 20) if real else None
    db_dir = disk.path if disk else tmp_path / "db"
    api = Api(db_dir / "api.sqlite", tmp_path)
    pusher: EnvPusher | None = None
    report: dict = {"filesystem": "tmpfs" if real else "RLIMIT_FSIZE (no mount allowed)"}
    try:
        if disk:
            disk.__enter__()
        db_dir.mkdir(parents=True, exist_ok=True)
        api.start(RESERVE_MB if real else 0)
        drain = Drain(api.url)
        env = EnvPusher(api.url, [f"a{i}" for i in range(30)])
        env.run()  # before the disk fills: all acknowledged at once
        assert env.error is None and len(env.acked) == 30
        acked = list(env.acked)
        assert drain.batch() and drain.batch()

        # -- 1. below the reserve: 507 for pushes, 0 wanted, leases and acks go on ----------
        if disk:
            report["free_after_fill_b"] = disk.fill(leave=(RESERVE_MB - 2) << 20)
            r = api.push_raw([group("refused")])
            assert r.status_code == 507 and r.headers["retry-after"] == "5", r.text
            detail = r.json()["detail"]
            assert "reserve" in detail and str(disk.path) in detail, detail
            bp = httpx.get(f"{api.url}/backpressure", params={"env": "e"}, headers=HEADERS)
            assert bp.json()["wanted"] == 0
            assert drain.batch()  # the trainer keeps draining the queue
            pusher = EnvPusher(api.url, [f"b{i}" for i in range(5)])
            pusher.start()
            client = ApiClient(api.url, token=TOKEN)
            deadline = time.monotonic() + 300  # a refusal every ~0.5-5 s (its back-off)
            while (status := client.status()).storage_refusals < 3:  # the probe + 2 pushes
                assert time.monotonic() < deadline and pusher.is_alive(), status
                time.sleep(0.2)
            assert pusher.acked == [] and pusher.is_alive()  # backing off, nothing stored
            assert status.storage_low, status

        # -- 2. killed on the full disk, restarted without a reserve, not a byte left -------
        api.proc.kill9()
        if disk:
            report["free_when_full_b"] = disk.fill(leave=0)
        api.start(0)
        if not disk:
            limit_file_size(api.proc.pid, file_sizes(api.db))
        big = [group(f"big{i}", n_tokens=4000) for i in range(150)]  # ~7 MB: new WAL space
        r = api.push_raw(big)
        assert r.status_code == (507 if disk else 503), r.text
        reason = r.json()["detail"]
        assert ("SQLITE_FULL" if disk else "SQLITE_IOERR") in reason and "rolled back" in reason
        report["full_reply"] = f"{r.status_code}: {reason}"
        assert api.proc.alive()
        ApiClient(api.url, token=TOKEN).status()  # /status still answers

        # -- 3. the space returns: pushes go through by themselves -------------------------
        t_back = time.monotonic()
        if disk:
            report["free_after_release_b"] = disk.release()
        else:
            limit_file_size(api.proc.pid, None)
        if pusher is not None:
            pusher.join(timeout=120)
            assert pusher.error is None and not pusher.is_alive(), pusher.error
            acked += pusher.acked
            report["env_push_done_after_release_s"] = round(time.monotonic() - t_back, 1)
        r = api.push_raw(big)
        assert r.status_code == 200 and r.json()["accepted"] == len(big), r.text
        acked += [g["group_id"] for g in big]

        # -- 4. exactly once ----------------------------------------------------------------
        while drain.batch(partial=True):
            pass
        assert sorted(drain.served) == sorted(acked), "served != acknowledged"
        assert len(drain.served) == len(set(drain.served)), "a group was served twice"
        status = ApiClient(api.url, token=TOKEN).status()
        assert status.envs[0].duplicate_groups == 0  # no push was stored twice
        assert not status.storage_low
        with sqlite3.connect(f"file:{api.db}?mode=ro", uri=True) as conn:
            assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
            states = Counter(s for (s,) in conn.execute("SELECT state FROM groups"))
        assert states == {"acked": len(acked)}, states
        logs = api.logs()
        assert "Traceback" not in logs and " 500 " not in logs, logs[-3000:]
        retries = [r.getMessage() for r in caplog.records if "retry" in r.getMessage()]
        if disk:
            assert any("HTTP 507" in m and "reserve" in m for m in retries), retries
            waits = [float(w) for w in re.findall(r"retry \d+ in ([\d.]+)s", " ".join(retries))]
            assert waits and max(waits) <= 5.0  # the policy's cap
            report["env_retries"] = len(retries)
            report["env_backoffs_s"] = waits
        report.update(acked=len(acked), served=len(drain.served), refusals=status.storage_refusals)
    finally:
        if api.proc is not None:
            api.proc.stop()
        if disk:
            disk.unmount()
        print("API_DISK_FULL_REPORT " + json.dumps(report))
