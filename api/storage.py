"""The API's answer to a full or failing disk (docs/FAULT_TOLERANCE.md, "A full disk"):
a clear, retryable status with the reason, nothing half-stored, and a return to normal by
itself once space is back.

- **The reserve** (``--min-free-mb``): while the database's filesystem has less free space
  than this, pushes are refused with HTTP 507 before anything is written, and
  ``/backpressure`` asks every env for 0 groups (no point sampling what cannot be stored).
  Leases and acks, which need little space (an ack even frees payloads), go on, so the
  trainer keeps draining what is queued. Checked on every push (one ``statvfs``).
- **SQLite's own errors**: a write that finds the disk full (``SQLITE_FULL``: the reserve
  was eaten by someone else, or there is none) is rolled back and answered 507; an I/O error
  (``SQLITE_IOERR_*``, e.g. a file-size limit or a failing device) 503. The transaction is
  rolled back either way (``api.db.Database.tx``), so nothing of the request was stored.

Both statuses carry ``Retry-After`` and a ``detail`` naming the cause, the free space and
the path; the project's retry policy (``api.retry``) retries 503 and 507 for every call,
since they prove the request was not processed.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("api.storage")
RETRY_AFTER_S = 5
"""What ``Retry-After`` says (seconds): the retry policy's longest backoff."""
LOG_EVERY_S = 30.0
"""Repeated storage errors are logged at most this often (each one is still counted)."""


class StorageUnavailable(Exception):
    """A request refused because the database cannot take it now; nothing was stored."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status, self.reason = status, reason


def is_storage_error(exc: BaseException) -> bool:
    """A SQLite error that a full or failing disk explains (``SQLITE_FULL``, ``SQLITE_IOERR*``)."""
    name = getattr(exc, "sqlite_errorname", "") or ""
    return name == "SQLITE_FULL" or name.startswith("SQLITE_IOERR")


def _mb(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**20:.1f} MB"


class DiskGuard:
    """The reserve of free space on the database's filesystem, and the counts ``/status``
    shows. Thread-safe (the routes run in a thread pool)."""

    def __init__(
        self, db_path: str, min_free_bytes: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.dir = None if db_path == ":memory:" else str(Path(db_path).resolve().parent)
        self.min_free_bytes = max(0, int(min_free_bytes))
        self.clock = clock
        self.refused = 0
        """Requests answered 503/507 for lack of space or an I/O error since the start."""
        self.low = False
        """Below the reserve at the last check (or the last write found the disk full)."""
        self._lock = threading.Lock()
        self._last_log = -LOG_EVERY_S

    def free_bytes(self) -> int | None:
        """Free bytes for us on the database's filesystem (None: in memory, or unknown)."""
        if self.dir is None:
            return None
        try:
            st = os.statvfs(self.dir)
        except OSError:
            return None
        return st.f_bavail * st.f_frsize

    def check_push(self) -> None:
        """Raise ``StorageUnavailable`` (507) while free space is below the reserve."""
        if self.dir is None:
            return
        free = self.free_bytes()
        if free is None or free >= self.min_free_bytes:
            return
        reason = (
            f"the API's disk is nearly full: {_mb(free)} free on {self.dir} (the database's "
            f"filesystem), below the {_mb(self.min_free_bytes)} reserve (--min-free-mb); "
            "nothing of this request was stored, retry later"
        )
        with self._lock:
            first = not self.low
            self.low = True
        if first:
            log.warning("refusing pushes (HTTP 507): %s", reason)
        raise StorageUnavailable(507, reason)

    def below_reserve(self) -> bool:
        """For ``/backpressure``: True while pushes would be refused."""
        if self.dir is None or self.min_free_bytes == 0:
            return False
        free = self.free_bytes()
        return free is not None and free < self.min_free_bytes

    def stored(self) -> None:
        """A push was stored: if pushes were being refused, that is over (logged once)."""
        if not self.low:
            return
        with self._lock:
            was, self.low = self.low, False
        if was:
            free = _mb(self.free_bytes())
            log.warning(
                "disk space is back (%s free on %s): pushes are stored again", free, self.dir
            )

    def from_sqlite(self, exc: sqlite3.Error) -> StorageUnavailable | None:
        """The answer to a SQLite error that a full or failing disk explains (None: another
        error, a bug, which stays a 500)."""
        name = getattr(exc, "sqlite_errorname", "") or ""
        if name == "SQLITE_FULL":
            status, what = 507, "the disk is full"
            with self._lock:
                self.low = True
        elif name.startswith("SQLITE_IOERR"):
            status, what = 503, "an I/O error"
        else:
            return None
        where = f" ({_mb(self.free_bytes())} free on {self.dir})" if self.dir else ""
        reason = (
            f"the API's database could not be written, {what}: {exc} ({name}){where}; "
            "the transaction was rolled back, nothing of this request was stored, retry later"
        )
        now = self.clock()
        with self._lock:
            loud, self._last_log = now - self._last_log >= LOG_EVERY_S, now
        if loud or status == 503:
            log.warning("HTTP %d: %s", status, reason)
        return StorageUnavailable(status, reason)

    def status(self) -> dict[str, object]:
        """The ``storage_*`` fields of ``/status``."""
        return {
            "storage_free_bytes": self.free_bytes(),
            "storage_reserve_bytes": self.min_free_bytes,
            "storage_low": self.low,
            "storage_refusals": self.refused,
        }

    def refusal(self, err: StorageUnavailable) -> tuple[int, dict[str, str], dict[str, str]]:
        """(status, body, headers) of the reply to ``err``; counts it."""
        with self._lock:
            self.refused += 1
        return err.status, {"detail": err.reason}, {"Retry-After": str(RETRY_AFTER_S)}
