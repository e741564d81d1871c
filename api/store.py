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
Native batch formation (``lease``, in ``api.store_leases``) is a weighted fair share across environments by stride
scheduling: each env has a ``pass`` that grows by ``sequences / weight`` whenever it is served,
and the env with the smallest pass among those with data goes next. An env without data is
skipped, so none can stall a batch; an env coming back after idling starts at the current
virtual time rather than with a burst of credit. Within an env groups are served FIFO and a
group is never split.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from api.db import Readers, Synchronous, connect
from api.protocol import ScoredGroup
from api.storage import DiskGuard
from api.store_buffer import AtroposBufferMixin
from api.store_leases import LeasedBatch, LeaseMixin, UnknownBatch
from api.store_status import StatusMixin, _Rate

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


class Store(LeaseMixin, StatusMixin, AtroposBufferMixin):
    """The API's state. Thread-safe: FastAPI runs sync routes in a thread pool."""

    def __init__(
        self,
        path: Path | str,
        max_staleness: int = 2,
        synchronous: Synchronous = "FULL",
        default_batch_sequences: int = 64,
        env_timeout_s: float = 300.0,
        rate_window_s: float = 60.0,
        clock: Any = time.time,
        min_free_bytes: int = 0,
    ) -> None:
        self.path = str(path)
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self.max_staleness = max_staleness
        self.default_batch_sequences = default_batch_sequences
        self.env_timeout_s = env_timeout_s
        self.clock = clock
        self._lock = threading.RLock()
        self._db = connect(self.path, synchronous)
        self.disk = DiskGuard(self.path, min_free_bytes)
        """The free-space reserve below which pushes are refused (``api.storage``)."""
        self.readers = Readers(self.path)
        self._pending: list[_Pending] = []
        self._pending_lock = threading.Lock()
        self.ingest_rate = _Rate(rate_window_s)
        self.serve_rate = _Rate(rate_window_s)
        self.latest_payload: tuple[str, str] | None = None
        """(format, payload) of the last group stored, for Atropos ``/latest_example``."""

    def close(self) -> None:
        with self._lock:
            self.readers.close()
            self._db.close()

    @contextmanager
    def read(self) -> Iterator[sqlite3.Connection]:
        """A connection for reads that need not wait for writers (WAL snapshot); the write
        connection under the lock for ``:memory:`` databases."""
        db = self.readers.get()
        if db is not None:
            yield db
            return
        with self._lock:
            yield self._db

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        """One write transaction, committed (durably) before the caller replies.

        Whatever fails -- the body, or the ``COMMIT`` itself (a full disk) -- the transaction
        is rolled back and the first error raised. SQLite may already have rolled back by
        itself (``SQLITE_FULL``, ``SQLITE_IOERR``): then there is nothing left to roll back,
        and the connection is ready for the next transaction either way."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
                self._db.execute("COMMIT")
            except BaseException:
                self._rollback()
                raise

    def _rollback(self) -> None:
        if self._db.in_transaction:
            try:
                self._db.execute("ROLLBACK")
            except sqlite3.Error:  # pragma: no cover - the error being raised says more
                pass

    # -- meta ----------------------------------------------------------------------------

    def _meta(self, key: str, default: Any = None) -> Any:
        row = self._db.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return default if row is None else json.loads(row[0])

    def _set_meta(self, key: str, value: Any) -> None:
        self._db.execute(
            "INSERT INTO meta(key, value) VALUES(?, ?) "
            "ON CONFLICT(key) DO UPDATE SET value=excluded.value",
            (key, json.dumps(value)),
        )

    def get_meta(self, key: str, default: Any = None) -> Any:
        with self._lock:
            return self._meta(key, default)

    def set_meta(self, key: str, value: Any) -> None:
        with self._tx():
            self._set_meta(key, value)

    @property
    def policy_version(self) -> int:
        with self._lock:
            return int(self._meta("policy_version", 0))

    def _min_version(self) -> int:
        return int(self._meta("policy_version", 0)) - self.max_staleness

    # -- environments --------------------------------------------------------------------

    def register_env(
        self,
        name: str,
        weight: float = 1.0,
        group_size: int = 1,
        atropos_id: int | None = None,
        max_token_length: int = -1,
    ) -> None:
        """Create or update an env. A new env starts at the current virtual time."""
        with self._tx() as db:
            self._upsert_env(db, name, weight, group_size, atropos_id, max_token_length)

    def _upsert_env(
        self,
        db: sqlite3.Connection,
        name: str,
        weight: float,
        group_size: int,
        atropos_id: int | None = None,
        max_token_length: int = -1,
    ) -> None:
        vtime = float(self._meta("vtime", 0.0))
        db.execute(
            "INSERT INTO envs(name, weight, group_size, pass, last_seen, atropos_id, "
            "max_token_length) VALUES(?, ?, ?, ?, ?, ?, ?) ON CONFLICT(name) DO UPDATE SET "
            "weight=excluded.weight, group_size=excluded.group_size, connected=1, "
            "last_seen=excluded.last_seen, "
            "atropos_id=COALESCE(excluded.atropos_id, envs.atropos_id), "
            "max_token_length=MAX(excluded.max_token_length, envs.max_token_length)",
            (name, weight, group_size, vtime, self.clock(), atropos_id, max_token_length),
        )

    def _touch_env(self, db: sqlite3.Connection, name: str, group_size: int) -> None:
        """Auto-register an env seen for the first time (weight 1), else mark it alive."""
        cur = db.execute("UPDATE envs SET last_seen=? WHERE name=?", (self.clock(), name))
        if cur.rowcount == 0:
            self._upsert_env(db, name, 1.0, group_size)

    def set_connected(self, name: str, connected: bool) -> bool:
        with self._tx() as db:
            cur = db.execute("UPDATE envs SET connected=? WHERE name=?", (int(connected), name))
            return cur.rowcount > 0

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
        with self._lock:
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
            with self._tx() as db:
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
                self.ingest_rate.add(p.result.accepted, now)
                if p.rows:
                    self.latest_payload = (p.rows[-1].format, p.rows[-1].payload)

    def _insert(self, db: sqlite3.Connection, rows: list[Row], now: float) -> IngestResult:
        result = IngestResult()
        live = int(self._meta("policy_version", 0))
        min_version = live - self.max_staleness
        envs: dict[int, tuple[str, int]] = {}
        for r in rows:
            state, env = "queued", r.env
            if r.atropos_env is not None:
                env, state = self._atropos_placement(db, r.atropos_env, r.env, r.n_seqs, envs)
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
            self._touch_env(db, env, r.n_seqs)
            if cur.rowcount == 0:
                result.duplicates += 1
                db.execute("UPDATE envs SET duplicates=duplicates+1 WHERE name=?", (env,))
                continue
            result.accepted += 1
            result.stale += stale
            if state == "buffered" and not stale:
                result.buffered += 1
                result.last_buffer_size = self._promote_buffered(
                    db, r.atropos_env, envs[r.atropos_env][1]
                )
        return result

    # -- versions and staleness ----------------------------------------------------------

    def set_policy_version(self, version: int) -> int:
        """Record the live weight version; returns how many queued groups it made stale."""
        with self._tx() as db:
            self._set_meta("policy_version", version)
            return self._drop_stale(db)

    def _drop_stale(self, db: sqlite3.Connection) -> int:
        cur = db.execute(
            "UPDATE groups SET state='dropped', payload='' "
            "WHERE state='queued' AND policy_version < ?",
            (self._min_version(),),
        )
        return cur.rowcount

    def _expire_leases(self, db: sqlite3.Connection, now: float) -> int:
        expired = [
            r[0]
            for r in db.execute(
                "SELECT batch_id FROM batches WHERE state='leased' AND deadline < ?", (now,)
            )
        ]
        for batch_id in expired:
            db.execute(
                "UPDATE groups SET state='queued' WHERE batch_id=? AND state='leased'", (batch_id,)
            )
            db.execute("UPDATE batches SET state='expired' WHERE batch_id=?", (batch_id,))
        return len(expired)

    def reset(self) -> None:
        """Forget everything (Atropos ``/reset_data``)."""
        with self._tx() as db:
            for table in ("groups", "envs", "batches", "meta"):
                db.execute(f"DELETE FROM {table}")
        self.latest_payload = None
        self.ingest_rate.events.clear()
        self.serve_rate.events.clear()
