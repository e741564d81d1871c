"""The resume cache of rationale synthesis: one fsync'd JSONL line per finished row
(docs/SYNTHESIS.md)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger("env_server.synthesize")


class Cache:
    """Append-only JSONL of finished rows, one fsync'd line each; tolerant of a torn last line.

    A kill can land in the middle of a write: the torn line is cut off on open (it never
    finished, so its row is simply asked again), and later lines start on a fresh line.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.entries: dict[str, dict[str, Any]] = {}
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():
            self._load()
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def _load(self) -> None:
        data = self.path.read_bytes()
        good = data[: data.rfind(b"\n") + 1]
        if len(good) != len(data):
            log.warning("cache %s ends in a torn line (killed mid-write); dropping it", self.path)
            with open(self.path, "r+b") as f:
                f.truncate(len(good))
        for n, line in enumerate(good.decode("utf-8").splitlines(), start=1):
            try:
                entry = json.loads(line)
                self.entries[str(entry["id"])] = entry
            except (json.JSONDecodeError, KeyError, TypeError):
                log.warning("cache %s line %d is not a cache entry; ignored", self.path, n)

    def add(self, entry: dict[str, Any]) -> None:
        self._file.write(json.dumps(entry, ensure_ascii=False) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        self.entries[str(entry["id"])] = entry

    def close(self) -> None:
        self._file.close()
