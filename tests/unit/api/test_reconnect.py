"""Bounded reconnects: the API client and the retry policy (``api.retry``) keep retrying a
server that is down for ``give_up_s`` seconds (logging every retry), carry on when it comes
back, and give up after that. Real sockets on loopback; the whole-stack behaviour is in
tests/integration/launch/test_fault_tolerance.py."""

from __future__ import annotations

import asyncio
import http.server
import logging
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

from api.client import ApiClient, ApiError
from api.retry import RetryPolicy, is_transient, retry_call_async
from settings.ports import free_port

pytestmark = pytest.mark.unit


def _reply(handler: http.server.BaseHTTPRequestHandler, code: int, body: bytes = b"{}") -> None:
    handler.send_response(code)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        _reply(self, 200, b'{"status": "ok"}')

    def log_message(self, *args: object) -> None:
        pass


def test_api_client_gives_up_after_give_up_s(caplog: pytest.LogCaptureFixture) -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    client = ApiClient(url, retries=1, backoff=0.05, give_up_s=1.0, connect_timeout=0.5)
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="api.client"), pytest.raises(ApiError) as e:
        client.health()
    assert e.value.status_code is None and "ConnectError" in str(e.value)
    assert time.monotonic() - t0 >= 1.0
    retries = [r for r in caplog.records if "retry" in r.getMessage()]
    # it kept trying until give_up_s (the elapsed time above; `retries` alone allows one
    # retry, ~0.1 s), each retry logged; and no more than the shortest backoffs fit in
    # give_up_s (0.05, 0.1, 0.2, 0.4, 0.8 s at least: a sixth would start past 1.55 s), so it
    # gave up by the deadline. Counts, not wall-clock bounds: a stalled box only lowers them.
    assert 1 <= len(retries) <= 5, [r.getMessage() for r in retries]
    caplog.clear()
    quick = ApiClient(url, retries=1, backoff=0.05, connect_timeout=0.5)  # default: count only
    with caplog.at_level(logging.WARNING, logger="api.client"), pytest.raises(ApiError):
        quick.health()
    retries = [r for r in caplog.records if "retry" in r.getMessage()]
    assert len(retries) == 1  # no give-up window: two tries (`retries` + 1), then the error


def test_api_client_rides_out_a_server_that_comes_back() -> None:
    port = free_port()
    servers: list[http.server.ThreadingHTTPServer] = []

    def come_back() -> None:  # nothing listens for a second, then the "restarted" server
        time.sleep(1.0)
        servers.append(http.server.ThreadingHTTPServer(("127.0.0.1", port), _Health))
        servers[0].serve_forever()

    thread = threading.Thread(target=come_back, daemon=True)
    thread.start()
    try:
        client = ApiClient(f"http://127.0.0.1:{port}", retries=0, backoff=0.1, give_up_s=20.0)
        assert client.health()
    finally:
        while thread.is_alive() and not servers:
            time.sleep(0.05)
        for s in servers:
            s.shutdown()
            s.server_close()


def test_env_retry_helper_is_bounded_and_skips_permanent_errors() -> None:
    calls = 0

    async def down() -> None:
        nonlocal calls
        calls += 1
        raise httpx.ConnectError("connection refused")

    t0 = time.monotonic()
    with pytest.raises(httpx.ConnectError):
        policy = RetryPolicy(deadline_s=0.5, base_s=0.05, cap_s=0.1)
        asyncio.run(retry_call_async(down, "down", is_transient, policy))
    # the deadline bounds the tries: the backoffs are at least 0.05, 0.1, 0.1, ... s, so a
    # seventh try starts past 0.55 s
    assert time.monotonic() - t0 >= 0.5 and 2 <= calls <= 7, calls

    async def bad() -> None:
        nonlocal calls
        calls += 1
        raise ValueError("a bug, not an outage")

    calls = 0
    with pytest.raises(ValueError):
        asyncio.run(retry_call_async(bad, "bad", is_transient, RetryPolicy(deadline_s=30.0)))
    assert calls == 1


def test_rendezvous_fails_fast_when_a_server_refuses_its_init() -> None:
    """A server whose init call errors never joins the transfer group: the trainer raises
    that error at once instead of waiting out gloo's rendezvous timeout."""
    from concurrent.futures import ThreadPoolExecutor

    from trainer.bridge.gloo_broadcast import _join_unless_refused

    never = threading.Event()
    joined = threading.Event()

    def join() -> None:  # a rendezvous that never completes while the test holds it
        never.wait(600)
        joined.set()

    with ThreadPoolExecutor(2) as pool:
        ok = pool.submit(lambda: "joined")
        refused = pool.submit(lambda: (_ for _ in ()).throw(RuntimeError("init refused")))
        with pytest.raises(RuntimeError, match="init refused"):
            _join_unless_refused(join, [ok, refused], ["a", "b"], 60)
        assert not joined.is_set()  # raised while the join still blocked, not after it
        never.set()  # release the abandoned join thread

        one = (["a"], 60)
        assert _join_unless_refused(lambda: ("local", "group"), [ok], *one) == ("local", "group")
        with pytest.raises(TimeoutError, match="gloo"):  # the join's own error is raised
            _join_unless_refused(lambda: (_ for _ in ()).throw(TimeoutError("gloo")), [ok], *one)


