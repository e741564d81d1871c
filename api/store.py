"""Durable storage of the batching API: SQLite in WAL mode, one connection behind a lock.

Every state change (a group stored, a lease taken or acked, a version reported) is committed
before the HTTP reply that acknowledges it, so what a client was told survives ``kill -9``.
Groups move through ``queued -> leased -> acked`` (or ``queued -> dropped`` when too stale);
an expired lease puts its groups back to ``queued``. Rows of acked/dropped groups stay (their
``group_id`` keeps deduplicating) but their payload is cleared to bound the file's growth.
A batch the trainer could not train on (a non-finite gradient) is marked ``skipped``: its
groups leave the queue, are never counted as acked, and keep their payload for inspection.

Batch formation (``lease``) is a weighted fair share across environments by stride
scheduling: each env has a ``pass`` that grows by ``sequences / weight`` whenever it is served,
and the env with the smallest pass among those with data goes next. An env without data is
skipped, so none can stall a batch; an env coming back after idling starts at the current
virtual time rather than with a burst of credit. Within an env groups are served FIFO and a
group is never split.
"""

from __future__ import annotations

import json
import math
import sqlite3
import threading
import time
import uuid
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from api.protocol import ScoredGroup

SCHEMA = """
CREATE TABLE IF NOT EXISTS groups (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,   -- arrival order (FIFO within an env)
    group_id TEXT NOT NULL UNIQUE,           -- idempotency key
    env TEXT NOT NULL,
    policy_version INTEGER NOT NULL,
    n_seqs INTEGER NOT NULL,
    n_tokens INTEGER NOT NULL,
    state TEXT NOT NULL,                     -- queued | leased | acked | dropped | skipped
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
    state TEXT NOT NULL,                     -- leased | acked | expired | skipped
    created REAL NOT NULL,
    deadline REAL NOT NULL,
    policy_version INTEGER NOT NULL,
    n_groups INTEGER NOT NULL,
    n_seqs INTEGER NOT NULL,
    n_tokens INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS batches_state ON batches (state, deadline);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""

Synchronous = Literal["FULL", "NORMAL"]


class UnknownBatch(KeyError):
    """Ack of a batch id the store never leased."""


@dataclass
class LeasedBatch:
    batch_id: str
    deadline: float
    policy_version: int
    payloads: list[str]
    """The groups' JSON, in batch order, exactly as stored."""


@dataclass
class IngestResult:
    accepted: int = 0
    duplicates: int = 0
    stale: int = 0


@dataclass
class _Rate:
    """Events per second over a sliding window (in memory: a rate need not survive a crash)."""

    window: float
    events: deque[tuple[float, int]] = field(default_factory=deque)

    def add(self, n: int, now: float) -> None:
        self.events.append((now, n))
        self.trim(now)

    def trim(self, now: float) -> None:
        while self.events and self.events[0][0] < now - self.window:
            self.events.popleft()

    def per_s(self, now: float) -> float:
        self.trim(now)
        return sum(n for _, n in self.events) / self.window


