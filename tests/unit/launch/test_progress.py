"""The console progress of launch/run_all.sh (launch/progress.py, launch/follow.py): sources
follow the files real writers produce (the trainer's MetricsLogger, the evaluation's log
line), a non-terminal gets plain periodic lines without carriage returns, a terminal gets
rich's live bars."""

from __future__ import annotations

import io
import json
import logging
import time
from pathlib import Path

import pytest

from env_server.evaluate import PROGRESS_LINE, log_progress
from launch import progress
from launch.follow import (
    EVAL_ROWS,
    LogSource,
    MetricsSource,
    TextFollower,
    clean_line,
    eval_source,
    grpo_source,
    sft_source,
)
from launch.progress import Board, hms
from trainer.metrics import MetricsLogger

pytestmark = pytest.mark.unit


def test_text_follower_keeps_partial_lines_and_splits_carriage_returns(tmp_path: Path) -> None:
    path = tmp_path / "x.log"
    f = TextFollower(path)
    assert f.new_lines() == []  # not there yet
    path.write_bytes(b"one\ntw")
    assert f.new_lines() == ["one"]
    with path.open("ab") as out:
        out.write(b"o\rsft:  50%|###\r\n")
    assert f.new_lines() == ["two", "sft:  50%|###"]
    path.write_bytes(b"new\n")  # replaced by a shorter file: read from the start again
    assert f.new_lines() == ["new"]


def test_metrics_source_follows_the_trainers_metrics_logger(tmp_path: Path) -> None:
    save = tmp_path / "trainer"
    old = MetricsLogger(save / "metrics.jsonl")
    old.log(1, {"loss": 9.0})  # an earlier (resumed) run's rows do not count
    old.close()
    source = sft_source(save, None)
    assert source().completed is None and source().info == "loading the model and the dataset"
    (save / "trainer_config.json").write_text(json.dumps({"training_steps": 450}))
    metrics = MetricsLogger(save / "metrics.jsonl")
    metrics.log(2, {"loss": 1.23456, "grad_norm": 0.5})
    metrics.log(3, {"loss": 1.0, "val_loss": 2.5})
    metrics.close()
    r = source()
    assert (r.completed, r.total) == (3, 450) and r.info == "loss 1.000  val 2.500"


def test_grpo_source_shows_reward_format_and_sync(tmp_path: Path) -> None:
    source = grpo_source(tmp_path, 120)
    assert source().info == "waiting for the first scored batch"
    metrics = MetricsLogger(tmp_path / "metrics.jsonl")
    metrics.log(1, {"score_mean": 45.678, "format_rate": 0.96875, "sync_s": 0.1834})
    metrics.close()
    r = source()
    assert (r.completed, r.total) == (1, 120)
    assert r.info == "reward 45.68  format 97%  sync 0.18s"


def test_eval_source_reads_the_evaluations_progress_line(tmp_path: Path) -> None:
    """The line env_server.evaluate logs is the one the launcher's pattern reads."""
    assert EVAL_ROWS.search(PROGRESS_LINE % (12, 512)).groups() == ("12", "512")
    log = tmp_path / "eval_sft.log"
    handler = logging.FileHandler(log)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(message)s"))
    logger = logging.getLogger("env_server.evaluate")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    source = eval_source(log)
    try:
        for done in range(1, 101):
            log_progress(done, 100)
    finally:
        logger.removeHandler(handler)
        handler.close()
    r = source()
    assert (r.completed, r.total, r.info) == (100, 100, "")
    assert 10 < len(log.read_text().splitlines()) <= 52  # ~every 2%, not every row


