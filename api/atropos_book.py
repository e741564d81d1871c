"""Atropos bookkeeping on the durable store: trainer and env registration, batch formation
and delivery for ``GET /batch``, and the per-env view of ``/status-env``.

Everything here follows atroposlib 0.4.0's ``run-api`` (``atroposlib/api/server.py``) unless
docs/INTERFACES.md names a difference:
- env ids count up from 0 in registration order; an env's name is
  ``<desired_name>_<how many envs registered that desired_name before>``;
- ``GET /batch`` with nothing formed forms every batch the queue allows at once with
  Atropos's packing (``api.atropos_packing``), advances ``current_step`` by their number and
  serves them last-formed first, one per call;
- ``/status-env`` computes Atropos's ``env_weight``, ``queue_size``, ``self_queue_size``,
  ``max_group_size`` and ``unallocated_fraction`` from the queued groups. It reads through a
  per-thread WAL reader (no store lock) and touches only queued rows (indexed), so its cost
  does not grow with the number of groups served.

Delivery (the part Atropos has no notion of): a served batch is a lease. It is acked by the
trainer's next ``GET /batch`` (or ``POST /batches/{batch_id}/ack``); it is delivered again
when the trainer had disconnected before the reply was sent, when the trainer registers
again (a restart), and when the lease expires without a further ``GET /batch``.
"""

from __future__ import annotations

import json
import math
import re
import sqlite3
import uuid
from typing import Any

from api.atropos_packing import EnvAllocation, QueueItem, form_batches
from api.db import get_meta, set_meta
from api.store import Store

MIN_ENV_WEIGHT = 0.01
"""Atropos's floor on ``env_weight`` (and ours on the fair-share weight of an env
registered with a weight <= 0, e.g. ``inference_weight=-1``)."""
NOT_REGISTERED = {
    "status": "error",
    "message": "Trainer not registered. Call /register first.",
    "batch": [],
}


