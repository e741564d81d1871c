"""What ``launch/run_all.sh``'s console progress (launch/progress.py) reads: the files the
child processes write anyway, followed as they grow.

A *source* is a callable returning a :class:`Reading` (done, total, a short info text):
:class:`MetricsSource` follows a trainer's ``metrics.jsonl``, :class:`LogSource` a log file
(the latest line, and done/total from a pattern such as ``env_server.evaluate``'s
``rows done 12/512``).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class Reading:
    """What a source saw: steps or rows done (None: nothing yet), their total (None: unknown)
    and a short text of the phase's numbers (``loss 1.234``) or latest log line."""

    completed: float | None = None
    total: float | None = None
    info: str = ""
    unit: str = ""
    """What is counted (``steps``, ``rows``), unless the phase names it."""


Source = Callable[[], Reading]


class TextFollower:
    """The complete lines appended to a file since the last call; the file may appear later,
    and a line still being written is kept for the next call. ``\\r`` ends a line too (a
    tqdm bar in a log)."""

    def __init__(self, path: Path, from_end: bool = False) -> None:
        self.path = path
        self.offset = path.stat().st_size if from_end and path.exists() else 0
        self.partial = b""

    def new_lines(self) -> list[str]:
        try:
            with self.path.open("rb") as f:
                if os.fstat(f.fileno()).st_size < self.offset:  # replaced or truncated
                    self.offset, self.partial = 0, b""
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        data = self.partial + data
        cut = max(data.rfind(b"\n"), data.rfind(b"\r")) + 1
        self.partial = data[cut:]
        text = data[:cut].decode("utf-8", errors="replace")
        return [line for line in re.split(r"[\r\n]", text) if line.strip()]


class MetricsSource:
    """A trainer's ``metrics.jsonl`` (one JSON row per step): done = the latest row's
    ``step``; info = ``fields`` of the latest rows that had them.

    ``fields`` are ``(key, label, format)``, e.g. ``("loss", "loss", "{:.3f}")``. The total is
    ``total``, else ``total_key`` of the JSON file ``total_from`` once it exists (the trainer's
    ``trainer_config.json``). Only rows written after the source was made count (a resumed run
    appends to an older file).
    """

    def __init__(
        self,
        path: Path,
        fields: Sequence[tuple[str, str, str]],
        total: float | None = None,
        total_from: Path | None = None,
        total_key: str = "training_steps",
        waiting: str = "",
        unit: str = "steps",
    ) -> None:
        self.follower = TextFollower(path, from_end=True)
        self.fields, self.total = list(fields), total
        self.total_from, self.total_key, self.waiting = total_from, total_key, waiting
        self.unit = unit
        self.step: float | None = None
        self.latest: dict[str, Any] = {}

    def _total(self) -> float | None:
        if self.total is None and self.total_from is not None:
            try:
                self.total = float(json.loads(self.total_from.read_text())[self.total_key])
            except (OSError, ValueError, KeyError, TypeError):
                return None  # not written yet (or mid-write): ask again next time
        return self.total

    def __call__(self) -> Reading:
        for line in self.follower.new_lines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if not isinstance(row, dict) or not isinstance(row.get("step"), int | float):
                continue
            self.step = row["step"]
            self.latest.update({k: row[k] for k, _, _ in self.fields if row.get(k) is not None})
        shown = [
            f"{label} {fmt.format(self.latest[k])}"
            for k, label, fmt in self.fields
            if k in self.latest
        ]
        return Reading(self.step, self._total(), "  ".join(shown) or self.waiting, self.unit)


_NOISE = [
    re.compile(r"\x1b\[[0-9;?]*[A-Za-z]"),  # terminal colours
    re.compile(r"^\(\w+ pid=\d+\)\s*"),  # vLLM's "(APIServer pid=1)"
    re.compile(r"^\d{4}-\d\d-\d\d[ T][\d:,.]+\s*"),  # logging's asctime
    re.compile(r"^(DEBUG|INFO|WARNING|ERROR)\s+(\d\d-\d\d [\d:.]+\s+)?(\[[^\]]*\]\s*)?"),
]


def clean_line(line: str, width: int = 72) -> str:
    """A log line without colours, timestamps and level prefixes, at most ``width`` chars."""
    for pattern in _NOISE:
        line = pattern.sub("", line.strip())
    line = " ".join(line.split())
    return line if len(line) <= width else line[: width - 3] + "..."


class LogSource:
    """A log file: with ``pattern`` (two groups: done, total), done/total from its latest
    match; info = the latest other line (cleaned), so a phase without numbers still shows
    what it is doing."""

    def __init__(self, path: Path, pattern: re.Pattern[str] | None = None, unit: str = "") -> None:
        self.follower = TextFollower(path)
        self.pattern, self.unit = pattern, unit
        self.done: float | None = None
        self.total: float | None = None
        self.last = ""

    def __call__(self) -> Reading:
        for line in self.follower.new_lines():
            m = self.pattern.search(line) if self.pattern is not None else None
            if m is not None:
                self.done, self.total = float(m.group(1)), float(m.group(2))
            elif re.search(r"[A-Za-z0-9]", line):  # not a lone "}" of a printed JSON
                self.last = clean_line(line)
        info = "" if self.done is not None else self.last
        return Reading(self.done, self.total, info, self.unit)


EVAL_ROWS = re.compile(r"rows done (\d+)/(\d+)")
"""``env_server.evaluate.PROGRESS_LINE`` as logged (tests/unit/launch/test_progress.py ties them)."""
SFT_FIELDS = [("loss", "loss", "{:.3f}"), ("val_loss", "val", "{:.3f}")]
GRPO_FIELDS = [
    ("score_mean", "reward", "{:.2f}"),
    ("format_rate", "format", "{:.0%}"),
    ("sync_s", "sync", "{:.2f}s"),
]
"""What the console shows of a trainer step (keys of ``trainer/metrics.jsonl``)."""


def sft_source(save_path: Path, steps: int | None) -> MetricsSource:
    """``python -m trainer sft --save-path save_path``: its steps and loss; the total is
    ``steps``, else what the trainer wrote to ``trainer_config.json``."""
    return MetricsSource(
        save_path / "metrics.jsonl",
        SFT_FIELDS,
        total=steps,
        total_from=save_path / "trainer_config.json",
        waiting="loading the model and the dataset",
    )


def grpo_source(save_path: Path, steps: int) -> MetricsSource:
    """``python -m trainer grpo``: its steps, batch reward, format rate and sync time."""
    return MetricsSource(
        save_path / "metrics.jsonl",
        GRPO_FIELDS,
        total=steps,
        waiting="waiting for the first scored batch",
    )


def eval_source(log: Path) -> LogSource:
    """``python -m env_server.evaluate``: rows done / total from its log."""
    return LogSource(log, EVAL_ROWS, unit="rows")
