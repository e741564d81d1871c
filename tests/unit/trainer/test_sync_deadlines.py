"""The deadlines of a weight sync's phases (trainer/bridge/deadline.py), without vLLM.

A socket that listens but never accepts is what a SIGSTOPped server looks like to a client:
the kernel completes the TCP handshake and queues the request, and no answer ever comes.
Against it: each phase raises ``SyncTimeout`` naming the phase, the server and the deadline;
the abandoned call ends by itself (its request timed out with the same deadline); the
trainer's sync does not retry it; the config's flags reach the bridge.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest

from trainer.bridge.deadline import SyncTimeout, bounded
from trainer.bridge.http import ServerClient
from trainer.config import GrpoConfig
from trainer.weights_config import SyncDeadlines

pytestmark = pytest.mark.unit


@pytest.fixture
def frozen_url() -> Iterator[str]:
    """The URL of a server that accepts connections (the kernel's backlog) and never answers."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        sock.close()


def test_a_frozen_server_times_the_phase_out_naming_phase_server_and_deadline(
    frozen_url: str,
) -> None:
    client = ServerClient(frozen_url, timeout=600)
    try:
        with pytest.raises(SyncTimeout) as err:
            bounded("apply", [(frozen_url, lambda: client.post("/bridge/apply", json={}))], 0.5)
        e = err.value
        assert (e.phase, e.server, e.deadline_s) == ("apply", frozen_url, 0.5)
        assert str(e).startswith(
            f"weight sync to {frozen_url} timed out in phase 'apply' after 0.5 s"
        )
        assert "--sync-deadline.apply" in str(e)
    finally:
        client.close()


def test_the_abandoned_request_ends_with_the_phase_deadline(frozen_url: str) -> None:
    """Inside a phase the request's own timeout is the phase's deadline (not the client's 600
    s): the abandoned thread ends by itself, with an httpx timeout."""
    import httpx

    client = ServerClient(frozen_url, timeout=600)
    ended = threading.Event()
    seen: list[BaseException] = []

    def call() -> None:
        try:
            client.health()
        except BaseException as e:  # noqa: BLE001
            seen.append(e)
            ended.set()
            raise

    try:
        with pytest.raises(SyncTimeout):
            bounded("check", [(frozen_url, call)], 0.5)
        assert ended.wait(120), "the abandoned request did not end"
        assert isinstance(seen[0], httpx.TimeoutException)
    finally:
        client.close()


def test_an_error_is_raised_as_is_and_the_first_late_server_is_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import concurrent.futures

    import trainer.bridge.deadline as deadline

    with pytest.raises(ValueError, match="bad"):
        bounded("stage", [("a", lambda: (_ for _ in ()).throw(ValueError("bad")))], 30)

    def a_done_first(fs, timeout):  # "a" answered before the deadline ran: not by chance
        fs[0].result(60)
        return concurrent.futures.wait(fs, timeout=timeout)

    monkeypatch.setattr(deadline, "wait", a_done_first)
    gate = threading.Event()
    try:
        with pytest.raises(SyncTimeout, match="weight sync to b timed out in phase 'stage'"):
            bounded("stage", [("a", lambda: 1), ("b", gate.wait)], 0.2)
    finally:
        gate.set()
    assert bounded("stage", [("a", lambda: 1), ("b", lambda: 2)], 30) == [1, 2]


def test_a_sync_timeout_is_not_retried_by_the_trainer() -> None:
    """``WeightSync`` retries a sync while a server is down or restarted; a server that hangs
    is neither: the first ``SyncTimeout`` stops the trainer."""
    from trainer.weight_sync import WeightSync

    ws = WeightSync.__new__(WeightSync)
    ws.runs = None  # never asked: the type decides
    assert ws._restarted(["r"], SyncTimeout("apply", "http://x", 1.0)) is False


def test_the_deadlines_are_typed_config_fields_that_reach_the_bridge() -> None:
    from trainer.config import config_from_args
    from trainer.weight_sync import bridge_kwargs

    cfg = GrpoConfig.model_validate({"sync_deadline": {"apply": 7, "connect": 9}})
    assert cfg.sync_deadline == SyncDeadlines(apply=7, connect=9)
    assert bridge_kwargs(cfg, "cpu")["deadlines"] is cfg.sync_deadline
    assert SyncDeadlines().model_dump() == {
        "check": 30.0,
        "connect": 120.0,
        "stage": 60.0,
        "transfer": 300.0,
        "apply": 300.0,
        "close": 30.0,
    }
    with pytest.raises(ValueError):
        SyncDeadlines(apply=0)
    with pytest.raises(ValueError):
        SyncDeadlines(nope=1)  # type: ignore[call-arg]
    import argparse

    from trainer.config import build_parser

    parser = argparse.ArgumentParser()
    build_parser(GrpoConfig, parser)
    ns = parser.parse_args(["--sync-deadline.apply", "5", "--sync-deadline.close", "2"])
    parsed = config_from_args(GrpoConfig, ns)
    assert (parsed.sync_deadline.apply, parsed.sync_deadline.close) == (5.0, 2.0)
