"""Backpressure and ``/status`` of the native routes: ``StoreStatus``, a component of
:class:`api.store.Store` that reads the database through the queue's, the envs' and the
native leases' public methods (it owns no state)."""

from __future__ import annotations

import math
import sqlite3
from collections.abc import Callable
from typing import Any

from api.db import Database
from api.storage import DiskGuard, is_storage_error
from api.store_envs import Envs
from api.store_leases import NativeLeases
from api.store_queue import Queue


class StoreStatus:
    """``wanted`` (backpressure) and ``status``."""

    def __init__(
        self,
        db: Database,
        queue: Queue,
        envs: Envs,
        disk: DiskGuard,
        clock: Callable[[], float],
        default_batch_sequences: int,
    ) -> None:
        self.db, self.queue, self.envs, self.disk, self.clock = db, queue, envs, disk, clock
        self.default_batch_sequences = default_batch_sequences
        """The trainer's batch size (sequences) assumed before its first lease."""

    def _queued_seqs(self, db: sqlite3.Connection) -> dict[str, int]:
        rows = db.execute(
            "SELECT env, SUM(n_seqs) FROM groups WHERE state='queued' AND policy_version >= ? "
            "GROUP BY env",
            (self.queue.min_version(db),),
        )
        return {env: int(n) for env, n in rows}

    def wanted(self, env: str) -> tuple[int, int]:
        """(groups ``env`` may push now, policy version). Keeps the queue within what the
        trainer consumes before the data goes stale: ``(max_staleness + 1)`` batches; none
        while the disk is below the reserve (pushes would be refused, ``api.storage``)."""
        now = self.clock()
        with self.db.tx() as db:
            self.envs.touch(db, env, 1)
            active = self.envs.active(db, now)
            queued = self._queued_seqs(db)
            version = self.queue.live_version(db)
            below = self.disk.below_reserve()
            wanted = 0 if below else self._wanted(db, env, active, queued)
            return wanted, version

    def _wanted(
        self,
        db: sqlite3.Connection,
        env: str,
        active: dict[str, tuple[float, int]],
        queued: dict[str, int],
    ) -> int:
        if env not in active:
            return 0
        batch = NativeLeases.batch_sequences(db, self.default_batch_sequences)
        capacity = (self.queue.max_staleness + 1) * batch
        weight, group_size = active[env]
        share = weight / sum(w for w, _ in active.values())
        room = min(share * capacity - queued.get(env, 0), capacity - sum(queued.values()))
        return max(0, math.floor(room / group_size))

    def status(self) -> dict[str, Any]:
        q = self.queue
        now = self.clock()
        try:
            with self.db.tx() as db:  # expire leases first, so the counts are current
                q.expire_leases(db, now)
        except sqlite3.Error as e:  # a full disk: report what is stored, leases as they are
            if not is_storage_error(e):
                raise
        with self.db.locked() as db:  # reads only; no writer runs meanwhile
            counts: dict[str, dict[str, int]] = {}
            for env, state, n, n_seqs in db.execute(
                "SELECT env, state, COUNT(*), SUM(n_seqs) FROM groups GROUP BY env, state"
            ):
                counts.setdefault(env, {})[state] = n
                counts[env][state + "_seqs"] = n_seqs
            versions = {
                env: (lo, hi)
                for env, lo, hi in db.execute(
                    "SELECT env, MIN(policy_version), MAX(policy_version) FROM groups "
                    "WHERE state='queued' GROUP BY env"
                )
            }
            active = self.envs.active(db, now)
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
                        "wanted": self._wanted(db, name, active, queued),
                    }
                )
            batch_counts = dict(
                db.execute("SELECT state, COUNT(*) FROM batches GROUP BY state").fetchall()
            )
            return {
                "current_step": q.current_step(db),
                "queue_size": sum(e["queued_groups"] for e in envs),
                "policy_version": q.live_version(db),
                "max_staleness": q.max_staleness,
                "envs": envs,
                "queued_groups": sum(e["queued_groups"] for e in envs),
                "active_leases": batch_counts.get("leased", 0),
                "expired_leases": batch_counts.get("expired", 0),
                "acked_batches": batch_counts.get("acked", 0),
                "skipped_batches": batch_counts.get("skipped", 0),
                "rejected_groups": sum(e["rejected_groups"] for e in envs),
                "dropped_groups": sum(e["dropped_groups"] for e in envs),
                "ingest_groups_per_s": q.ingest_rate.per_s(now),
                "serve_groups_per_s": q.serve_rate.per_s(now),
                "rate_window_s": q.ingest_rate.window,
                **self.disk.status(),
            }
