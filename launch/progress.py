"""Live progress of ``launch/run_all.sh`` on its console, one row per phase.

    with progress.session():                     # once, around the whole run
        with progress.phase("SFT", total=450, unit="steps",
                            source=MetricsSource(sft_dir / "metrics.jsonl", FIELDS)):
            ...                                  # the phase's work (a child process)
        with progress.phase("start services", total=2, unit="up") as ph:
            ...; ph.advance()                    # or advanced by hand

A terminal gets rich's live bars (spinner, bar, done/total, the phase's numbers, elapsed
time, ETA). Anything else (CI, a pipe, a file) gets plain ``[run_all]`` lines without carriage
returns: one when a phase starts, one every ``SHOP_R1_PROGRESS_INTERVAL`` seconds (default 30)
while it runs, one when it ends. ``SHOP_R1_PROGRESS=plain`` forces the plain lines on a
terminal too.

A phase's numbers come from a *source* (launch/follow.py) polled by a background thread every
half second: it reads what the child processes write anyway (the trainer's ``metrics.jsonl``,
a log file), so the services need no progress channel of their own and their logs stay as
they are.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TextIO

from rich.console import Console
from rich.progress import (
    BarColumn,
    Progress,
    SpinnerColumn,
    Task,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Column

from launch.follow import Source

MODE_ENV = "SHOP_R1_PROGRESS"
"""``auto`` (default: live bars on a terminal, plain lines elsewhere) or ``plain``."""
INTERVAL_ENV = "SHOP_R1_PROGRESS_INTERVAL"
"""Seconds between two plain progress lines of a running phase (default 30)."""
DEFAULT_INTERVAL = 30.0
POLL_S = 0.5
PREFIX = "[run_all]"


def hms(seconds: float | None) -> str:
    """``1:02:03`` / ``2:31``; ``?`` when unknown."""
    if seconds is None:
        return "?"
    s = int(round(seconds))
    h, m = divmod(s // 60, 60)
    return f"{h}:{m:02d}:{s % 60:02d}" if h else f"{m}:{s % 60:02d}"


class Phase:
    """One row of the board: a title, done/total, the source's info, elapsed time, ETA."""

    def __init__(
        self, board: Board, title: str, total: float | None, unit: str, source: Source | None
    ) -> None:
        self.board, self.title, self.unit, self.source = board, title, unit, source
        self.info = ""
        # Has the phase numbers (a total, or something done)? One without (a build step)
        # shows only its info and time.
        self.counted = total is not None
        self.task: TaskID = board.progress.add_task(title, total=total, count="", info="")
        self.started = time.monotonic()
        self.last_line = self.started

    @property
    def _task(self) -> Task:
        return next(t for t in self.board.progress.tasks if t.id == self.task)

    def count(self) -> str:
        """``12/120 steps`` (or ``12 steps`` without a total; empty before anything is done)."""
        t = self._task
        if not self.counted:
            return ""
        if t.total is None:
            return f"{t.completed:g} {self.unit}".strip() if t.completed else ""
        return f"{t.completed:g}/{t.total:g} {self.unit}".strip()

    def update(
        self,
        completed: float | None = None,
        total: float | None = None,
        info: str | None = None,
        advance: float | None = None,
    ) -> None:
        """Set what is known (None: unchanged)."""
        if info is not None:
            self.info = info
        if completed is not None or total is not None or advance:
            self.counted = True
        p = self.board.progress
        p.update(self.task, completed=completed, total=total, advance=advance)
        p.update(self.task, count=self.count(), info=self.info)

    def advance(self, n: float = 1, info: str | None = None) -> None:
        self.update(advance=n, info=info)

    def poll(self) -> None:
        if self.source is None:
            return
        try:
            r = self.source()
        except Exception as e:  # noqa: BLE001 - the progress display must never stop the run
            self.update(info=f"(progress unreadable: {type(e).__name__})")
            return
        self.unit = self.unit or r.unit
        self.update(completed=r.completed, total=r.total, info=r.info)

    def line(self, state: str = "") -> str:
        """The plain-text row: title, count and percentage, info, elapsed, ETA."""
        t = self._task
        parts = [f"{PREFIX} {self.title}" + (f" {state}" if state else "")]
        count = self.count()
        if count:
            pct = f" ({t.completed / t.total:.0%})" if t.total else ""
            parts.append(count + pct)
        if self.info:
            parts.append(self.info)
        if state != "started":
            timing = f"{hms(time.monotonic() - self.started)} elapsed"
            if not state and t.total and t.completed and t.time_remaining is not None:
                timing += f", ETA {hms(t.time_remaining)}"
            parts.append(timing)
        return " | ".join(parts)

    def start(self) -> Phase:
        """Show the phase (``with phase(...)`` does this and :meth:`finish`)."""
        self.board._start(self)
        return self

    def finish(self, failed: bool = False) -> None:
        """Mark the phase done (or stopped); a phase still running when the session ends is
        finished as stopped."""
        self.poll()
        self.board._end(self, failed)

    def __enter__(self) -> Phase:
        return self.start()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.finish(failed=exc_type is not None)