@dataclass
class _Candidate:
    seq: int
    env: str
    n_seqs: int
    n_tokens: int


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
        clock: Any = time.time,
    ) -> None:
        self.path = str(path)
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self.max_staleness = max_staleness
        self.default_batch_sequences = default_batch_sequences
        self.env_timeout_s = env_timeout_s
        self.clock = clock
        self._lock = threading.RLock()
        # isolation_level=None: we issue BEGIN/COMMIT ourselves (explicit transactions).
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(f"PRAGMA synchronous={synchronous}")
        self._db.execute("PRAGMA busy_timeout=10000")
        self._db.executescript(SCHEMA)
        self.ingest_rate = _Rate(rate_window_s)
        self.serve_rate = _Rate(rate_window_s)
        self.latest_payload: str | None = None

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        """One write transaction, committed (durably) before the caller replies."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

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

    def env_by_atropos_id(self, atropos_id: int) -> dict[str, Any] | None:
        with self._lock:
            row = self._db.execute(
                "SELECT name, weight, group_size, connected, max_token_length FROM envs "
                "WHERE atropos_id=?",
                (atropos_id,),
            ).fetchone()
        if row is None:
            return None
        keys = ("name", "weight", "group_size", "connected", "max_token_length")
        return dict(zip(keys, row, strict=True))

    def next_atropos_id(self, desired_name: str) -> tuple[int, int]:
        """(next free Atropos env id, how many envs already use ``desired_name``)."""
        with self._lock:
            (next_id,) = self._db.execute(
                "SELECT COALESCE(MAX(atropos_id) + 1, 0) FROM envs"
            ).fetchone()
            (same,) = self._db.execute(
                "SELECT COUNT(*) FROM envs WHERE atropos_id IS NOT NULL AND name LIKE ?",
                (desired_name + "\\_%",),
            ).fetchone()
        return int(next_id), int(same)

    # -- ingest --------------------------------------------------------------------------

    def ingest(self, groups: Sequence[ScoredGroup]) -> IngestResult:
        """Store groups in one transaction; repeated ``group_id``s are counted, not stored."""
        result = IngestResult()
        now = self.clock()
        rows = [(g, g.model_dump_json()) for g in groups]  # serialise outside the lock
        with self._tx() as db:
            min_version = self._min_version()
            for g, payload in rows:
                stale = g.policy_version < min_version
                cur = db.execute(
                    "INSERT OR IGNORE INTO groups(group_id, env, policy_version, n_seqs, "
                    "n_tokens, state, payload, created) VALUES(?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        g.group_id,
                        g.env,
                        g.policy_version,
                        len(g.sequences),
                        g.num_tokens,
                        "dropped" if stale else "queued",
                        "" if stale else payload,
                        now,
                    ),
                )
                self._touch_env(db, g.env, len(g.sequences))
                if cur.rowcount == 0:
                    result.duplicates += 1
                    db.execute("UPDATE envs SET duplicates=duplicates+1 WHERE name=?", (g.env,))
                else:
                    result.accepted += 1
                    result.stale += stale
            # In-memory bookkeeping under the same lock (status() iterates the rates).
            self.ingest_rate.add(result.accepted, now)
            if rows:
                self.latest_payload = rows[-1][1]
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

    # -- leases --------------------------------------------------------------------------

    def lease(
        self,
        max_tokens: int | None,
        max_sequences: int | None,
        lease_seconds: float,
        allow_partial: bool = False,
    ) -> LeasedBatch | None:
        """Form and lease the next batch, or ``None`` when the queue cannot fill one."""
        now = self.clock()
        with self._tx() as db:
            self._set_meta("started", True)
            self._remember_batch_size(db, max_tokens, max_sequences)
            self._expire_leases(db, now)
            self._drop_stale(db)
            chosen = self._form(
                db, max_tokens or math.inf, max_sequences or math.inf, allow_partial
            )
            if not chosen:
                return None  # the transaction commits the expiries/drops, no pass change
            batch_id = uuid.uuid4().hex
            version = int(self._meta("policy_version", 0))
            deadline = now + lease_seconds
            seqs = [c.seq for c in chosen]
            db.executemany(
                "UPDATE groups SET state='leased', batch_id=? WHERE seq=?",
                [(batch_id, s) for s in seqs],
            )
            db.execute(
                "INSERT INTO batches VALUES(?, 'leased', ?, ?, ?, ?, ?, ?)",
                (
                    batch_id,
                    now,
                    deadline,
                    version,
                    len(chosen),
                    sum(c.n_seqs for c in chosen),
                    sum(c.n_tokens for c in chosen),
                ),
            )
            payloads = self._payloads(db, seqs)
            self.serve_rate.add(len(chosen), now)
        return LeasedBatch(batch_id, deadline, version, payloads)

    def _payloads(self, db: sqlite3.Connection, seqs: list[int]) -> list[str]:
        by_seq: dict[int, str] = {}
        for i in range(0, len(seqs), 500):  # SQLite caps bound parameters per statement
            chunk = seqs[i : i + 500]
            marks = ",".join("?" * len(chunk))
            for seq, payload in db.execute(
                f"SELECT seq, payload FROM groups WHERE seq IN ({marks})", chunk
            ):
                by_seq[seq] = payload
        return [by_seq[s] for s in seqs]

    def _remember_batch_size(
        self, db: sqlite3.Connection, max_tokens: int | None, max_sequences: int | None
    ) -> None:
        """Keep the trainer's batch size (in sequences) for the backpressure estimate."""
        if max_sequences is not None:
            seqs = max_sequences
        else:
            row = db.execute(
                "SELECT SUM(n_tokens), SUM(n_seqs) FROM "
                "(SELECT n_tokens, n_seqs FROM groups ORDER BY seq DESC LIMIT 256)"
            ).fetchone()
            per_seq = (row[0] / row[1]) if row and row[1] else None
            seqs = int(max_tokens // per_seq) if (per_seq and max_tokens) else None
        if seqs:
            self._set_meta("batch_sequences", max(1, seqs))

    def _form(
        self, db: sqlite3.Connection, max_tokens: float, max_seqs: float, allow_partial: bool
    ) -> list[_Candidate]:
        """Pick groups by weighted fair share; update the envs' passes. [] = no batch."""
        envs = {
            name: [weight, pass_]
            for name, weight, pass_ in db.execute("SELECT name, weight, pass FROM envs")
        }
        vtime = float(self._meta("vtime", 0.0))
        for e in envs.values():  # an env back from idling gets no burst of old credit
            e[1] = max(e[1], vtime)
        heads = {name: self._queue_iter(db, name) for name in envs}
        current = {name: next(it, None) for name, it in heads.items()}
        current = {k: v for k, v in current.items() if v is not None}
        if current:  # the virtual time: the smallest pass among envs with data
            vtime = max(vtime, min(envs[n][1] for n in current))
        chosen: list[_Candidate] = []
        tokens = seqs = 0
        blocked: list[str] = []
        while current:
            name = min(current, key=lambda n: (envs[n][1], n))
            c = current[name]
            if tokens + c.n_tokens > max_tokens or seqs + c.n_seqs > max_seqs:
                blocked.append(name)  # FIFO within an env: do not serve around its head
                del current[name]
                continue
            chosen.append(c)
            tokens += c.n_tokens
            seqs += c.n_seqs
            envs[name][1] += c.n_seqs / envs[name][0]
            nxt = next(heads[name], None)
            if nxt is None:
                del current[name]
            else:
                current[name] = nxt
        if not chosen and blocked:
            # A group larger than the whole budget would block its env forever: serve it alone.
            name = min(blocked, key=lambda n: (envs[n][1], n))
            c = next(self._queue_iter(db, name))
            chosen, envs[name][1] = [c], envs[name][1] + c.n_seqs / envs[name][0]
        full = bool(blocked) or tokens >= max_tokens or seqs >= max_seqs
        if not chosen or not (full or allow_partial):
            return []
        db.executemany("UPDATE envs SET pass=? WHERE name=?", [(e[1], n) for n, e in envs.items()])
        # The virtual time moves to the smallest pass among envs still backlogged (or just
        # served): where an env that had nothing to offer rejoins.
        backlog = blocked or [c.env for c in chosen]
        self._set_meta("vtime", max(vtime, min(envs[n][1] for n in backlog)))
        return chosen

    def _queue_iter(self, db: sqlite3.Connection, env: str) -> Iterator[_Candidate]:
        cur = db.execute(
            "SELECT seq, n_seqs, n_tokens FROM groups WHERE state='queued' AND env=? ORDER BY seq",
            (env,),
        )
        while rows := cur.fetchmany(64):
            for seq, n_seqs, n_tokens in rows:
                yield _Candidate(seq, env, n_seqs, n_tokens)

    def ack(self, batch_id: str) -> tuple[str, int]:
        """Mark a batch consumed. Idempotent; a late ack (lease expired) acks those of its
        groups that are back in the queue and not leased again."""
        with self._tx() as db:
            row = db.execute("SELECT state FROM batches WHERE batch_id=?", (batch_id,)).fetchone()
            if row is None:
                raise UnknownBatch(batch_id)
            if row[0] in ("acked", "skipped"):  # a skipped batch was not trained: stays so
                return f"already_{row[0]}", 0
            from_state = "leased" if row[0] == "leased" else "queued"
            cur = db.execute(
                "UPDATE groups SET state='acked', payload='' WHERE batch_id=? AND state=?",
                (batch_id, from_state),
            )
            db.execute("UPDATE batches SET state='acked' WHERE batch_id=?", (batch_id,))
            return ("acked" if row[0] == "leased" else "acked_late"), cur.rowcount

    def skip(self, batch_id: str) -> tuple[str, int]:
        """Mark a batch consumed but NOT trained (the trainer skipped its update): its groups
        go to ``skipped`` (payload kept) and leave the queue. Idempotent; a batch already acked
        stays acked (``already_acked``); after an expired lease only the groups back in the
        queue and not leased again are skipped (``skipped_late``)."""
        with self._tx() as db:
            row = db.execute("SELECT state FROM batches WHERE batch_id=?", (batch_id,)).fetchone()
            if row is None:
                raise UnknownBatch(batch_id)
            if row[0] in ("acked", "skipped"):
                return f"already_{row[0]}", 0
            from_state = "leased" if row[0] == "leased" else "queued"
            cur = db.execute(
                "UPDATE groups SET state='skipped' WHERE batch_id=? AND state=?",
                (batch_id, from_state),
            )
            db.execute("UPDATE batches SET state='skipped' WHERE batch_id=?", (batch_id,))
            return ("skipped" if row[0] == "leased" else "skipped_late"), cur.rowcount

    # -- backpressure and status ---------------------------------------------------------

    def _batch_sequences(self) -> int:
        return int(self._meta("batch_sequences", self.default_batch_sequences))

    def _active_envs(self, db: sqlite3.Connection, now: float) -> dict[str, tuple[float, int]]:
        """Envs that count in the shares: connected and seen lately, or with queued data."""
        rows = db.execute(
            "SELECT name, weight, group_size FROM envs WHERE connected=1 AND (last_seen >= ? "
            "OR EXISTS (SELECT 1 FROM groups WHERE state='queued' AND env=envs.name))",
            (now - self.env_timeout_s,),
        )
        return {name: (weight, gs) for name, weight, gs in rows}

    def _queued_seqs(self, db: sqlite3.Connection) -> dict[str, int]:
        rows = db.execute(
            "SELECT env, SUM(n_seqs) FROM groups WHERE state='queued' AND policy_version >= ? "
            "GROUP BY env",
            (self._min_version(),),
        )
        return {env: int(n) for env, n in rows}

    def wanted(self, env: str) -> tuple[int, int]:
        """(groups ``env`` may push now, policy version). Keeps the queue within what the
        trainer consumes before the data goes stale: ``(max_staleness + 1)`` batches."""
        now = self.clock()
        with self._tx() as db:
            self._touch_env(db, env, 1)
            active = self._active_envs(db, now)
            queued = self._queued_seqs(db)
            version = int(self._meta("policy_version", 0))
            return self._wanted(env, active, queued), version

    def _wanted(
        self, env: str, active: dict[str, tuple[float, int]], queued: dict[str, int]
    ) -> int:
        if env not in active:
            return 0
        capacity = (self.max_staleness + 1) * self._batch_sequences()
        weight, group_size = active[env]
        share = weight / sum(w for w, _ in active.values())
        room = min(share * capacity - queued.get(env, 0), capacity - sum(queued.values()))
        return max(0, math.floor(room / group_size))

    def status(self) -> dict[str, Any]:
        now = self.clock()
        with self._tx() as db:  # a write tx: expire leases so the counts are current
            self._expire_leases(db, now)
            counts: dict[str, dict[str, int]] = {}
            for env, state, n, s in db.execute(
                "SELECT env, state, COUNT(*), SUM(n_seqs) FROM groups GROUP BY env, state"
            ):
                counts.setdefault(env, {})[state] = n
                counts[env][state + "_seqs"] = s
            versions = {
                env: (lo, hi)
                for env, lo, hi in db.execute(
                    "SELECT env, MIN(policy_version), MAX(policy_version) FROM groups "
                    "WHERE state='queued' GROUP BY env"
                )
            }
            active = self._active_envs(db, now)
            queued = self._queued_seqs(db)
            envs = []
            for name, weight, gs, connected, dups in db.execute(
                "SELECT name, weight, group_size, connected, duplicates FROM envs ORDER BY name"
            ).fetchall():
                c = counts.get(name, {})
                lo, hi = versions.get(name, (None, None))
                envs.append(
                    {
                        "name": name,
                        "weight": weight,
                        "group_size": gs,
                        "connected": bool(connected),
                        "queued_groups": c.get("queued", 0),
                        "queued_sequences": c.get("queued_seqs", 0) or 0,
                        "leased_groups": c.get("leased", 0),
                        "acked_groups": c.get("acked", 0),
                        "dropped_groups": c.get("dropped", 0),
                        "skipped_groups": c.get("skipped", 0),
                        "duplicate_groups": dups,
                        "min_queued_version": lo,
                        "max_queued_version": hi,
                        "wanted": self._wanted(name, active, queued),
                    }
                )
            batch_counts = dict(
                db.execute("SELECT state, COUNT(*) FROM batches GROUP BY state").fetchall()
            )
            return {
                "current_step": sum(batch_counts.values()),
                "queue_size": sum(e["queued_groups"] for e in envs),
                "policy_version": int(self._meta("policy_version", 0)),
                "max_staleness": self.max_staleness,
                "envs": envs,
                "queued_groups": sum(e["queued_groups"] for e in envs),
                "active_leases": batch_counts.get("leased", 0),
                "expired_leases": batch_counts.get("expired", 0),
                "acked_batches": batch_counts.get("acked", 0),
                "skipped_batches": batch_counts.get("skipped", 0),
                "dropped_groups": sum(e["dropped_groups"] for e in envs),
                "ingest_groups_per_s": self.ingest_rate.per_s(now),
                "serve_groups_per_s": self.serve_rate.per_s(now),
                "rate_window_s": self.ingest_rate.window,
            }

    def reset(self) -> None:
        """Forget everything (Atropos ``/reset_data``)."""
        with self._tx() as db:
            for table in ("groups", "envs", "batches", "meta"):
                db.execute(f"DELETE FROM {table}")
        self.latest_payload = None