def test_log_source_shows_the_latest_readable_line(tmp_path: Path) -> None:
    log = tmp_path / "vllm.log"
    log.write_text(
        "(APIServer pid=42) INFO 11-25 19:30:01 [loader.py:12] Loading weights took 0.5 s\n}\n"
    )
    assert LogSource(log)().info == "Loading weights took 0.5 s"
    assert clean_line("2026-11-25 19:30:01,123 INFO trainer: step 3") == "trainer: step 3"
    assert clean_line("\x1b[32mgreen\x1b[0m " + "x" * 100, width=20) == "green " + "x" * 11 + "..."


def test_hms() -> None:
    assert (hms(5), hms(151), hms(3723), hms(None)) == ("0:05", "2:31", "1:02:03", "?")


def test_plain_lines_when_not_a_terminal(tmp_path: Path) -> None:
    """Start, periodic and end lines with count, numbers, elapsed and ETA; no \\r."""
    out = io.StringIO()
    metrics = MetricsLogger(tmp_path / "metrics.jsonl")
    with Board(live=False, interval=0.2, out=out) as board:
        with board.phase("GRPO", 4, "steps", grpo_source(tmp_path, 4)):
            for step in range(1, 5):
                metrics.log(step, {"score_mean": float(step), "format_rate": 1.0, "sync_s": 0.1})
                # the poller reads it and a periodic line shows it (waited for, not slept on)
                deadline = time.monotonic() + 60
                while f"[run_all] GRPO | {step}/4 steps" not in out.getvalue():
                    assert time.monotonic() < deadline, out.getvalue()
                    time.sleep(0.05)
        with board.phase("build the dataset"):
            pass
    metrics.close()
    text = out.getvalue()
    assert "\r" not in text and "\x1b" not in text
    lines = text.splitlines()
    assert lines[0] == "[run_all] GRPO started | 0/4 steps (0%)"
    running = [x for x in lines if x.startswith("[run_all] GRPO | ")]
    assert any("ETA" in x and "reward" in x for x in running), lines
    assert lines[-3].startswith("[run_all] GRPO done | 4/4 steps (100%) | reward 4.00")
    assert lines[-2] == "[run_all] build the dataset started"
    assert lines[-1].startswith("[run_all] build the dataset done | 0:0")  # no 1/1 count


def test_live_bars_on_a_terminal() -> None:
    from rich.console import Console

    board = Board(live=True, out=io.StringIO())
    board.progress.live.console = Console(file=board.out, force_terminal=True, width=140)
    with board:
        with board.phase("evaluate SFT", unit="rows") as ph:
            ph.update(completed=256, total=512)
            time.sleep(0.6)
    text = board.out.getvalue()
    assert "evaluate SFT" in text and "256/512 rows" in text and "\x1b[" in text


def test_session_phases_and_a_phase_left_open(capsys: pytest.CaptureFixture[str]) -> None:
    with progress.phase("outside a session") as ph:  # silent: no board
        ph.advance()
    assert capsys.readouterr().out == ""
    with progress.session(live=False, interval=60) as board:
        progress.phase("start the API and vLLM", 2, "up").start().advance()
        assert board.active
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1].startswith("[run_all] start the API and vLLM stopped | 1/2 up (50%)")


def test_bad_settings_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(progress.INTERVAL_ENV, "soon")
    with pytest.raises(SystemExit, match="SHOP_R1_PROGRESS_INTERVAL"):
        progress.plain_interval()
    monkeypatch.setenv(progress.MODE_ENV, "fancy")
    with pytest.raises(SystemExit, match="auto or plain"):
        progress.want_live()
    monkeypatch.setenv(progress.MODE_ENV, "plain")
    assert progress.want_live() is False


def test_a_broken_source_does_not_stop_the_run() -> None:
    out = io.StringIO()

    def broken() -> None:
        raise OSError("disk gone")

    with Board(live=False, interval=60, out=out) as board:
        with board.phase("SFT", 3, "steps", broken):  # type: ignore[arg-type]
            time.sleep(0.6)
    assert "(progress unreadable: OSError)" in out.getvalue()
    assert MetricsSource  # the sources are plain callables: any function works as one