class Board:
    """The console's phases: rich live bars on a terminal, plain periodic lines elsewhere."""

    def __init__(
        self,
        live: bool | None = None,
        interval: float | None = None,
        out: TextIO | None = None,
        quiet: bool = False,
    ) -> None:
        self.out = out or sys.stdout
        self.quiet = quiet
        self.live = (not quiet) and (want_live() if live is None else live)
        if interval is None:  # the quiet board of import time reads no setting
            interval = DEFAULT_INTERVAL if quiet else plain_interval()
        self.interval = interval
        console = Console(file=self.out, force_terminal=True if self.live else None)
        fixed = Column(no_wrap=True)
        self.progress = Progress(
            SpinnerColumn(finished_text="[green]✓"),
            TextColumn("[bold]{task.description}", table_column=fixed),
            BarColumn(bar_width=16),
            TextColumn("{task.fields[count]}", table_column=Column(no_wrap=True, min_width=9)),
            # the rest of the line; a long log line is cut with "..." rather than wrapped
            TextColumn(
                "{task.fields[info]}",
                style="cyan",
                table_column=Column(ratio=1, no_wrap=True, overflow="ellipsis"),
            ),
            TimeElapsedColumn(table_column=fixed),
            TextColumn("ETA", table_column=fixed),
            TimeRemainingColumn(compact=True, table_column=fixed),
            console=console,
            expand=True,
            disable=not self.live,
            speed_estimate_period=600.0,  # steps of 10-30 s: average over several minutes
            refresh_per_second=4,
        )
        self.active: list[Phase] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def phase(
        self, title: str, total: float | None = None, unit: str = "", source: Source | None = None
    ) -> Phase:
        return Phase(self, title, total, unit, source)

    def print(self, line: str) -> None:
        if not self.quiet:
            print(line, file=self.out, flush=True)

    # A phase's lines are printed under the lock, and only while it is active: its periodic
    # line can never follow its "done" line (the poller reads its source outside the lock).

    def _start(self, ph: Phase) -> None:
        with self._lock:
            self.active.append(ph)
            if not self.live:
                self.print(ph.line("started"))

    def _end(self, ph: Phase, failed: bool) -> None:
        with self._lock:
            if ph not in self.active:
                return  # finished already
            self.active.remove(ph)
            t = ph._task
            if not failed and t.total is None:  # a phase without numbers: a full bar when done
                full = max(t.completed, 1)
                self.progress.update(ph.task, total=full, completed=full)
            if failed and self.live:  # a plain line says "stopped" itself
                ph.update(info=(ph.info + " " if ph.info else "") + "(stopped)")
            self.progress.stop_task(ph.task)
            if not self.live:
                self.print(ph.line("stopped" if failed else "done"))

    def _poll_loop(self) -> None:
        while not self._stop.wait(POLL_S):
            with self._lock:
                phases = list(self.active)
            for ph in phases:
                ph.poll()
                with self._lock:
                    due = time.monotonic() - ph.last_line >= self.interval
                    if ph in self.active and not self.live and due:
                        ph.last_line = time.monotonic()
                        self.print(ph.line())

    def __enter__(self) -> Board:
        self.progress.start()
        self._thread = threading.Thread(target=self._poll_loop, name="progress", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        for ph in list(self.active):  # started by hand and never finished: the run stopped
            ph.finish(failed=True)
        self.progress.stop()


def want_live() -> bool:
    """Live bars only on a real terminal (rich's test: not a pipe, not ``TERM=dumb``) and
    unless ``SHOP_R1_PROGRESS=plain``."""
    mode = os.environ.get(MODE_ENV, "auto").strip().lower()
    if mode not in ("auto", "plain"):
        raise SystemExit(f"error: {MODE_ENV} must be auto or plain, not {mode!r}")
    console = Console()
    return mode == "auto" and console.is_terminal and not console.is_dumb_terminal


def plain_interval() -> float:
    raw = os.environ.get(INTERVAL_ENV)
    try:
        value = float(raw) if raw else DEFAULT_INTERVAL
    except ValueError:
        value = -1.0
    if value <= 0:
        raise SystemExit(f"error: {INTERVAL_ENV} must be a number of seconds > 0, not {raw!r}")
    return value


_current: Board | None = None
_quiet = Board(quiet=True)  # phases outside a session (a test calling run_step): no output


@contextmanager
def session(**kwargs: Any) -> Iterator[Board]:
    """The board of this run; :func:`phase` adds to it."""
    global _current
    with Board(**kwargs) as board:
        _current = board
        try:
            yield board
        finally:
            _current = None


def phase(
    title: str, total: float | None = None, unit: str = "", source: Source | None = None
) -> Phase:
    """A phase on the current session's board (silent outside a session)."""
    return (_current or _quiet).phase(title, total, unit, source)