class _HangUp(http.server.BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        self.close_connection = True  # read the request, answer nothing: a server killed mid-call

    def log_message(self, *_args: object) -> None:
        pass


def test_a_lease_cut_off_mid_request_is_an_api_error_not_replayed() -> None:
    """The API dying during a lease: the trainer gets ApiError (status None, which it waits
    out), not a raw httpx error that would kill it; the lease is not sent twice."""
    port = free_port()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), _HangUp)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        client = ApiClient(f"http://127.0.0.1:{port}", retries=3, backoff=0.01)
        with pytest.raises(ApiError, match="not replayed") as e:
            client.lease(max_tokens=100, max_sequences=4, lease_seconds=10)
        assert e.value.status_code is None and e.value.transient  # the trainer waits it out
    finally:
        server.shutdown()


class _HangUpOnce(http.server.BaseHTTPRequestHandler):
    """Lease 1 is cut off (the API died mid-call), lease 2 gets a batch, later ones are
    refused (400: a request the API will never accept)."""

    posts: list[str] = []

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        type(self).posts.append(self.path)
        if len(type(self).posts) == 1:
            self.close_connection = True
            return
        if len(type(self).posts) > 2:
            _reply(self, 400)
            return
        lease = b'{"batch_id": "b1", "groups": [], "lease_deadline": 0, "policy_version": 0}'
        _reply(self, 200, lease)

    def log_message(self, *_args: object) -> None:
        pass


def _lease_cfg(url: str, wait_timeout: float) -> SimpleNamespace:
    return SimpleNamespace(
        api_url=url,
        max_batch_tokens=100,
        batch_size=4,
        lease_seconds=10.0,
        wait_timeout=wait_timeout,
        poll_interval=0.1,
    )


def test_the_trainers_lease_rides_out_a_cut_off_lease(caplog: pytest.LogCaptureFixture) -> None:
    """``trainer.leasing.lease`` waits out a transient lease failure under ``api.retry`` (the
    retry logged as "lease failed"), and raises a refused request at once."""
    from trainer.leasing import lease

    _HangUpOnce.posts = []
    port = free_port()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), _HangUpOnce)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{port}"
    try:
        client = ApiClient(url, retries=3, backoff=0.01)
        with caplog.at_level(logging.WARNING, logger="trainer.leasing"):
            batch_id, groups = lease(client, _lease_cfg(url, 30.0), None, 0)
        assert (batch_id, groups) == ("b1", []) and len(_HangUpOnce.posts) == 2
        assert any("lease failed" in r.getMessage() for r in caplog.records)
        with pytest.raises(ApiError) as e:
            lease(client, _lease_cfg(url, 30.0), None, 0)
        assert e.value.status_code == 400 and not e.value.transient
        assert len(_HangUpOnce.posts) == 3, "a refused request is not retried"
    finally:
        server.shutdown()
        server.server_close()


def test_the_trainers_lease_gives_up_after_wait_timeout(caplog: pytest.LogCaptureFixture) -> None:
    from trainer.leasing import lease

    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    client = ApiClient(url, retries=0, backoff=0.05, connect_timeout=0.5)
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="trainer.leasing"), pytest.raises(ApiError) as e:
        lease(client, _lease_cfg(url, 1.0), None, 0)
    assert e.value.transient and time.monotonic() - t0 >= 1.0
    # it gave up at the deadline: api.retry's backoffs are at least 0.5 and 1.0 s, so a third
    # retry would start past 1.5 s (a bound in tries, not in a loaded box's wall time)
    retries = [r.getMessage() for r in caplog.records if "lease failed" in r.getMessage()]
    assert len(retries) <= 2, retries


class _BusyOnce(http.server.BaseHTTPRequestHandler):
    """``/busy``: 503 once, then 200; ``/broken``: always 500."""

    posts: list[str] = []

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        type(self).posts.append(self.path)
        busy = self.path == "/busy" and type(self).posts.count("/busy") == 1
        _reply(self, 500 if self.path == "/broken" else 503 if busy else 200)

    def log_message(self, *_args: object) -> None:
        pass


def test_bridge_client_retries_by_the_one_transient_rule() -> None:
    """``ServerClient`` (trainer/bridge/http.py) retries under ``api.retry``: a 503 (not
    processed) is sent again; a 500 on a non-idempotent weight route is not."""
    from trainer.bridge.http import BridgeHTTPError, ServerClient

    _BusyOnce.posts = []
    port = free_port()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), _BusyOnce)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    client = ServerClient(f"http://127.0.0.1:{port}", timeout=10.0)
    try:
        assert client.post("/busy").json() == {}
        assert _BusyOnce.posts == ["/busy", "/busy"]
        with pytest.raises(BridgeHTTPError) as e:
            client.post("/broken")
        assert e.value.status == 500 and is_transient(e.value)  # idempotent calls would retry
        assert not is_transient(e.value, idempotent=False)
        assert _BusyOnce.posts.count("/broken") == 1
    finally:
        client.close()
        server.shutdown()
        server.server_close()
