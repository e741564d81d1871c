"""The environments of the store (the ``envs`` table) and the stride scheduler's virtual time
(``meta.vtime``): registration, liveness, and the fair-share passes native batch formation
reads and advances (``api.store_leases``). Every method runs inside the caller's transaction
(``Database.tx``) on the connection it is given."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable

from api.db import get_meta, set_meta


class Envs:
    """Registered environments: weight, group size, liveness and scheduling pass."""

    def __init__(self, clock: Callable[[], float], env_timeout_s: float) -> None:
        self.clock = clock
        self.env_timeout_s = env_timeout_s
        """An env not seen for this long (and with nothing queued) leaves the shares."""

    def virtual_time(self, db: sqlite3.Connection) -> float:
        """Where a new or returning env starts its pass (no burst of old credit)."""
        return float(get_meta(db, "vtime", 0.0))

    def upsert(
        self,
        db: sqlite3.Connection,
        name: str,
        weight: float,
        group_size: int,
        atropos_id: int | None = None,
        max_token_length: int = -1,
    ) -> None:
        """Create an env at the current virtual time, or update its weight and group size."""
        db.execute(
            "INSERT INTO envs(name, weight, group_size, pass, last_seen, atropos_id, "
            "max_token_length) VALUES(?, ?, ?, ?, ?, ?, ?) ON CONFLICT(name) DO UPDATE SET "
            "weight=excluded.weight, group_size=excluded.group_size, connected=1, "
            "last_seen=excluded.last_seen, "
            "atropos_id=COALESCE(excluded.atropos_id, envs.atropos_id), "
            "max_token_length=MAX(excluded.max_token_length, envs.max_token_length)",
            (
                name,
                weight,
                group_size,
                self.virtual_time(db),
                self.clock(),
                atropos_id,
                max_token_length,
            ),
        )

    def touch(self, db: sqlite3.Connection, name: str, group_size: int) -> None:
        """Auto-register an env seen for the first time (weight 1), else mark it alive."""
        cur = db.execute("UPDATE envs SET last_seen=? WHERE name=?", (self.clock(), name))
        if cur.rowcount == 0:
            self.upsert(db, name, 1.0, group_size)

    def set_connected(self, db: sqlite3.Connection, name: str, connected: bool) -> bool:
        cur = db.execute("UPDATE envs SET connected=? WHERE name=?", (int(connected), name))
        return cur.rowcount > 0

    def count_duplicate(self, db: sqlite3.Connection, name: str) -> None:
        db.execute("UPDATE envs SET duplicates=duplicates+1 WHERE name=?", (name,))

    def active(self, db: sqlite3.Connection, now: float) -> dict[str, tuple[float, int]]:
        """``{name: (weight, group_size)}`` of the envs that count in the shares: connected
        and seen lately, or with queued data."""
        rows = db.execute(
            "SELECT name, weight, group_size FROM envs WHERE connected=1 AND (last_seen >= ? "
            "OR EXISTS (SELECT 1 FROM groups WHERE state='queued' AND env=envs.name))",
            (now - self.env_timeout_s,),
        )
        return {name: (weight, gs) for name, weight, gs in rows}

    def passes(self, db: sqlite3.Connection) -> dict[str, list[float]]:
        """``{name: [weight, pass]}`` of every env, each pass at least the virtual time."""
        vtime = self.virtual_time(db)
        return {
            name: [weight, max(pass_, vtime)]
            for name, weight, pass_ in db.execute("SELECT name, weight, pass FROM envs")
        }

    def advance(self, db: sqlite3.Connection, passes: dict[str, list[float]], vtime: float) -> None:
        """Store the passes after a batch was formed and move the virtual time to ``vtime``
        (never backwards)."""
        db.executemany(
            "UPDATE envs SET pass=? WHERE name=?", [(e[1], n) for n, e in passes.items()]
        )
        set_meta(db, "vtime", max(self.virtual_time(db), vtime))
