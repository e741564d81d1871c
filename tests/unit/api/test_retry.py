"""The one retry policy (``api.retry``): what is retried, how long it waits, when it gives up,
what it logs, and that a call which may have reached the server is not replayed unless it is
idempotent. A fake clock: only the ``wait_http`` test waits (its 1 s deadline)."""

from __future__ import annotations

import asyncio
import logging
import socket
import sys
from pathlib import Path

import httpx
import pytest

from api.client import ApiClient, ApiError
from api.retry import BASE_S, CAP_S, RetryPolicy, is_transient, retry_call, retry_call_async
from launch.procs import ManagedProcess

pytestmark = pytest.mark.unit
REQUEST = httpx.Request("POST", "http://api/x")


class FakeClock:
    """``clock`` and ``sleep`` for the policy: sleeping moves the clock, nothing waits."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds

    async def asleep(self, seconds: float) -> None:
        self.sleep(seconds)


def failing(exc: Exception, calls: list[int], succeed_after: int | None = None):
    def fn() -> str:
        calls.append(1)
        if succeed_after is not None and len(calls) > succeed_after:
            return "ok"
        raise exc

    return fn


def status_error(code: int) -> httpx.HTTPStatusError:
    return httpx.HTTPStatusError(str(code), request=REQUEST, response=httpx.Response(code))


def test_retryable_errors_are_retried_others_raised_at_once() -> None:
    clock, calls = FakeClock(), []
    fn = failing(httpx.ConnectError("refused"), calls, succeed_after=3)
    got = retry_call(fn, "t", is_transient, RetryPolicy(), clock=clock, sleep=clock.sleep)
    assert got == "ok" and len(calls) == 4 and len(clock.sleeps) == 3

    clock, calls = FakeClock(), []
    with pytest.raises(ValueError, match="a bug"):
        retry_call(
            failing(ValueError("a bug"), calls),
            "t",
            is_transient,
            RetryPolicy(),
            clock=clock,
            sleep=clock.sleep,
        )
    assert len(calls) == 1 and clock.sleeps == []
    with pytest.raises(httpx.HTTPStatusError):  # a 4xx is the caller's bug
        retry_call(
            failing(status_error(404), calls),
            "t",
            is_transient,
            RetryPolicy(),
            clock=clock,
            sleep=clock.sleep,
        )
    assert len(calls) == 2 and clock.sleeps == []


def test_backoff_grows_with_jitter_and_is_capped() -> None:
    clock, calls = FakeClock(), []
    with pytest.raises(httpx.ConnectError):
        retry_call(
            failing(httpx.ConnectError("refused"), calls),
            "t",
            is_transient,
            RetryPolicy(attempts=12),
            clock=clock,
            sleep=clock.sleep,
        )
    assert len(calls) == 12 and len(clock.sleeps) == 11
    for n, slept in enumerate(clock.sleeps, start=1):
        low = min(CAP_S, BASE_S * 2 ** (n - 1))
        assert low <= slept <= min(CAP_S, low + BASE_S), (n, slept)
    assert clock.sleeps[-4:] == [CAP_S] * 4  # at the cap: never longer


def test_deadline_counts_from_the_first_failure_and_is_honoured() -> None:
    clock, calls = FakeClock(), []
    policy = RetryPolicy(deadline_s=60.0)
    with pytest.raises(httpx.ConnectError):
        retry_call(
            failing(httpx.ConnectError("refused"), calls),
            "t",
            is_transient,
            policy,
            clock=clock,
            sleep=clock.sleep,
        )
    waited = sum(clock.sleeps)
    assert 60.0 <= waited <= 60.0 + CAP_S  # gives up at the first failure past the deadline
    assert sum(clock.sleeps[:-1]) < 60.0
    with pytest.raises(ValueError, match="attempts"):
        RetryPolicy(attempts=0)
    with pytest.raises(ValueError, match="base_s"):
        RetryPolicy(base_s=2.0, cap_s=1.0)


def test_attempts_or_deadline_whichever_comes_first() -> None:
    clock, calls = FakeClock(), []
    with pytest.raises(httpx.ReadTimeout):
        retry_call(
            failing(httpx.ReadTimeout("slow"), calls),
            "t",
            is_transient,
            RetryPolicy(attempts=3, deadline_s=3600.0),
            clock=clock,
            sleep=clock.sleep,
        )
    assert len(calls) == 3


def test_each_retry_is_logged_in_one_line(caplog: pytest.LogCaptureFixture) -> None:
    clock, calls = FakeClock(), []
    logger = logging.getLogger("test_retry")
    with caplog.at_level(logging.WARNING, logger="test_retry"), pytest.raises(ApiError):
        retry_call(
            failing(ApiError("down\n  for more information see the docs"), calls),
            "API GET /status",
            lambda e: True,
            RetryPolicy(attempts=3),
            logger=logger,
            clock=clock,
            sleep=clock.sleep,
        )
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert lines[0].startswith(
        "API GET /status failed (ApiError: down for more information see the docs); retry 1 in "
    )
    assert lines[1].startswith(
        "API GET /status failed (ApiError: down for more information see the docs); retry 2 in "
    )


def test_async_calls_share_the_policy() -> None:
    clock, calls = FakeClock(), []

    async def fn() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise status_error(503)
        return "ok"

    got = asyncio.run(
        retry_call_async(fn, "t", is_transient, RetryPolicy(), clock=clock, sleep=clock.asleep)
    )
    assert got == "ok" and len(clock.sleeps) == 2


def test_what_may_have_reached_the_server_is_retried_only_when_idempotent() -> None:
    maybe_delivered = [
        httpx.ReadTimeout("t"),
        httpx.RemoteProtocolError("hung up"),
        httpx.ReadError("reset"),
        httpx.WriteError("pipe"),
        status_error(500),
    ]
    never_processed = [
        httpx.ConnectError("refused"),
        httpx.ConnectTimeout("t"),
        httpx.PoolTimeout("t"),
        status_error(429),
        status_error(502),
        status_error(503),
        status_error(504),
    ]
    for e in maybe_delivered:
        assert is_transient(e) and not is_transient(e, idempotent=False), e
    for e in never_processed:
        assert is_transient(e) and is_transient(e, idempotent=False), e
    for e in [
        status_error(400),
        status_error(422),
        httpx.UnsupportedProtocol("htp://"),
        ValueError("x"),
        KeyboardInterrupt(),
    ]:
        assert not is_transient(e), e


def _client(handler) -> ApiClient:
    client = ApiClient("http://api", retries=4, backoff=0.001)
    client._http = httpx.Client(base_url="http://api", transport=httpx.MockTransport(handler))
    return client


def test_api_client_does_not_replay_a_lease_that_may_have_arrived() -> None:
    seen: list[str] = []

    def hang_up(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.path)
        raise httpx.RemoteProtocolError("Server disconnected without sending a response")

    client = _client(hang_up)
    with pytest.raises(ApiError, match="not replayed") as e:
        client.lease(max_tokens=100)
    assert e.value.status_code is None and seen == ["/batches/lease"]  # sent once
    with pytest.raises(ApiError, match="after 5 tries"):
        client.ack("b1")  # idempotent: replayed (1 + retries tries)
    assert seen[1:] == ["/batches/b1/ack"] * 5


def test_api_client_retries_a_lease_that_never_arrived_and_stops_on_4xx() -> None:
    seen: list[str] = []

    def refuse_then_answer(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.path)
        if len(seen) == 1:
            raise httpx.ConnectError("refused")
        if len(seen) == 2:
            return httpx.Response(503)
        if request.url.path == "/batches/lease":
            return httpx.Response(204)
        return httpx.Response(404, text="no such batch")

    client = _client(refuse_then_answer)
    assert client.lease(max_tokens=100) is None and len(seen) == 3
    with pytest.raises(ApiError, match="HTTP 404: no such batch") as e:
        client.ack("gone")
    assert e.value.status_code == 404 and len(seen) == 4  # not retried


def test_wait_http_gives_up_at_its_deadline_and_at_once_when_the_process_dies(
    tmp_path: Path,
) -> None:
    with socket.socket() as bound:  # bound, never listening: every connect is refused
        bound.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{bound.getsockname()[1]}/health"
        code = "import time; time.sleep(60)"
        alive = ManagedProcess("sleeper", [sys.executable, "-c", code], tmp_path / "s.log")
        try:
            with pytest.raises(TimeoutError, match="sleeper did not answer .* within 1s"):
                alive.start().wait_http(url, timeout=1.0, interval=0.2)
        finally:
            alive.stop()
        dead = ManagedProcess(
            "dead", [sys.executable, "-c", "raise SystemExit(3)"], tmp_path / "d.log"
        ).start()
        with pytest.raises(RuntimeError, match="dead exited with 3 before"):
            dead.wait_http(url, timeout=60.0, interval=0.2)