class AtroposBook:
    """The Atropos routes' state, kept in the store's database (survives restarts). It owns
    the trainer's registration (``meta.atropos``), the Atropos columns of ``envs`` and the
    ``atropos`` batches, and works through the public methods of the store's components
    (``Store.db``, ``Store.queue``, ``Store.envs``)."""

    def __init__(self, store: Store) -> None:
        self.store = store

    # -- registration -------------------------------------------------------------------

    def register_trainer(self, registration: dict[str, Any]) -> int:
        """The first registration (until ``/reset_data``) sets batch size and schedule, as
        in Atropos; every registration puts batches delivered and not yet acked back at the
        front (a restarted trainer gets what its predecessor may not have trained on)."""
        with self.store.db.tx() as db:
            if get_meta(db, "atropos") is None:
                set_meta(db, "atropos", registration)
                self.store.queue.set_step(db, registration.get("starting_step", 0))
            db.execute("UPDATE batches SET state='formed' WHERE kind='atropos' AND state='leased'")
        return uuid.uuid4().int

    def registration(self) -> dict[str, Any] | None:
        with self.store.db.read() as db:
            return get_meta(db, "atropos")

    def register_env(
        self,
        desired_name: str,
        weight: float,
        group_size: int,
        max_token_length: int,
        min_batch_allocation: float | None,
    ) -> dict[str, Any]:
        s = self.store
        with s.db.tx() as db:
            if not s.queue.started(db):
                return {"status": "wait for trainer to start"}
            reg = get_meta(db, "atropos") or {}
            (same,) = db.execute(
                "SELECT COUNT(*) FROM envs WHERE desired_name=?", (desired_name,)
            ).fetchone()
            (env_id,) = db.execute("SELECT COALESCE(MAX(atropos_id) + 1, 0) FROM envs").fetchone()
            real_name = f"{desired_name}_{same}"
            name = re.sub(r"[^A-Za-z0-9_.:\-]", "_", real_name)[:90]
            if db.execute("SELECT 1 FROM envs WHERE name=?", (name,)).fetchone():
                name = f"{name}-{env_id}"  # a native env, or another name sanitised alike
            vtime = s.envs.virtual_time(db)
            db.execute(
                "INSERT INTO envs(name, weight, group_size, pass, last_seen, atropos_id, "
                "max_token_length, desired_name, atropos_weight, min_batch_allocation) "
                "VALUES(?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    name,
                    max(MIN_ENV_WEIGHT, weight),
                    group_size,
                    vtime,
                    s.clock(),
                    env_id,
                    max_token_length,
                    desired_name,
                    weight,
                    min_batch_allocation,
                ),
            )
            return {
                "status": "success",
                "env_id": env_id,
                "wandb_name": real_name,
                "checkpoint_dir": reg.get("checkpoint_dir", ""),
                "starting_step": s.queue.current_step(db),
                "checkpoint_interval": reg.get("save_checkpoint_interval", -1),
                "num_steps": reg.get("num_steps", -1),
            }

    def disconnect(self, env_id: int) -> bool:
        with self.store.db.tx() as db:
            cur = db.execute("UPDATE envs SET connected=0 WHERE atropos_id=?", (env_id,))
            return cur.rowcount > 0

    # -- batches ------------------------------------------------------------------------

    def next_batch(
        self, lease_seconds: float, ack_previous: bool = True
    ) -> tuple[str, list[str]] | dict | None:
        """Ack what the trainer was served before, then serve the next formed batch (forming
        them all first if none is left). ``None``: the queue cannot fill a batch; a dict:
        Atropos's error reply (no trainer registered)."""
        s = self.store
        now = s.clock()
        with s.db.tx() as db:
            reg = get_meta(db, "atropos")
            if reg is None:
                return NOT_REGISTERED
            s.queue.mark_started(db)
            s.queue.expire_leases(db, now)  # a trainer that went away: its batch goes back
            s.queue.drop_stale(db)
            if ack_previous:
                db.execute(
                    "UPDATE groups SET state='acked', payload='' WHERE state='leased' AND "
                    "batch_id IN (SELECT batch_id FROM batches WHERE kind='atropos' AND "
                    "state='leased')"
                )
                db.execute(
                    "UPDATE batches SET state='acked' WHERE kind='atropos' AND state='leased'"
                )
            picked = self._last_formed(db)
            if picked is None:
                self._form_all(db, int(reg["batch_size"]), now)
                picked = self._last_formed(db)
            if picked is None:
                return None
            batch_id, members = picked
            db.execute(
                "UPDATE batches SET state='leased', deadline=? WHERE batch_id=?",
                (now + lease_seconds, batch_id),
            )
            payloads = s.queue.payloads(db, members, want="atropos")
            s.queue.serve_rate.add(len(members), now)
        return batch_id, payloads

    def release(self, batch_id: str) -> None:
        """The trainer was gone before its batch was sent: serve that batch again next."""
        with self.store.db.tx() as db:
            db.execute(
                "UPDATE batches SET state='formed' WHERE batch_id=? AND state='leased'",
                (batch_id,),
            )

    @staticmethod
    def _last_formed(db: sqlite3.Connection) -> tuple[str, list[int]] | None:
        row = db.execute(
            "SELECT batch_id, members FROM batches WHERE kind='atropos' AND state='formed' "
            "ORDER BY form_idx DESC LIMIT 1"
        ).fetchone()
        return None if row is None else (row[0], json.loads(row[1]))

    def _form_all(self, db: sqlite3.Connection, batch_size: int, now: float) -> None:
        rows = db.execute(
            "SELECT seq, n_seqs, n_tokens, atropos_env FROM groups WHERE state='queued' "
            "ORDER BY qorder"
        ).fetchall()
        envs = [
            EnvAllocation(i, bool(c), m)
            for i, c, m in db.execute(
                "SELECT atropos_id, connected, min_batch_allocation FROM envs "
                "WHERE atropos_id IS NOT NULL ORDER BY atropos_id"
            )
        ]
        queue = [QueueItem(n, env_id) for _, n, _, env_id in rows]
        batches = form_batches(queue, batch_size, envs)
        if not batches:
            return
        (base,) = db.execute("SELECT COALESCE(MAX(form_idx) + 1, 0) FROM batches").fetchone()
        version = self.store.queue.live_version(db)
        for k, idxs in enumerate(batches):
            batch_id = uuid.uuid4().hex
            members = [rows[i][0] for i in idxs]
            db.execute(
                "INSERT INTO batches(batch_id, state, created, deadline, policy_version, "
                "n_groups, n_seqs, n_tokens, kind, form_idx, members) "
                "VALUES(?, 'formed', ?, ?, ?, ?, ?, ?, 'atropos', ?, ?)",
                (
                    batch_id,
                    now,
                    math.inf,
                    version,
                    len(idxs),
                    sum(rows[i][1] for i in idxs),
                    sum(rows[i][2] for i in idxs),
                    base + k,
                    json.dumps(members),
                ),
            )
            db.executemany(
                "UPDATE groups SET state='leased', batch_id=? WHERE seq=?",
                [(batch_id, seq) for seq in members],
            )
        self.store.queue.advance_step(db, len(batches))

    # -- status -------------------------------------------------------------------------

    def status_env(self, env_id: int) -> dict[str, Any] | None:
        """Atropos's ``/status-env`` for ``env_id`` (``None``: unknown id)."""
        with self.store.db.read() as db:
            envs = {
                row[0]: row[1:]
                for row in db.execute(
                    "SELECT atropos_id, max_token_length, atropos_weight, connected, "
                    "min_batch_allocation, group_size FROM envs WHERE atropos_id IS NOT NULL"
                )
            }
            if env_id not in envs:
                return None
            queued = {
                env: (int(total), int(largest))
                for env, total, largest in db.execute(
                    "SELECT atropos_env, SUM(n_seqs), MAX(n_seqs) FROM groups "
                    "WHERE state='queued' GROUP BY atropos_env"
                )
            }
            step = self.store.queue.current_step(db)
            batch_size = (get_meta(db, "atropos") or {}).get("batch_size", 0)
        total = sum(ctx * max(0.0, w) for ctx, w, c, _, _ in envs.values() if c)
        ctx, weight, _, _, gs = envs[env_id]
        env_weight = max(MIN_ENV_WEIGHT, ctx * weight / total) if total else MIN_ENV_WEIGHT
        mins = {i: e[3] for i, e in envs.items() if e[2] and e[3] is not None}
        unallocated = 1.0 - min(sum(mins.values()), 1.0)
        max_group = max([1] + [largest for _, largest in queued.values()])
        own, own_largest = queued.get(env_id, (0, 0))
        group_size = max(gs, own_largest)
        available = 0
        if max_group > 1:
            for other, (n, _) in queued.items():
                if other == env_id:
                    continue
                packed = math.ceil(n / max_group) * max_group
                available += max(0, packed - int(batch_size * mins.get(other, 0.0)))
        return {
            "current_step": step,
            "queue_size": (own + available) // group_size,
            "unallocated_fraction": unallocated,
            "self_queue_size": own // group_size,
            "max_group_size": max_group,
            "env_weight": env_weight,
        }
