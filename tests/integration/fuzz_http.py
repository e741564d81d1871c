"""Fuzzing a running HTTP server (tests/integration/**/test_fuzz_{api,bridge}_server.py):
schemathesis over its OpenAPI operations, hypothesis over hand-written strategies, malformed
bodies on every route, and a tally of the replies per route and status class.

Deterministic: hypothesis runs derandomized (its examples are a function of the strategy
alone), with no example database, and never shrinks (a 5xx is recorded, not raised, so a
run sends exactly the examples it generated); the malformed bodies are fixed.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import APIOperation, GenerationMode

from tests.route_table import concrete

CLASSES = ("2xx", "3xx", "4xx", "5xx")
TIMEOUT_S = 60.0
"""Longest wait for any one reply: a request that gets none is a hang, and fails the test."""
SETTINGS = {
    "deadline": None,
    "derandomize": True,
    "database": None,
    "phases": [Phase.explicit, Phase.generate],
    "suppress_health_check": list(HealthCheck),
}


@dataclass
class Tally:
    """Requests sent to one server: counts per (route, status class), and each 5xx."""

    server: str
    counts: Counter[tuple[str, str]] = field(default_factory=Counter)
    server_errors: list[str] = field(default_factory=list)

    def record(self, route: str, status: int, what: Callable[[], str]) -> None:
        self.counts[(route, f"{status // 100}xx")] += 1
        if status >= 500:
            self.server_errors.append(f"{route} -> {status}: {what()}")

    def by_class(self) -> Counter[str]:
        out: Counter[str] = Counter()
        for (_, cls), n in self.counts.items():
            out[cls] += n
        return out

    def report(self) -> str:
        """One line per route (its requests by status class), then the totals."""
        routes = sorted({r for r, _ in self.counts})
        width = max((len(r) for r in routes), default=10)
        head = f"{self.server}: {'route':<{width}} " + " ".join(f"{c:>5}" for c in CLASSES)
        lines = [head]
        for r in routes:
            cells = " ".join(f"{self.counts[(r, c)]:>5}" for c in CLASSES)
            lines.append(f"{self.server}: {r:<{width}} {cells}")
        total = self.by_class()
        cells = " ".join(f"{total[c]:>5}" for c in CLASSES)
        lines.append(f"{self.server}: {'all ' + str(sum(total.values())):<{width}} {cells}")
        return "\n".join(lines)


def has_input(op: APIOperation) -> bool:
    """Whether negative data can be made for ``op`` (a body or a query to break)."""
    return bool(op.body) or bool(op.query)


def fuzz_operations(
    ops: Iterable[APIOperation],
    base_url: str,
    headers: dict[str, str],
    tally: Tally,
    examples: int,
    check: Callable[[str, Any], None] | None = None,
) -> None:
    """``examples`` schemathesis cases per operation and mode: positive (data that fits the
    schema) and, where there is input to break, negative. ``check(route, response)`` may
    assert more of each reply."""
    for op in ops:
        modes = [GenerationMode.POSITIVE] + ([GenerationMode.NEGATIVE] if has_input(op) else [])
        for mode in modes:
            _fuzz(op, mode, base_url, headers, tally, examples, check)


def _fuzz(
    op: APIOperation,
    mode: GenerationMode,
    base_url: str,
    headers: dict[str, str],
    tally: Tally,
    examples: int,
    check: Callable[[str, Any], None] | None,
) -> None:
    @settings(max_examples=examples, **SETTINGS)
    @given(case=op.as_strategy(generation_mode=mode))
    def run(case: Any) -> None:
        r = case.call(base_url=base_url, headers=headers, timeout=TIMEOUT_S)
        text = r.content[:300].decode("utf-8", "replace")
        tally.record(op.label, r.status_code, lambda: f"{mode.value}: {text}")
        if check is not None:
            check(op.label, r)

    run()


def fuzz_strategy(
    client: httpx.Client,
    method: str,
    path: str,
    bodies: st.SearchStrategy[Any],
    tally: Tally,
    examples: int,
) -> None:
    """``examples`` JSON bodies drawn from ``bodies`` sent to ``method path``."""

    @settings(max_examples=examples, **SETTINGS)
    @given(body=bodies)
    def run(body: Any) -> None:
        content = json.dumps(body).encode()  # ASCII: lone surrogates escaped
        r = send(client, method, path, content, "application/json")
        tally.record(
            f"{method} {path}", r.status_code, lambda: f"{content[:200]!r}: {r.text[:300]}"
        )

    run()


def json_values(max_leaves: int = 6) -> st.SearchStrategy[Any]:
    """Any JSON value: NaN and infinities, big integers and lone surrogates included."""
    scalars = (
        st.none()
        | st.booleans()
        | st.integers()
        | st.floats()
        | st.text(max_size=12)
        | st.sampled_from(["\ud800", "\x00", 2**64, -(2**63) - 1])
    )
    return st.recursive(
        scalars,
        lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
        max_leaves=max_leaves,
    )


WRONG_TYPES = {
    # the fields of both servers' bodies, each with a value no lax parser turns into its type
    **dict.fromkeys(["groups", "sequences", "tokens", "update_info", "init_info"], "x"),
    **dict.fromkeys(["group_id", "env", "name", "desired_name", "path", "run_id"], [7]),
    **dict.fromkeys(["version", "weight", "group_size", "max_tokens", "max_sequences"], "nine"),
    **dict.fromkeys(["lease_seconds", "batch_size", "env_id", "n", "temperature"], [1]),
    **dict.fromkeys(["allow_partial", "stream", "logprobs"], {"a": 1}),
    "prompt": 3.5,
    "policy_version": {"v": 1},
}


def malformed_bodies(huge_bytes: int) -> dict[str, tuple[bytes, str]]:
    """Name -> (body, content type): none of them is a valid body of any route."""
    wrong = json.dumps(WRONG_TYPES).encode()
    return {
        "not JSON": (b"this is not JSON {", "application/json"),
        "truncated JSON": (
            b'{"groups": [{"group_id": "g", "sequences": [{"tok',
            "application/json",
        ),
        "wrong types": (wrong, "application/json"),
        "JSON array": (b"[1, 2, 3]", "application/json"),
        "JSON null": (b"null", "application/json"),
        "empty": (b"", "application/json"),
        "invalid UTF-8": (b'{"name": "\xff\xfe\xfa", "path": "\xc3"}', "application/json"),
        "NaN and Infinity": (
            b'{"version": NaN, "weight": Infinity, "n": -Infinity}',
            "application/json",
        ),
        "lone surrogate": (
            b'{"name": "\\ud800", "prompt": "\\udfff", "path": "\\ud800"}',
            "application/json",
        ),
        "deep nesting": (b"[" * 100_000, "application/json"),
        "wrong content-type (text)": (b"plain text, not a body", "text/plain"),
        "wrong content-type (form)": (b"groups=1&version=x", "application/x-www-form-urlencoded"),
        f"huge ({huge_bytes} bytes)": (
            b'{"pad": "' + b"x" * huge_bytes + b'"}',
            "application/json",
        ),
    }


def client(base_url: str, headers: dict[str, str] | None = None) -> httpx.Client:
    """A client that opens a connection per request: a server that closes one after a
    handler's unanswered error (a 500) does not fail the next request."""
    limits = httpx.Limits(max_keepalive_connections=0)
    return httpx.Client(base_url=base_url, headers=headers, timeout=TIMEOUT_S, limits=limits)


