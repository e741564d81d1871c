"""Backpressure and ``/status`` of the native routes; a mixin of :class:`api.store.Store`."""

from __future__ import annotations

import math
import sqlite3
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from api.storage import is_storage_error


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


class StatusMixin:
    """``wanted`` (backpressure) and ``status``."""

    def _batch_sequences(self) -> int:
        return int(self._meta("batch_sequences", self.default_batch_sequences))

    def native_batch_size(self) -> int:
        """Sequences per batch the native trainer leases (from its last lease), -1 before one:
        what Atropos's ``/info`` reports when no Atropos trainer registered."""
        return int(self.get_meta("batch_sequences", -1))

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
        trainer consumes before the data goes stale: ``(max_staleness + 1)`` batches; none
        while the disk is below the reserve (pushes would be refused, ``api.storage``)."""
        now = self.clock()
        with self._tx() as db:
            self._touch_env(db, env, 1)
            active = self._active_envs(db, now)
            queued = self._queued_seqs(db)
            version = int(self._meta("policy_version", 0))
            wanted = 0 if self.disk.below_reserve() else self._wanted(env, active, queued)
            return wanted, version

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
        try:
            with self._tx() as db:  # expire leases first, so the counts are current
                self._expire_leases(db, now)
        except sqlite3.Error as e:  # a full disk: report what is stored, leases as they are
            if not is_storage_error(e):
                raise
        with self._lock:  # reads only; no writer runs meanwhile
            db = self._db
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
                        "rejected_groups": c.get("rejected", 0),
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
                "current_step": int(self._meta("step", 0)),
                "queue_size": sum(e["queued_groups"] for e in envs),
                "policy_version": int(self._meta("policy_version", 0)),
                "max_staleness": self.max_staleness,
                "envs": envs,
                "queued_groups": sum(e["queued_groups"] for e in envs),
                "active_leases": batch_counts.get("leased", 0),
                "expired_leases": batch_counts.get("expired", 0),
                "acked_batches": batch_counts.get("acked", 0),
                "skipped_batches": batch_counts.get("skipped", 0),
                "rejected_groups": sum(e["rejected_groups"] for e in envs),
                "dropped_groups": sum(e["dropped_groups"] for e in envs),
                "ingest_groups_per_s": self.ingest_rate.per_s(now),
                "serve_groups_per_s": self.serve_rate.per_s(now),
                "rate_window_s": self.ingest_rate.window,
                **self.disk.status(),
            }
