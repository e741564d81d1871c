"""ASGI middleware in front of every route: the shared token, gzip bodies and the size limit.

The token comes in a header (``Authorization: Bearer``, ``X-API-Token``) or in the path: the
capability URL ``/t/<token>/<route>`` (``CAPABILITY_PREFIX``), for clients that send no header
(an unchanged atroposlib env puts it in its ``rollout_server_url``). The prefix is checked in
constant time and taken off before routing, so the routes, the logs and the error replies never
see it.

Pure ASGI (not ``BaseHTTPMiddleware``) so the body is read once, bounded while it streams in,
and handed on as one message. The limit is applied to the decompressed size, with bounded
decompression steps, so a small gzip bomb cannot make the server allocate its expansion.
"""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from settings.bind import same_secret

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

CAPABILITY_PREFIX = "/t/"
"""``/t/<token>/<route>``: the route, authenticated by the token in the path."""
_URL_SAFE = re.compile(r"[A-Za-z0-9._~-]+")


def url_safe(token: str) -> bool:
    """Whether ``token`` can stand in a URL path as it is (the capability URL)."""
    return _URL_SAFE.fullmatch(token) is not None


class _Reject(Exception):
    def __init__(self, status: int, detail: str) -> None:
        self.status, self.detail = status, detail


class RequestGuard:
    """Token check, then the body: size-limited, gunzipped, passed on whole."""

    def __init__(self, app: ASGIApp, token: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.token = token.encode() if token else None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket" and self.token is not None:
            await send({"type": "websocket.close", "code": 1008})  # no websocket route: deny
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v for k, v in scope["headers"]}
        try:
            scope, in_path = self._capability(scope)
            if not in_path:
                self._check_token(headers)
            body = await self._read_body(headers, receive)
        except _Reject as r:
            await _send_json(send, r.status, {"detail": r.detail})
            return
        if headers.get("content-encoding"):
            # Downstream sees a plain body: drop the encoding, fix the length.
            scope = dict(scope)
            scope["headers"] = [
                (k, v)
                for k, v in scope["headers"]
                if k.lower() not in (b"content-encoding", b"content-length")
            ] + [(b"content-length", str(len(body)).encode())]
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # later calls wait for the disconnect, as usual

        await self.app(scope, replay, send)

    def _capability(self, scope: Scope) -> tuple[Scope, bool]:
        """``scope`` with a ``/t/<token>`` prefix taken off, and whether it carried the right
        token; a wrong one is refused (401), one given to a server without a token 404."""
        path: str = scope.get("path", "")
        if not path.startswith(CAPABILITY_PREFIX):
            return scope, False
        given, _, rest = path[len(CAPABILITY_PREFIX) :].partition("/")
        if self.token is None:
            raise _Reject(404, "this API has no token: no capability URL (/t/<token>/...)")
        if not same_secret(given.encode("utf-8", "replace"), self.token):
            raise _Reject(401, "wrong token in the capability URL (/t/<token>/...)")
        scope = dict(scope)
        scope["path"] = "/" + rest
        raw = scope.get("raw_path")
        if isinstance(raw, bytes) and raw.startswith(CAPABILITY_PREFIX.encode()):
            # the raw path's token segment may be percent-encoded: drop it whole
            scope["raw_path"] = b"/" + raw[len(CAPABILITY_PREFIX) :].partition(b"/")[2]
        return scope, True

    def _check_token(self, headers: dict[str, bytes]) -> None:
        if self.token is None:
            return
        given = headers.get("x-api-token")
        auth = headers.get("authorization", b"")
        if given is None and auth[:7].lower() == b"bearer ":
            given = auth[7:].strip()
        if given is None or not same_secret(given, self.token):
            raise _Reject(
                401,
                "missing or wrong API token (Authorization: Bearer <token>, X-API-Token, or "
                "the capability URL /t/<token>/...)",
            )

    async def _read_body(self, headers: dict[str, bytes], receive: Receive) -> bytes:
        encoding = headers.get("content-encoding", b"identity").decode("latin-1").strip().lower()
        if encoding not in ("identity", "gzip"):
            raise _Reject(415, f"unsupported Content-Encoding {encoding!r} (use gzip or none)")
        limit = self.max_body_bytes
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise _Reject(413, f"request body over the {limit}-byte limit")
        inflate = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS) if encoding == "gzip" else None
        out = bytearray()
        raw_size = 0
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _Reject(400, "client disconnected while sending the body")
            chunk = message.get("body", b"")
            more = message.get("more_body", False)
            raw_size += len(chunk)
            if raw_size > limit:
                raise _Reject(413, f"request body over the {limit}-byte limit")
            if inflate is None:
                out += chunk
                continue
            try:
                # Bounded steps: never inflate more than the limit allows (gzip bombs).
                while chunk:
                    out += inflate.decompress(chunk, limit + 1 - len(out))
                    if len(out) > limit:
                        raise _Reject(413, f"decompressed body over the {limit}-byte limit")
                    chunk = inflate.unconsumed_tail
            except zlib.error as e:
                raise _Reject(400, f"invalid gzip body: {e}") from None
        if inflate is not None and raw_size and not inflate.eof:
            raise _Reject(400, "invalid gzip body: truncated stream")
        return bytes(out)


async def _send_json(send: Send, status: int, payload: dict[str, Any]) -> None:
    body = json.dumps(payload).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