def send(client: httpx.Client, method: str, path: str, body: bytes, ctype: str) -> httpx.Response:
    """One request; no reply within ``TIMEOUT_S`` fails the test (a hang)."""
    what = f"{method} {path} ({body[:80]!r})"
    try:
        return client.request(method, path, content=body, headers={"content-type": ctype})
    except httpx.TimeoutException:
        raise AssertionError(f"{what}: no reply in {TIMEOUT_S}s") from None
    except httpx.TransportError as e:  # a handler's error the server did not answer
        raise AssertionError(f"{what}: the connection dropped ({e!r})") from None


def sweep(
    client: httpx.Client,
    routes: Iterable[tuple[str, str]],
    bodies: dict[str, tuple[bytes, str]],
    tally: Tally,
    expect: Callable[[str, str, str, int], bool],
    after: Callable[[str, str], None] | None = None,
) -> list[str]:
    """Every body to every route (``(method, path template)``; ``client`` carries the auth);
    returns what ``expect(method, template, body name, status)`` refused. ``after(method,
    template)`` runs after each request (to undo a route's effect)."""
    wrong = []
    for method, route in routes:
        path = concrete(route)
        for name, (body, ctype) in bodies.items():
            r = send(client, method, path, body, ctype)
            tally.record(
                f"{method} {route}", r.status_code, lambda n=name, r=r: f"{n}: {r.text[:300]}"
            )
            if not expect(method, route, name, r.status_code):
                wrong.append(f"{method} {route} [{name}] -> {r.status_code}: {r.text[:200]}")
            if after is not None:
                after(method, route)
    return wrong
