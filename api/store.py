"""Durable storage of the batching API: SQLite in WAL mode, one connection behind a lock.

Every state change (a group stored, a lease taken or acked, a version reported) is committed
before the HTTP reply that acknowledges it, so what a client was told survives ``kill -9``.
Groups move through ``queued -> leased -> acked`` (or ``queued -> dropped`` when too stale);
an expired lease puts its groups back to ``queued``. Rows of acked/dropped groups stay (their
``group_id`` keeps deduplicating) but their payload is cleared to bound the file's growth.
A batch the trainer could not train on (a non-finite gradient) is marked ``skipped``: its
groups leave the queue, are never counted as acked, and keep their payload for inspection.

Groups posted on the Atropos routes can also be ``buffered`` (their size differs from their
env's group size, as Atropos buffers them) until buffered groups add up to that size
(``api.store_buffer``).
Ingest is a group commit: concurrent pushes share one transaction and one fsync.

``Store`` does the ingest (the group commit) and composes components that own their state
and are reached through public methods only: ``api.db.Database`` (connection, lock,
transactions), ``api.store_queue.Queue`` (versions, staleness, expiry, payloads, counters),
``api.store_envs.Envs`` (envs, virtual time), ``api.store_leases.NativeLeases`` (native
leases), ``api.store_status.StoreStatus`` (backpressure, ``/status``); the Atropos routes'
``api.atropos_book.AtroposBook`` builds on the same components.
Native batch formation (``NativeLeases.lease``) is a weighted fair share across environments
by stride scheduling: each env has a ``pass`` that grows by ``sequences / weight`` whenever
it is served, and the env with the smallest pass among those with data goes next. An env without data is
skipped, so none can stall a batch; an env coming back after idling starts at the current
virtual time rather than with a burst of credit. Within an env groups are served FIFO and a
group is never split.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from api import store_buffer
from api.db import Database, Synchronous
from api.protocol import ScoredGroup
from api.storage import DiskGuard
from api.store_envs import Envs
from api.store_leases import LeasedBatch, NativeLeases, UnknownBatch
from api.store_queue import Queue
from api.store_status import StoreStatus

__all__ = ["IngestResult", "LeasedBatch", "Row", "Store", "UnknownBatch"]


@dataclass
class IngestResult:
    accepted: int = 0
    duplicates: int = 0
    stale: int = 0
    buffered: int = 0
    """Atropos groups held back until their env's groups add up to its group size."""
    last_buffer_size: int | None = None
    """Sequences in the Atropos buffer of the last buffered group's env."""


@dataclass
class Row:
    """One group ready to store (the payload serialised outside the store's lock)."""

    group_id: str
    env: str | None
    """``None``: the env registered under ``atropos_env`` (else ``atropos``)."""
    policy_version: int | None
    """``None``: the live version."""
    n_seqs: int
    n_tokens: int
    payload: str
    format: str = "native"
    atropos_env: int | None = None


@dataclass
class _Pending:
    rows: list[Row]
    result: IngestResult | None = None
    error: BaseException | None = None


