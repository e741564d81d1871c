"""Batch formation of the native routes (weighted fair share by stride scheduling, never
splitting a group), leases, acks, skips and rejections: ``NativeLeases``, a component of
:class:`api.store.Store` built on the database, the queue and the envs (their public
methods). It owns the ``batches`` rows of native leases, the ``rejections`` table and the
trainer's batch size (``meta.batch_sequences``). It does not import the Atropos wire parser:
an Atropos group is served natively through ``api.atropos_convert`` (``Queue.payloads``)."""

from __future__ import annotations

import math
import sqlite3
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from api.db import Database, get_meta, set_meta
from api.store_envs import Envs
from api.store_queue import Queue


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
class _Candidate:
    seq: int
    env: str
    n_seqs: int
    n_tokens: int


class NativeLeases:
    """``lease`` / ``ack`` / ``skip`` / ``reject`` of the native routes."""

    def __init__(self, db: Database, queue: Queue, envs: Envs, clock: Callable[[], float]) -> None:
        self.db, self.queue, self.envs, self.clock = db, queue, envs, clock

    def lease(
        self,
        max_tokens: int | None,
        max_sequences: int | None,
        lease_seconds: float,
        allow_partial: bool = False,
    ) -> LeasedBatch | None:
        """Form and lease the next batch, or ``None`` when the queue cannot fill one."""
        q = self.queue
        now = self.clock()
        with self.db.tx() as db:
            q.mark_started(db)
            self._remember_batch_size(db, max_tokens, max_sequences)
            q.expire_leases(db, now)
            q.drop_stale(db)
            chosen = self._form(
                db, max_tokens or math.inf, max_sequences or math.inf, allow_partial
            )
            if not chosen:
                return None  # the transaction commits the expiries/drops, no pass change
            batch_id = uuid.uuid4().hex
            version = q.live_version(db)
            deadline = now + lease_seconds
            seqs = [c.seq for c in chosen]
            db.executemany(
                "UPDATE groups SET state='leased', batch_id=? WHERE seq=?",
                [(batch_id, q) for q in seqs],
            )
            db.execute(
                "INSERT INTO batches(batch_id, state, created, deadline, policy_version, "
                "n_groups, n_seqs, n_tokens) VALUES(?, 'leased', ?, ?, ?, ?, ?, ?)",
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
            payloads = q.payloads(db, seqs, want="native")
            q.advance_step(db, 1)
            q.serve_rate.add(len(chosen), now)
        return LeasedBatch(batch_id, deadline, version, payloads)

    @staticmethod
    def batch_sequences(db: sqlite3.Connection, default: int) -> int:
        """Sequences per batch the native trainer leases (from its last lease), else
        ``default``."""
        return int(get_meta(db, "batch_sequences", default))

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
            set_meta(db, "batch_sequences", max(1, seqs))

    def _form(
        self, db: sqlite3.Connection, max_tokens: float, max_seqs: float, allow_partial: bool
    ) -> list[_Candidate]:
        """Pick groups by weighted fair share; update the envs' passes. [] = no batch."""
        envs = self.envs.passes(db)  # an env back from idling gets no burst of credit
        vtime = self.envs.virtual_time(db)
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
        # The virtual time moves to the smallest pass among envs still backlogged (or just
        # served): where an env that had nothing to offer rejoins.
        backlog = blocked or [c.env for c in chosen]
        self.envs.advance(db, envs, max(vtime, min(envs[n][1] for n in backlog)))
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
        return self._close_batch(batch_id, "acked", clear_payload=True)

    def skip(self, batch_id: str) -> tuple[str, int]:
        """Mark a batch consumed but NOT trained (the trainer skipped its update): its groups
        go to ``skipped`` (payload kept) and leave the queue. Idempotent; a batch already acked
        stays acked (``already_acked``); after an expired lease only the groups back in the
        queue and not leased again are skipped (``skipped_late``)."""
        return self._close_batch(batch_id, "skipped", clear_payload=False)

    def reject(self, batch_id: str, reasons: dict[str, str]) -> tuple[int, list[str]]:
        """The trainer refuses some groups of a batch it leased (a field it cannot honour):
        they go to ``rejected`` (payload kept, reason in the ``rejections`` table), are never
        served again, and the rest of the batch is acked or skipped as usual. Idempotent.
        Returns how many of them are now rejected and the ids that are not this batch's."""
        now = self.clock()
        with self.db.tx() as db:
            if db.execute("SELECT 1 FROM batches WHERE batch_id=?", (batch_id,)).fetchone() is None:
                raise UnknownBatch(batch_id)
            done, missing = 0, []
            for gid, reason in reasons.items():
                row = db.execute(
                    "SELECT state FROM groups WHERE group_id=? AND batch_id=?", (gid, batch_id)
                ).fetchone()
                if row is None or row[0] not in ("leased", "queued", "rejected"):
                    missing.append(gid)  # unknown, leased again elsewhere, or acked/skipped
                    continue
                db.execute("UPDATE groups SET state='rejected' WHERE group_id=?", (gid,))
                db.execute(
                    "INSERT OR REPLACE INTO rejections(group_id, batch_id, reason, created) "
                    "VALUES(?, ?, ?, ?)",
                    (gid, batch_id, reason, now),
                )
                done += 1
            return done, missing

    def rejections(self) -> dict[str, str]:
        """Every group the trainer refused, with its reason."""
        with self.db.tx() as db:
            return dict(db.execute("SELECT group_id, reason FROM rejections").fetchall())

    def _close_batch(self, batch_id: str, state: str, clear_payload: bool) -> tuple[str, int]:
        """Move a batch and its groups to the final ``state`` (``acked`` or ``skipped``). A
        batch already in either final state stays as it is (``already_<state>``); after an
        expired lease only its groups back in the queue move (``<state>_late``)."""
        with self.db.tx() as db:
            row = db.execute("SELECT state FROM batches WHERE batch_id=?", (batch_id,)).fetchone()
            if row is None:
                raise UnknownBatch(batch_id)
            if row[0] in ("acked", "skipped"):  # a skipped batch was not trained: stays so
                return f"already_{row[0]}", 0
            from_state = "leased" if row[0] in ("leased", "formed") else "queued"
            payload = ", payload=''" if clear_payload else ""
            cur = db.execute(
                f"UPDATE groups SET state=?{payload} WHERE batch_id=? AND state=?",
                (state, batch_id, from_state),
            )
            db.execute("UPDATE batches SET state=? WHERE batch_id=?", (state, batch_id))
            return (f"{state}_late" if row[0] == "expired" else state), cur.rowcount
