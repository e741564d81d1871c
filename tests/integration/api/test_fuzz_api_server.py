"""Fuzzing the batching API (issue 48 point 4): schemathesis over its OpenAPI schema with the
token and without it, malformed bodies on every route; no reply is a 5xx, none hangs, no
group queued before is lost and the database passes SQLite's integrity check afterwards.

The API runs as in production (uvicorn on a free port, a real SQLite file), in a thread of
this process so that its store's clock can be moved on: every lease the fuzzing took expires
before the check that the queued groups are all still there. Counts: docs/FAULT_TOLERANCE.md
("Fuzzing both servers"); ``pytest -s`` prints them.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
import uvicorn
from hypothesis import given, settings
from hypothesis import strategies as st
from schemathesis import APIOperation

from api.app import create_app
from api.config import ApiConfig
from api.protocol import ENV_NAME_PATTERN, VERSION_MAX, ScoredGroup
from api.store import Store
from settings.ports import free_port
from tests.integration.fuzz_http import (
    SETTINGS,
    TIMEOUT_S,
    Tally,
    client,
    fuzz_operations,
    malformed_bodies,
    sweep,
)
from tests.route_table import documented

pytestmark = pytest.mark.integration
README = Path(__file__).parent.resolve().parents[2] / "api" / "README.md"
TOKEN = "fuzz-Token_0.1"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
MAX_BODY = 256 * 1024
EXAMPLES = 25
"""Schemathesis cases per operation and mode (positive, negative) with the token."""
VALID_PUSHES = 40
"""Pushes of valid groups (schemathesis makes none: a group's lists must align)."""
CONSUMERS = {("GET", "/batch"), ("GET", "/reset_data")}
"""Routes whose job is to hand out or forget queued groups (Atropos' ``GET /batch`` acks what
it served before; ``/reset_data`` deletes everything): fuzzed after the witnesses' check."""
WEEK_S = 8 * 86400.0
"""Beyond the longest lease (``lease_seconds`` <= 7 days; Atropos' 600 s)."""


class Clock:
    """The store's clock: real time plus an offset the test moves on."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.time() + self.offset


@dataclass
class Api:
    url: str
    store: Store
    clock: Clock


@pytest.fixture
def api(tmp_path: Path) -> Iterator[Api]:
    """The API with a token on a file database, under uvicorn in a thread of this process."""
    clock = Clock()
    store = Store(tmp_path / "api.sqlite", clock=clock)
    cfg = ApiConfig(db_path=tmp_path / "api.sqlite", token=TOKEN, max_body_bytes=MAX_BODY)
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(create_app(cfg, store), host="127.0.0.1", port=port, log_level="error")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive(), "the API did not start"
        time.sleep(0.05)
    quiet = logging.getLogger("api")  # each rejected group is logged: thousands of lines
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        yield Api(f"http://127.0.0.1:{port}", store, clock)
    finally:
        quiet.setLevel(level)
        server.should_exit = True
        thread.join(timeout=30)
        store.close()


def operations(url: str) -> list[APIOperation]:
    schema = httpx.get(f"{url}/openapi.json", headers=AUTH, timeout=TIMEOUT_S).json()
    return [op.ok() for op in schemathesis.openapi.from_dict(schema).get_all_operations()]


def routes() -> list[tuple[str, str]]:
    """Every route of the API (api/README.md's table: test_api_auth checks it is the app's)."""
    return sorted(documented("api", README))


def body_routes(ops: list[APIOperation]) -> set[tuple[str, str]]:
    """The routes that read a body (a malformed one must be refused)."""
    return {(op.method.upper(), op.path) for op in ops if op.body}


def witnesses() -> list[dict]:
    """Groups queued before the fuzzing, sampled at the highest version a client can report
    (no ``/policy_version`` the fuzzer sends makes them stale)."""
    seq = {"tokens": [5, 6, 7], "mask": [0, 1, 1], "logprobs": [0.0, -0.5, -1.25], "score": 1.0}
    return [
        {
            "group_id": f"witness-{i}",
            "env": env,
            "policy_version": VERSION_MAX,
            "sequences": [seq, {**seq, "score": -1.0}],
            "metrics": {"i": i},
        }
        for i, env in enumerate(["witness-a", "witness-b", "witness-a"])
    ]


def valid_pushes() -> st.SearchStrategy[list[dict[str, Any]]]:
    """Bodies of ``POST /groups`` that must be stored: 1-3 groups of any env name the pattern
    allows, any ids, 64-bit tokens and finite floats, at the highest version (never stale)."""
    finite = st.floats(allow_nan=False, allow_infinity=False)

    def sequence(n: int) -> st.SearchStrategy[dict[str, Any]]:
        def aligned(values: st.SearchStrategy[Any]) -> st.SearchStrategy[list[Any]]:
            return st.lists(values, min_size=n, max_size=n)

        return st.fixed_dictionaries(
            {
                "tokens": aligned(st.integers(-(2**63), 2**63 - 1)),
                "mask": aligned(st.sampled_from([0, 1])),
                "logprobs": aligned(finite),
                "score": finite,
            }
        )

    metric = finite | st.integers(-(2**63), 2**63 - 1) | st.booleans() | st.text() | st.none()
    group = st.fixed_dictionaries(
        {
            "group_id": st.text(min_size=1, max_size=150),
            "env": st.from_regex(ENV_NAME_PATTERN, fullmatch=True),
            "policy_version": st.just(VERSION_MAX),
            "sequences": st.lists(st.integers(1, 8).flatmap(sequence), min_size=1, max_size=3),
            "metrics": st.dictionaries(st.text(max_size=8), metric, max_size=3),
        }
    )
    return st.lists(group, min_size=1, max_size=3)


def push_valid_groups(c: httpx.Client, tally: Tally, examples: int) -> dict[str, dict]:
    """``examples`` pushes of ``valid_pushes()`` (ids made unique); the groups stored."""
    stored: dict[str, dict] = {}
    ids = itertools.count()

    @settings(max_examples=examples, **SETTINGS)
    @given(groups=valid_pushes())
    def push(groups: list[dict[str, Any]]) -> None:
        groups = [{**g, "group_id": f"{next(ids)}:{g['group_id']}"} for g in groups]
        r = c.post("/groups", json={"groups": groups})
        tally.record("POST /groups", r.status_code, lambda: r.text[:300])
        assert r.status_code == 200 and r.json()["accepted"] == len(groups), r.text
        stored.update((g["group_id"], g) for g in groups)

    push()
    return stored


def lease_everything(c: httpx.Client) -> dict[str, ScoredGroup]:
    """Every queued group, leased (the budget is a whole queue's)."""
    got: dict[str, ScoredGroup] = {}
    body = {"max_sequences": 2**40, "allow_partial": True, "lease_seconds": 60}
    for _ in range(1000):
        r = c.post("/batches/lease", json=body)
        if r.status_code == 204:
            return got
        assert r.status_code == 200, r.text
        for g in r.json()["groups"]:
            got[g["group_id"]] = ScoredGroup.model_validate(g)
    raise AssertionError("the queue did not run dry in 1000 leases")


def integrity(store: Store) -> list[str]:
    with store.db.locked() as db:
        return [row[0] for row in db.execute("PRAGMA integrity_check")]


def test_fuzzing_with_the_token_no_5xx_no_data_lost(api: Api) -> None:
    """With the token: valid groups pushed (stored, every one), then schemathesis (positive
    and negative cases) on every operation and the malformed bodies on every route: no 5xx,
    no hang, a body route refuses every malformed body (4xx); every group queued before is
    leased back afterwards, unchanged; then the routes that consume the queue get the same;
    the database's integrity check is ``ok``."""
    tally = Tally("api")
    ops = operations(api.url)
    assert len(ops) >= 20, [op.label for op in ops]
    with client(api.url, AUTH) as c:
        r = c.post("/groups", json={"groups": witnesses()})
        assert r.status_code == 200 and r.json()["accepted"] == 3, r.text
        queued = {w["group_id"]: w for w in witnesses()}
        queued |= push_valid_groups(c, tally, VALID_PUSHES)

        # 1. everything but the consumers
        first = [op for op in ops if (op.method.upper(), op.path) not in CONSUMERS]
        fuzz_operations(first, api.url, AUTH, tally, EXAMPLES)
        bodies = malformed_bodies(MAX_BODY)
        takes_body = body_routes(ops)

        def expect(method: str, path: str, name: str, status: int) -> bool:
            if name.startswith("huge"):
                return status == 413
            return 400 <= status < 500 if (method, path) in takes_body else status < 500

        rest = [r for r in routes() if r not in CONSUMERS]
        wrong = sweep(c, rest, bodies, tally, expect)

        # 2. nothing queued was lost: every lease taken meanwhile has expired
        api.clock.offset += WEEK_S
        leased = lease_everything(c)
        for group_id, group in queued.items():
            assert leased.get(group_id) == ScoredGroup.model_validate(group), group_id

        # 3. the consumers, then the store
        last = [op for op in ops if (op.method.upper(), op.path) in CONSUMERS]
        fuzz_operations(last, api.url, AUTH, tally, EXAMPLES)
        wrong += sweep(c, sorted(CONSUMERS), bodies, tally, expect)
        assert c.get("/health").status_code == 200
        again = {"groups": [{**witnesses()[0], "group_id": "after-the-fuzzing"}]}
        assert c.post("/groups", json=again).json()["accepted"] == 1
        assert set(lease_everything(c)) >= {"after-the-fuzzing"}
    print("\n" + tally.report())
    assert not tally.server_errors, "\n".join(tally.server_errors[:20])
    assert not wrong, "\n".join(wrong[:20])
    assert integrity(api.store) == ["ok"]
    assert {route for route, _ in tally.counts} == {f"{m} {p}" for m, p in routes()}


def test_without_the_token_every_request_is_401(api: Api) -> None:
    """The same operations and bodies without the token: 401 for every one (a huge body
    too: the token is checked before the body is read), and nothing is stored."""
    tally = Tally("api, no token")
    ops = operations(api.url)

    def refused(route: str, response: object) -> None:
        status = response.status_code  # type: ignore[attr-defined]
        assert status == 401, f"{route}: {status}"

    fuzz_operations(ops, api.url, {}, tally, examples=3, check=refused)
    with client(api.url) as c:
        wrong = sweep(c, routes(), malformed_bodies(MAX_BODY), tally, lambda *a: a[3] == 401)
    print("\n" + tally.report())
    assert not wrong, "\n".join(wrong[:20])
    assert set(tally.by_class()) == {"4xx"}
    assert {route for route, _ in tally.counts} == {f"{m} {p}" for m, p in routes()}
    with api.store.db.locked() as db:
        assert db.execute("SELECT COUNT(*) FROM groups").fetchone() == (0,)
        assert db.execute("SELECT COUNT(*) FROM envs").fetchone() == (0,)
    assert integrity(api.store) == ["ok"]
