"""A recording pass-through in front of the inference server (in the service's process).

verifiers' train client (``TrainClient``, through ``renderers.client.generate``) calls vLLM's
``POST /inference/v1/generate`` with the prompt as token ids and reads back the completion's
token ids and logprobs; it keeps neither the response headers nor anything we could check
the trace's tokens against. So the service points the client at this proxy, which forwards
every request unchanged to the real server and, for each generate exchange, records what
the server answered (:class:`~env_server.verifiers.convert.Turn`): the prompt ids sent, the
completion ids and logprobs returned, the ``x-weight-version`` header (the weights that
sampled it, ``vllm_patching``) and verifiers' ``X-Session-ID`` (the rollout's trace id).
The conversion then checks every sampled run of a branch against these records.

One adaptation, on the way back: vLLM 0.32's generate route (default ``output_mode
"tokens"``) names each logprob entry's token ``token_id: N``, while renderers 0.1.12 requires
``token: "token_id:N"`` (the placeholder vLLM itself writes in ``output_mode "text"`` with
``--return-tokens-as-token-ids``). :func:`add_token_placeholders` adds that key to each entry;
ids and logprobs are untouched. Everything else passes through with its body and status, so
errors reach verifiers as the server sent them. Bound to 127.0.0.1 on a free port.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from env_server.verifiers.convert import Turn
from settings.ports import free_port

log = logging.getLogger("env_server.verifiers.proxy")
VERSION_HEADER = "x-weight-version"
SESSION_HEADER = "x-session-id"
GENERATE_PATH = "/inference/v1/generate"
_HOP = {"content-length", "content-encoding", "transfer-encoding", "connection", "keep-alive"}


def parse_turn(
    request: dict[str, Any], response: dict[str, Any], headers: httpx.Headers | dict
) -> Turn | None:
    """The exchange's :class:`Turn` (None when the answer carries no tokens, e.g. an
    error body). Logprobs come as ``choices[0].logprobs.content[i].logprob``."""
    choices = response.get("choices") or []
    if not choices or not isinstance(request.get("token_ids"), list):
        return None
    choice = choices[0]
    completion = choice.get("token_ids") or []
    content = (choice.get("logprobs") or {}).get("content") or []
    logprobs = tuple(max(float(e.get("logprob", 0.0)), -1e4) for e in content)
    raw = {k.lower(): v for k, v in dict(headers).items()}
    version = raw.get(VERSION_HEADER)
    try:
        weight_version = int(float(version)) if version is not None else None
    except ValueError:
        weight_version = None
    return Turn(
        prompt_ids=tuple(int(t) for t in request["token_ids"]),
        completion_ids=tuple(int(t) for t in completion),
        logprobs=logprobs,
        weight_version=weight_version,
        session=raw.get(SESSION_HEADER),
    )


def add_token_placeholders(response: dict[str, Any]) -> bool:
    """Add ``token: "token_id:N"`` to every logprob entry (and top-logprob) that carries only
    ``token_id``; True if anything changed."""
    changed = False
    for choice in response.get("choices") or []:
        for entry in (choice.get("logprobs") or {}).get("content") or []:
            for e in [entry, *(entry.get("top_logprobs") or [])]:
                if "token" not in e and "token_id" in e:
                    e["token"] = f"token_id:{e['token_id']}"
                    changed = True
    return changed


class RecordingProxy:
    """Forward everything to ``upstream``; record each generate exchange by session."""

    def __init__(
        self, upstream: str, timeout_s: float = 600.0, record_path: Path | None = None
    ) -> None:
        self.upstream = upstream.rstrip("/")
        self.record_path = record_path
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.turns: dict[Turn, float] = {}
        """Recorded exchanges not yet matched to a branch, with when they were recorded."""
        self.exchanges = 0
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0))
        app = Starlette(
            routes=[
                Route(
                    "/{path:path}",
                    self._forward,
                    methods=["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"],
                )
            ]
        )
        config = uvicorn.Config(
            app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="off"
        )
        self._server = uvicorn.Server(config)
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._server.serve())
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises why it could not start
            await asyncio.sleep(0.02)

    async def stop(self) -> None:
        self._server.should_exit = True
        if self._task is not None:
            await self._task
        await self._http.aclose()

    def recorded(self) -> list[Turn]:
        """Every exchange recorded and not yet forgotten. verifiers 0.4.0's interception
        path does not always send ``X-Session-ID``, so branches are matched on content (the
        prompt ids and the completion ids, exact), not on the session."""
        return list(self.turns)

    def forget(self, turns: list[Turn], older_than_s: float = 1800.0) -> None:
        """Drop ``turns`` (matched) and any exchange recorded over ``older_than_s`` ago (an
        episode that failed, or a branch refused)."""
        for t in turns:
            self.turns.pop(t, None)
        cutoff = time.monotonic() - older_than_s
        for t in [t for t, at in self.turns.items() if at < cutoff]:
            del self.turns[t]

    async def _forward(self, request: Request) -> Response:
        body = await request.body()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in {"host", *_HOP}}
        url = self.upstream + request.url.path
        if request.url.query:
            url += "?" + request.url.query
        r = await self._http.request(request.method, url, content=body, headers=headers)
        content = r.content
        if request.method == "POST" and request.url.path == GENERATE_PATH and r.status_code < 400:
            try:
                data = r.json()
                turn = parse_turn(json.loads(body), data, r.headers)
                if add_token_placeholders(data):
                    content = json.dumps(data).encode()
            except (ValueError, TypeError) as e:
                log.warning("could not record a generate exchange: %r", e)
                turn = None
            if turn is not None:
                self.exchanges += 1
                self.turns[turn] = time.monotonic()
                if self.record_path is not None:
                    with self.record_path.open("a") as f:
                        f.write(json.dumps(dataclasses.asdict(turn)) + "\n")
        out = {k: v for k, v in r.headers.items() if k.lower() not in _HOP}
        return Response(content, status_code=r.status_code, headers=out)
