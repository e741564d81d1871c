"""Client of the inference server's OpenAI-compatible completions API (vLLM).

Token in, token out: the prompt goes as token ids (so the ids we train on are the ids the
server saw) and the request asks for ``return_token_ids`` and the sampled tokens' logprobs
(``logprobs: 0``), so the completion's ids and logprobs come back aligned. vLLM 0.32's
``/v1/completions`` offers all three (see ``vllm/entrypoints/openai/completion/protocol.py``).

Which weights produced a completion: our patched server (``vllm_patching``) adds an
``x-weight-version`` header to every completion response; a plain vLLM reports none and the
caller falls back to the version the API reports.

Transient failures (connection refused/reset, timeouts, 429, 5xx) are retried under the
project's one retry policy (``api.retry``, docs/FAULT_TOLERANCE.md); anything else is raised
at once. Completions are safe to repeat (sampling has no side effects on the server).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx

from api.retry import RetryPolicy, is_transient, retry_call_async

log = logging.getLogger("env_server.inference")
VERSION_HEADER = "x-weight-version"
T = TypeVar("T")


@dataclass(frozen=True)
class Completion:
    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None


@dataclass(frozen=True)
class CompletionBatch:
    prompt_ids: list[int]
    completions: list[Completion]
    weight_version: int | None
    """Version the server says produced them (None: the server does not say)."""


class InferenceClient:
    """Async client for one inference server."""

    def __init__(
        self,
        base_url: str,
        model: str | None = None,
        timeout_s: float = 300.0,
        max_attempts: int | None = None,
        give_up_s: float | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        # Retry a down/restarting server this long / this often (None: no limit).
        self.policy = RetryPolicy(attempts=max_attempts, deadline_s=give_up_s)
        # Connecting should be quick; generating on a CPU can take minutes.
        timeout = httpx.Timeout(timeout_s, connect=5.0)
        self._http = httpx.AsyncClient(base_url=self.base_url, timeout=timeout)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _retried(self, what: str, fn: Callable[[], Awaitable[T]]) -> T:
        return await retry_call_async(fn, what, is_transient, self.policy, logger=log)

    async def _get_json(self, path: str) -> Any:
        r = await self._http.get(path)
        r.raise_for_status()
        return r.json()

    async def discover(self) -> tuple[str, str | None]:
        """The model name to request and the model's path (its tokenizer), asking the server.

        In ``lora_only`` mode the name changes with every weight version; our bridge's
        ``/bridge/info`` says which one is current. A plain vLLM lists it in ``/v1/models``.
        """
        return await self._retried(f"GET {self.base_url}/v1/models", self._ask_model)

    async def _ask_model(self) -> tuple[str, str | None]:
        """One try of :meth:`discover` (sets ``self.model``)."""
        models = await self._get_json("/v1/models")
        first = models["data"][0]
        name, root = first["id"], first.get("root")
        try:
            info = await self._get_json("/bridge/info")
            name = info.get("served_model") or name
            root = info.get("model") or root
        except httpx.HTTPStatusError:
            pass  # a plain vLLM: no bridge routes
        self.model = name
        return name, root

    async def complete(
        self,
        prompt_ids: list[int],
        n: int,
        max_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | None = None,
    ) -> CompletionBatch:
        """``n`` completions of one tokenized prompt, with token ids and logprobs."""
        if self.model is None:
            await self.discover()
        body: dict[str, Any] = {
            "prompt": prompt_ids,
            "n": n,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "logprobs": 0,  # the sampled token's logprob only
            "return_token_ids": True,
            "skip_special_tokens": True,
        }
        if seed is not None:
            body["seed"] = seed

        async def post() -> httpx.Response:
            r = await self._http.post("/v1/completions", json={**body, "model": self.model})
            if r.status_code == 404:  # model renamed (lora_only new version): ask again
                await self._ask_model()  # within this retried call: no retry loop of its own
                r = await self._http.post("/v1/completions", json={**body, "model": self.model})
            r.raise_for_status()
            return r

        r = await self._retried(f"POST {self.base_url}/v1/completions", post)
        return parse_completion_response(r.json(), prompt_ids, r.headers.get(VERSION_HEADER))


def parse_completion_response(
    data: dict[str, Any], prompt_ids: list[int], version_header: str | None
) -> CompletionBatch:
    """Turn a ``/v1/completions`` JSON body into aligned ids and logprobs (checked)."""
    out = []
    for c in sorted(data["choices"], key=lambda c: c["index"]):
        ids = c.get("token_ids")
        lp = (c.get("logprobs") or {}).get("token_logprobs")
        if ids is None or lp is None:
            raise ValueError("server returned no token_ids/logprobs (vLLM >= 0.10 required)")
        if len(ids) != len(lp):
            raise ValueError(f"{len(ids)} completion tokens but {len(lp)} logprobs")
        # A logprob can be None only for a prompt token; -inf is clamped to stay JSON-safe.
        logprobs = [max(float(x), -1e4) if x is not None else 0.0 for x in lp]
        out.append(Completion(c["text"], list(ids), logprobs, c.get("finish_reason")))
    version = None
    if version_header is not None:
        try:
            version = int(float(version_header))
        except ValueError:
            log.warning("ignoring non-numeric %s header %r", VERSION_HEADER, version_header)
    return CompletionBatch(prompt_ids=list(prompt_ids), completions=out, weight_version=version)


class InferencePool:
    """Several inference servers behind the ``InferenceClient`` interface.

    Each request goes to the server with the fewest requests in flight from this process
    (ties: round-robin), so a slow or busy server gets less work; every server keeps its own
    client, so each one discovers its own served-model name (``lora_only`` renames per server).
    """

    def __init__(
        self,
        base_urls: list[str],
        model: str | None = None,
        timeout_s: float = 300.0,
        max_attempts: int | None = None,
        give_up_s: float | None = None,
    ) -> None:
        if not base_urls:
            raise ValueError("at least one inference server URL is needed")
        self.clients = [
            InferenceClient(u, model, timeout_s, max_attempts, give_up_s=give_up_s)
            for u in base_urls
        ]
        self.in_flight = [0] * len(self.clients)
        self.served = [0] * len(self.clients)
        """Completions requests sent to each server (for logs and tests)."""
        self._next = 0

    @property
    def base_url(self) -> str:
        return ",".join(c.base_url for c in self.clients)

    @property
    def model(self) -> str | None:
        return self.clients[0].model

    def pick(self) -> int:
        """Index of the least-loaded server; round-robin among equally loaded ones."""
        n = len(self.clients)
        order = [(self._next + k) % n for k in range(n)]
        best = min(order, key=lambda i: self.in_flight[i])
        self._next = (best + 1) % n
        return best

    async def discover(self) -> tuple[str, str | None]:
        """Ask every server (all must answer); returns the first server's name and path."""
        found = await asyncio.gather(*(c.discover() for c in self.clients))
        return found[0]

    async def complete(
        self,
        prompt_ids: list[int],
        n: int,
        max_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | None = None,
    ) -> CompletionBatch:
        i = self.pick()
        self.in_flight[i] += 1
        self.served[i] += 1
        try:
            return await self.clients[i].complete(
                prompt_ids, n, max_tokens, temperature, top_p, seed
            )
        finally:
            self.in_flight[i] -= 1

    async def aclose(self) -> None:
        if len(self.clients) > 1:
            log.info(
                "completions requests per server: %s",
                {c.base_url: k for c, k in zip(self.clients, self.served, strict=True)},
            )
        await asyncio.gather(*(c.aclose() for c in self.clients))


async def wait_ready(url: str, seconds: float) -> None:
    """Wait until the server at ``url`` answers ``GET /health`` with 200 (at most ``seconds``):
    the launcher starts the SFT evaluation while vLLM is still loading. Polled under the
    project's retry policy, backing off to 0.5 s, as the launcher's own health waits."""
    health = f"{url.rstrip('/')}/health"
    async with httpx.AsyncClient(timeout=5.0) as http:

        async def answered() -> None:
            (await http.get(health)).raise_for_status()

        policy = RetryPolicy(deadline_s=seconds, base_s=0.1, cap_s=0.5)
        try:
            await retry_call_async(
                answered, f"GET {health}", _not_yet, policy, logger=log, level=logging.DEBUG
            )
        except httpx.HTTPError as e:
            raise TimeoutError(f"{url} did not answer /health within {seconds:g} s ({e!r})") from e


def _not_yet(e: BaseException) -> bool:
    return isinstance(e, httpx.HTTPError)
