"""The groups' lifecycle that both protocols share: the live policy version and staleness,
lease expiry, the payloads a batch serves (in either contract), the count of batches formed
and the in-memory ingest/serve rates. ``Queue`` owns ``meta.policy_version``, ``meta.step``
and ``meta.started``; its methods that take a connection run inside the caller's
transaction (``api.db.Database.tx``)."""

from __future__ import annotations

import sqlite3
from collections import deque
from dataclasses import dataclass, field

from api.atropos_convert import from_native, to_native
from api.db import get_meta, set_meta


@dataclass
class Rate:
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


class Queue:
    """Versions, staleness, expiry and serving of the ``groups`` table."""

    def __init__(self, max_staleness: int, rate_window_s: float) -> None:
        self.max_staleness = max_staleness
        self.ingest_rate = Rate(rate_window_s)
        self.serve_rate = Rate(rate_window_s)

    # -- versions and staleness ----------------------------------------------------------

    @staticmethod
    def live_version(db: sqlite3.Connection) -> int:
        """The weight version the trainer reported last."""
        return int(get_meta(db, "policy_version", 0))

    def min_version(self, db: sqlite3.Connection) -> int:
        """The oldest version still fresh enough to queue or serve."""
        return self.live_version(db) - self.max_staleness

    def set_live_version(self, db: sqlite3.Connection, version: int) -> int:
        """Record the live weight version; returns how many queued groups it made stale."""
        set_meta(db, "policy_version", version)
        return self.drop_stale(db)

    def drop_stale(self, db: sqlite3.Connection) -> int:
        """Drop the queued groups older than ``max_staleness`` versions; returns how many."""
        cur = db.execute(
            "UPDATE groups SET state='dropped', payload='' "
            "WHERE state='queued' AND policy_version < ?",
            (self.min_version(db),),
        )
        return cur.rowcount

    # -- leases and serving --------------------------------------------------------------

    @staticmethod
    def expire_leases(db: sqlite3.Connection, now: float) -> int:
        """Put the groups of every lease past its deadline back in the queue."""
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

    @staticmethod
    def payloads(db: sqlite3.Connection, seqs: list[int], want: str) -> list[str]:
        """The groups' JSON in ``want``'s contract (``native`` or ``atropos``), in ``seqs``'
        order: as stored when they arrived in it, converted otherwise (``api.atropos_convert``:
        Atropos groups leased natively, native ones on ``GET /batch``)."""
        by_seq: dict[int, str] = {}
        for i in range(0, len(seqs), 500):  # SQLite caps bound parameters per statement
            chunk = seqs[i : i + 500]
            marks = ",".join("?" * len(chunk))
            for seq, payload, fmt, gid, env, version in db.execute(
                "SELECT seq, payload, format, group_id, env, policy_version FROM groups "
                f"WHERE seq IN ({marks})",
                chunk,
            ):
                if fmt == want:
                    by_seq[seq] = payload
                elif want == "native":
                    by_seq[seq] = to_native(payload, gid, env, version)
                else:
                    by_seq[seq] = from_native(payload)
        return [by_seq[s] for s in seqs]

    # -- counters ------------------------------------------------------------------------

    @staticmethod
    def current_step(db: sqlite3.Connection) -> int:
        """Batches formed so far (Atropos ``current_step``, from its trainer's
        ``starting_step``)."""
        return int(get_meta(db, "step", 0))

    @staticmethod
    def set_step(db: sqlite3.Connection, step: int) -> None:
        set_meta(db, "step", step)

    def advance_step(self, db: sqlite3.Connection, batches: int) -> int:
        """Count ``batches`` more batches formed; returns the new step."""
        step = self.current_step(db) + batches
        self.set_step(db, step)
        return step

    @staticmethod
    def mark_started(db: sqlite3.Connection) -> None:
        """A trainer asked for a batch (Atropos envs wait for this before registering)."""
        set_meta(db, "started", True)

    @staticmethod
    def started(db: sqlite3.Connection) -> bool:
        return bool(get_meta(db, "started", False))

    def clear_rates(self) -> None:
        self.ingest_rate.events.clear()
        self.serve_rate.events.clear()
