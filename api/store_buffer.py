"""Atropos's buffer inside ingest: a group posted on the Atropos routes whose size differs
from its env's group size waits as ``buffered`` until buffered groups of that env add up to
the group size, then they join the queue together (as atroposlib does). Two functions the
store's ingest calls inside its transaction, on the connection it is given (the buffer is
rows of the ``groups`` table in state ``buffered``: no state of its own)."""

from __future__ import annotations

import sqlite3

from api.atropos_packing import find_groups_summing_to_target


def placement(
    db: sqlite3.Connection,
    atropos_env: int,
    env: str | None,
    n_seqs: int,
    envs: dict[int, tuple[str, int]],
) -> tuple[str | None, str]:
    """``(env, state)`` of a group of ``n_seqs`` sequences posted for Atropos env id
    ``atropos_env``: ``env`` if given, else the env registered under that id; ``buffered``
    when its size is not that env's group size, else ``queued``. ``envs`` caches the
    lookups of one ingest."""
    if atropos_env not in envs:
        row = db.execute(
            "SELECT name, group_size FROM envs WHERE atropos_id=?", (atropos_env,)
        ).fetchone()
        envs[atropos_env] = row if row else ("", 0)
    name, group_size = envs[atropos_env]
    env = env or name or None
    if group_size and n_seqs != group_size:
        return env, "buffered"  # as Atropos: wait for groups adding up to its size
    return env, "queued"


def promote(db: sqlite3.Connection, env_id: int | None, target: int) -> int:
    """Atropos's buffer: queue the buffered groups of ``env_id`` whose sizes add up to
    its group size (FIFO first, else a subset), at the end of the queue. Returns the
    sequences left in the buffer."""
    rows = db.execute(
        "SELECT seq, n_seqs FROM groups WHERE state='buffered' AND atropos_env=? ORDER BY seq",
        (env_id,),
    ).fetchall()
    picked = find_groups_summing_to_target([n for _, n in rows], target)
    if picked:
        (top,) = db.execute("SELECT COALESCE(MAX(qorder), 0) FROM groups").fetchone()
        db.executemany(
            "UPDATE groups SET state='queued', qorder=? WHERE seq=?",
            [(top + k + 1, rows[i][0]) for k, i in enumerate(picked)],
        )
    return sum(n for k, (_, n) in enumerate(rows) if k not in set(picked))
