"""The API's SQLite schema, its in-place migration, its connections and transactions.

One write connection behind one lock (``Database``) makes every change, in explicit
transactions committed before the reply that reports them; reads that must not wait for it
(Atropos ``/status-env``, polled ~10 times a second by every environment) use their own
connection per thread: in WAL mode a reader sees the last committed state and neither blocks
nor is blocked by the writer. The ``meta`` table holds single values (``get_meta`` /
``set_meta``); each key is read and written by one component of the store only.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

SCHEMA = """
CREATE TABLE IF NOT EXISTS groups (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,   -- arrival order (FIFO within an env)
    group_id TEXT NOT NULL UNIQUE,           -- idempotency key
    env TEXT NOT NULL,
    policy_version INTEGER NOT NULL,
    n_seqs INTEGER NOT NULL,
    n_tokens INTEGER NOT NULL,
    state TEXT NOT NULL,                     -- buffered|queued|leased|acked|dropped|skipped|rejected
    batch_id TEXT,                           -- last batch that leased it
    payload TEXT NOT NULL,                   -- the group's JSON ('' once acked or dropped)
    created REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS groups_queue ON groups (state, env, seq);
CREATE INDEX IF NOT EXISTS groups_batch ON groups (batch_id);
CREATE TABLE IF NOT EXISTS envs (
    name TEXT PRIMARY KEY,
    weight REAL NOT NULL,
    group_size INTEGER NOT NULL,
    connected INTEGER NOT NULL DEFAULT 1,
    pass REAL NOT NULL DEFAULT 0,            -- stride-scheduling virtual time
    duplicates INTEGER NOT NULL DEFAULT 0,
    last_seen REAL NOT NULL,
    atropos_id INTEGER UNIQUE,               -- id handed out by Atropos /register-env
    max_token_length INTEGER NOT NULL DEFAULT -1
);
CREATE TABLE IF NOT EXISTS batches (
    batch_id TEXT PRIMARY KEY,
    state TEXT NOT NULL,                     -- formed | leased | acked | expired | skipped
    created REAL NOT NULL,
    deadline REAL NOT NULL,
    policy_version INTEGER NOT NULL,
    n_groups INTEGER NOT NULL,
    n_seqs INTEGER NOT NULL,
    n_tokens INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS batches_state ON batches (state, deadline);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS rejections (     -- why the trainer refused a group (state rejected)
    group_id TEXT PRIMARY KEY,
    batch_id TEXT NOT NULL,
    reason TEXT NOT NULL,
    created REAL NOT NULL
);
"""

# Columns added after the first release: (table, column, declaration). A database written by
# an older version gets them on open (ALTER TABLE ... ADD COLUMN keeps every row).
COLUMNS = (
    ("groups", "format", "TEXT NOT NULL DEFAULT 'native'"),  # native | atropos payload
    ("groups", "atropos_env", "INTEGER"),  # env_id the Atropos group was posted with
    ("groups", "qorder", "REAL"),  # Atropos queue order (arrival; promotion from the buffer)
    ("envs", "desired_name", "TEXT"),  # Atropos desired_name (ids count per desired name)
    ("envs", "atropos_weight", "REAL"),  # the weight as registered (may be -1)
    ("envs", "min_batch_allocation", "REAL"),
    ("batches", "kind", "TEXT NOT NULL DEFAULT 'native'"),  # native | atropos
    ("batches", "form_idx", "INTEGER"),  # Atropos: order of formation (served last first)
    ("batches", "members", "TEXT"),  # Atropos: the groups' seqs, in batch order (JSON)
)
INDEXES = """
CREATE INDEX IF NOT EXISTS groups_aqueue ON groups (state, qorder);
CREATE INDEX IF NOT EXISTS groups_qorder ON groups (qorder);
CREATE INDEX IF NOT EXISTS groups_aenv ON groups (state, atropos_env, n_seqs);
CREATE INDEX IF NOT EXISTS batches_kind ON batches (kind, state, form_idx);
"""

Synchronous = Literal["FULL", "NORMAL"]


def connect(path: str, synchronous: Synchronous) -> sqlite3.Connection:
    """The write connection: WAL, ``synchronous`` as asked, schema created or migrated."""
    # isolation_level=None: transactions are explicit (BEGIN IMMEDIATE ... COMMIT).
    db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute(f"PRAGMA synchronous={synchronous}")
    db.execute("PRAGMA busy_timeout=10000")
    db.executescript(SCHEMA)
    for table, column, decl in COLUMNS:
        have = {row[1] for row in db.execute(f"PRAGMA table_info({table})")}
        if column not in have:
            db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {decl}")
    db.execute("UPDATE groups SET qorder=seq WHERE qorder IS NULL")
    db.executescript(INDEXES)
    return db


class Readers:
    """One read-only connection per thread (file databases); ``None`` for ``:memory:``, whose
    contents only the write connection can see."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._local = threading.local()
        self._all: list[sqlite3.Connection] = []
        self._lock = threading.Lock()

    def get(self) -> sqlite3.Connection | None:
        if self.path == ":memory:":
            return None
        db = getattr(self._local, "db", None)
        if db is None:
            uri = "file:" + urllib.parse.quote(self.path) + "?mode=ro"
            db = sqlite3.connect(uri, uri=True, check_same_thread=False)
            db.execute("PRAGMA busy_timeout=10000")
            self._local.db = db
            with self._lock:
                self._all.append(db)
        return db

    def close(self) -> None:
        with self._lock:
            for db in self._all:
                db.close()
            self._all.clear()
        self._local = threading.local()


class Database:
    """The write connection, its lock and the per-thread readers of one database file."""

    def __init__(self, path: str, synchronous: Synchronous) -> None:
        if path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._lock = threading.RLock()
        self._db = connect(path, synchronous)
        self._readers = Readers(path)

    def close(self) -> None:
        with self._lock:
            self._readers.close()
            self._db.close()

    @contextmanager
    def tx(self) -> Iterator[sqlite3.Connection]:
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
                if self._db.in_transaction:
                    try:
                        self._db.execute("ROLLBACK")
                    except sqlite3.Error:  # pragma: no cover - the error being raised says more
                        pass
                raise

    @contextmanager
    def locked(self) -> Iterator[sqlite3.Connection]:
        """The write connection under the lock, outside any transaction: reads that must see
        one consistent state, and no writer runs meanwhile."""
        with self._lock:
            yield self._db

    @contextmanager
    def read(self) -> Iterator[sqlite3.Connection]:
        """A connection for reads that need not wait for writers (WAL snapshot); the write
        connection under the lock for ``:memory:`` databases."""
        db = self._readers.get()
        if db is not None:
            yield db
            return
        with self._lock:
            yield self._db


def get_meta(db: sqlite3.Connection, key: str, default: Any = None) -> Any:
    """The value stored under ``key`` in ``meta`` (JSON), else ``default``."""
    row = db.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
    return default if row is None else json.loads(row[0])


def set_meta(db: sqlite3.Connection, key: str, value: Any) -> None:
    """Store ``value`` (JSON) under ``key``; call inside a write transaction."""
    db.execute(
        "INSERT INTO meta(key, value) VALUES(?, ?) "
        "ON CONFLICT(key) DO UPDATE SET value=excluded.value",
        (key, json.dumps(value)),
    )