class Store:
    """The API's state. Thread-safe: FastAPI runs sync routes in a thread pool."""

    def __init__(
        self,
        path: Path | str,
        max_staleness: int = 2,
        synchronous: Synchronous = "FULL",
        default_batch_sequences: int = 64,
        env_timeout_s: float = 300.0,
        rate_window_s: float = 60.0,
        clock: Callable[[], float] = time.time,
        min_free_bytes: int = 0,
    ) -> None:
        self.path = str(path)
        self.clock = clock
        self.db = Database(self.path, synchronous)
        self.disk = DiskGuard(self.path, min_free_bytes)
        """The free-space reserve below which pushes are refused (``api.storage``)."""
        self.queue = Queue(max_staleness, rate_window_s)
        self.envs = Envs(clock, env_timeout_s)
        self.leases = NativeLeases(self.db, self.queue, self.envs, clock)
        self.report = StoreStatus(
            self.db, self.queue, self.envs, self.disk, clock, default_batch_sequences
        )
        self._pending: list[_Pending] = []
        self._pending_lock = threading.Lock()
        self.latest_payload: tuple[str, str] | None = None
        """(format, payload) of the last group stored, for Atropos ``/latest_example``."""

    def close(self) -> None:
        self.db.close()

    # -- the native routes (the components' work) ----------------------------------------

    def lease(
        self,
        max_tokens: int | None,
        max_sequences: int | None,
        lease_seconds: float,
        allow_partial: bool = False,
    ) -> LeasedBatch | None:
        """Form and lease the next native batch (``NativeLeases.lease``)."""
        return self.leases.lease(max_tokens, max_sequences, lease_seconds, allow_partial)

    def ack(self, batch_id: str) -> tuple[str, int]:
        return self.leases.ack(batch_id)

    def skip(self, batch_id: str) -> tuple[str, int]:
        return self.leases.skip(batch_id)

    def reject(self, batch_id: str, reasons: dict[str, str]) -> tuple[int, list[str]]:
        return self.leases.reject(batch_id, reasons)

    def rejections(self) -> dict[str, str]:
        return self.leases.rejections()

    def wanted(self, env: str) -> tuple[int, int]:
        """(groups ``env`` may push now, policy version): ``StoreStatus.wanted``."""
        return self.report.wanted(env)

    def status(self) -> dict[str, Any]:
        return self.report.status()

    @property
    def skipped_batches(self) -> int:
        """Batches a trainer skipped (``skip``): trained on without an optimizer step."""
        with self.db.locked() as db:
            return int(
                db.execute("SELECT COUNT(*) FROM batches WHERE state='skipped'").fetchone()[0]
            )

    def native_batch_size(self) -> int:
        """Sequences per batch the native trainer leases (from its last lease), -1 before one:
        what Atropos's ``/info`` reports when no Atropos trainer registered."""
        with self.db.locked() as db:
            return NativeLeases.batch_sequences(db, -1)

    # -- versions ------------------------------------------------------------------------

    @property
    def policy_version(self) -> int:
        with self.db.locked() as db:
            return self.queue.live_version(db)

    def set_policy_version(self, version: int) -> int:
        """Record the live weight version; returns how many queued groups it made stale."""
        with self.db.tx() as db:
            return self.queue.set_live_version(db, version)

    # -- environments --------------------------------------------------------------------

    def register_env(self, name: str, weight: float = 1.0, group_size: int = 1) -> None:
        """Create or update an env. A new env starts at the current virtual time."""
        with self.db.tx() as db:
            self.envs.upsert(db, name, weight, group_size)

    def set_connected(self, name: str, connected: bool) -> bool:
        with self.db.tx() as db:
            return self.envs.set_connected(db, name, connected)

    # -- ingest --------------------------------------------------------------------------
    def ingest(self, groups: Sequence[ScoredGroup]) -> IngestResult:
        """Store native groups; repeated ``group_id``s are counted, not stored."""
        rows = [
            Row(
                g.group_id,
                g.env,
                g.policy_version,
                len(g.sequences),
                g.num_tokens,
                g.model_dump_json(),
            )
            for g in groups
        ]
        return self.ingest_rows(rows)

    def ingest_rows(self, rows: list[Row]) -> IngestResult:
        """Store ``rows`` durably, all or none. Group commit: requests that arrive while
        another one holds the lock are committed together by the next holder, in one
        transaction (one fsync), each inside its own savepoint so that a failure fails only
        its own request."""
        self.disk.check_push()  # below the reserve: 507 before anything is written
        mine = _Pending(rows)
        with self._pending_lock:
            self._pending.append(mine)
        with self.db.locked():  # one committer at a time; the others' rows go with it
            if mine.result is None and mine.error is None:
                with self._pending_lock:
                    batch, self._pending = self._pending, []
                self._commit_pending(batch)
        if mine.error is not None:
            raise mine.error
        assert mine.result is not None
        self.disk.stored()
        return mine.result

    def _commit_pending(self, batch: list[_Pending]) -> None:
        now = self.clock()
        try:
            with self.db.tx() as db:
                for p in batch:
                    db.execute("SAVEPOINT push")
                    try:
                        p.result = self._insert(db, p.rows, now)
                    except Exception as e:  # noqa: BLE001 -- handed to its own caller
                        if not db.in_transaction:  # SQLite rolled back all (a full disk)
                            raise
                        db.execute("ROLLBACK TO push")
                        p.error = e
                    db.execute("RELEASE push")
        except BaseException as e:  # the commit itself failed: nothing was stored
            for p in batch:
                p.result, p.error = None, e
            raise
        for p in batch:
            if p.result is not None:
                self.queue.ingest_rate.add(p.result.accepted, now)
                if p.rows:
                    self.latest_payload = (p.rows[-1].format, p.rows[-1].payload)

    def _insert(self, db: sqlite3.Connection, rows: list[Row], now: float) -> IngestResult:
        result = IngestResult()
        live = self.queue.live_version(db)
        min_version = self.queue.min_version(db)
        envs: dict[int, tuple[str, int]] = {}
        for r in rows:
            state, env = "queued", r.env
            if r.atropos_env is not None:
                env, state = store_buffer.placement(db, r.atropos_env, r.env, r.n_seqs, envs)
            env = env or "atropos"
            version = live if r.policy_version is None else r.policy_version
            stale = version < min_version
            cur = db.execute(
                "INSERT OR IGNORE INTO groups(group_id, env, policy_version, n_seqs, n_tokens, "
                "state, payload, created, format, atropos_env, qorder) "
                "VALUES(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, "
                "(SELECT COALESCE(MAX(qorder), 0) + 1 FROM groups))",
                (
                    r.group_id,
                    env,
                    version,
                    r.n_seqs,
                    r.n_tokens,
                    "dropped" if stale else state,
                    "" if stale else r.payload,
                    now,
                    r.format,
                    r.atropos_env,
                ),
            )
            self.envs.touch(db, env, r.n_seqs)
            if cur.rowcount == 0:
                result.duplicates += 1
                self.envs.count_duplicate(db, env)
                continue
            result.accepted += 1
            result.stale += stale
            if state == "buffered" and not stale:
                result.buffered += 1
                result.last_buffer_size = store_buffer.promote(
                    db, r.atropos_env, envs[r.atropos_env][1]
                )
        return result

    def reset(self) -> None:
        """Forget everything (Atropos ``/reset_data``)."""
        with self.db.tx() as db:
            for table in ("groups", "envs", "batches", "meta"):
                db.execute(f"DELETE FROM {table}")
        self.latest_payload = None
        self.queue.clear_rates()
