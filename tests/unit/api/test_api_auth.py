"""Who may reach the batching API (issue 48): the bind check, and every route of the real app
with and without the token, as the header and in the capability URL ``/t/<token>/``, against
the table in api/README.md."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from starlette.routing import Route

from api.app import create_app
from api.config import TOKEN_ENV, ApiConfig, check_exposure, parse_config
from settings.bind import OPT_OUT_FLAG, UnsafeBind, is_loopback, same_secret
from tests.route_table import concrete, documented

pytestmark = pytest.mark.unit
README = Path(__file__).parent.resolve().parents[2] / "api" / "README.md"
TOKEN = "s3cret-Token_0.9~"
DENIED = re.compile(r"missing or wrong API token")


def app_routes(app: FastAPI) -> set[tuple[str, str]]:
    """Every (method, path) the app registers (HEAD: that of its GET, checked apart)."""
    out = set()
    for r in app.routes:
        if isinstance(r, APIRoute | Route):
            out |= {(m, r.path) for m in r.methods or () if m != "HEAD"}
    return out


def answer(r) -> tuple[int, object]:
    """A reply's status and shape: a JSON object's keys (its figures, free disk space among
    them, move between two calls), the text otherwise."""
    try:
        body = r.json()
    except ValueError:
        return r.status_code, r.text
    return r.status_code, sorted(body) if isinstance(body, dict) else body


def client(tmp_path: Path, name: str, **cfg) -> TestClient:
    app = create_app(ApiConfig(db_path=tmp_path / name / "api.sqlite", **cfg))
    return TestClient(app)


def test_every_route_answers_as_documented(tmp_path: Path) -> None:
    """The table lists exactly the app's routes; each needs the token: 401 without it, with a
    wrong one (header or path), and through a capability URL with a wrong token; with it as a
    header it is answered (not 401), and through the capability URL exactly as with the header
    (two apps on two fresh databases take the same requests in the same order: same status,
    same reply shape)."""
    with client(tmp_path, "header", token=TOKEN) as a, client(tmp_path, "path", token=TOKEN) as b:
        routes = app_routes(a.app)
        table = documented("api", README)
        assert set(table) == routes, "api/README.md's table and the app's routes differ"
        assert set(table.values()) == {"token"}
        for method, route in sorted(routes):
            path = concrete(route)
            body = {} if method == "POST" else None
            for headers in ({}, {"Authorization": "Bearer nope"}, {"X-API-Token": "nope"}):
                r = a.request(method, path, json=body, headers=headers)
                assert r.status_code == 401 and DENIED.search(r.text), (method, path, headers)
            r = a.request(method, f"/t/nope{path}", json=body)
            assert r.status_code == 401 and TOKEN not in r.text, (method, path)
            r = a.request(method, f"/t/{TOKEN}x{path}", json=body)
            assert r.status_code == 401, (method, path)
            by_header = a.request(method, path, json=body, headers={"X-API-Token": TOKEN})
            by_path = b.request(method, f"/t/{TOKEN}{path}", json=body)
            assert by_header.status_code != 401, (method, path, by_header.text)
            assert answer(by_path) == answer(by_header), (method, path)
            assert TOKEN not in by_path.text
        for route in ("/openapi.json", "/docs", "/redoc"):  # HEAD: as its GET
            assert a.head(route).status_code == 401
            assert a.head(route, headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200


def test_a_route_added_later_is_guarded_too(tmp_path: Path) -> None:
    """The guard knows no route: one registered after the app was built (what a later version
    adds) needs the token like the others."""
    with client(tmp_path, "a", token=TOKEN) as c:

        async def future() -> dict[str, bool]:
            return {"ok": True}

        c.app.add_api_route("/future/{x}", future, methods=["GET", "POST", "DELETE"])
        for method in ("GET", "POST", "DELETE"):
            assert c.request(method, "/future/1").status_code == 401
            assert c.request(method, f"/t/{TOKEN}/future/1").json() == {"ok": True}
            ok = c.request(method, "/future/1", headers={"Authorization": f"Bearer {TOKEN}"})
            assert ok.json() == {"ok": True}


def test_without_a_token_every_route_is_open_and_no_capability_url(tmp_path: Path) -> None:
    with client(tmp_path, "a") as c:
        assert c.get("/health").status_code == 200
        r = c.get("/t/anything/health")
        assert r.status_code == 404 and "no token" in r.json()["detail"]


def test_capability_url_edge_cases(tmp_path: Path) -> None:
    """``/t/<token>`` alone is the root route; query strings pass; a percent-encoded token
    matches its decoded form; the prefix must be the path's first segment."""
    with client(tmp_path, "a", token=TOKEN) as c:
        assert c.get(f"/t/{TOKEN}").json() == c.get("/", headers={"X-API-Token": TOKEN}).json()
        r = c.get(f"/t/{TOKEN}/backpressure?env=e1")
        assert r.status_code == 200 and "wanted" in r.json()
        assert c.get("/t/" + TOKEN.replace("~", "%7E") + "/health").status_code == 200
        assert c.get(f"/x/t/{TOKEN}/health").status_code == 401
        assert c.get(f"/T/{TOKEN}/health").status_code == 401


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.8.9.10", True),
        ("localhost", True),
        ("LOCALHOST", True),
        ("::1", True),
        ("[::1]", True),
        ("::ffff:127.0.0.1", True),
        ("0.0.0.0", False),
        ("::", False),
        ("", False),
        ("10.250.0.1", False),
        ("192.168.1.5", False),
        ("fe80::1%eth0", False),
        ("node7", False),
        ("localhost.example.com", False),
    ],
)
def test_loopback_is_what_the_kernel_keeps_on_this_machine(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_a_non_loopback_bind_needs_a_token_or_the_opt_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    assert check_exposure(parse_config([])) is None  # the default: loopback
    with pytest.raises(UnsafeBind) as e:
        check_exposure(parse_config(["--host", "0.0.0.0"]))
    msg = str(e.value)
    assert "refusing to serve on '0.0.0.0' without a token" in msg
    assert f"--token T or ${TOKEN_ENV}" in msg and OPT_OUT_FLAG in msg and e.value.code != 0
    warn = check_exposure(parse_config(["--host", "0.0.0.0", OPT_OUT_FLAG]))
    assert warn is not None and warn.startswith("INSECURE") and "0.0.0.0" in warn
    assert check_exposure(parse_config(["--host", "0.0.0.0", "--token", "t"])) is None
    monkeypatch.setenv(TOKEN_ENV, "from-env")
    assert check_exposure(parse_config(["--host", "10.0.0.2"])) is None
    monkeypatch.setenv(TOKEN_ENV, "")  # empty: no token
    with pytest.raises(UnsafeBind):
        check_exposure(parse_config(["--host", "10.0.0.2"]))


def test_same_secret_compares_whole_values() -> None:
    assert same_secret("abc", "abc") and same_secret(b"abc", "abc")
    assert not same_secret("abc", "abcd") and not same_secret("", "abc")
