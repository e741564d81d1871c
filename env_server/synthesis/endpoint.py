"""The OpenAI-compatible chat endpoint that writes the rationales: one row's request, checked
against the rule and retried under the project's retry policy (docs/SYNTHESIS.md)."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from api.retry import RetryPolicy, is_transient, retry_call_async
from env_server.synthesis.config import SynthConfig
from env_server.synthesis.prompt import build_request_messages
from env_server.synthesis.rule import InvalidAnswer, clean_rationale

log = logging.getLogger("env_server.synthesize")


class RequestFailed(RuntimeError):
    """A request the endpoint refused for good (4xx other than 429)."""


def _worth_asking_again(exc: BaseException) -> bool:
    """A transient failure, or an answer that broke the rule (the next sample may not)."""
    return isinstance(exc, InvalidAnswer) or is_transient(exc)


@dataclass
class Outcome:
    rationale: str | None
    attempts: int
    reason: str = ""


class Synthesizer:
    """Asks the endpoint for one row's rationale, validating and retrying."""

    def __init__(self, cfg: SynthConfig) -> None:
        import httpx

        from api.client import bearer

        self.cfg = cfg
        self.http = httpx.AsyncClient(
            base_url=cfg.base_url.rstrip("/"),
            headers=bearer(cfg.api_key or os.environ.get("OPENAI_API_KEY")),
            timeout=httpx.Timeout(cfg.timeout_s, connect=10.0),
        )
        self.model = cfg.model
        self.requests = 0

    async def aclose(self) -> None:
        await self.http.aclose()

    async def discover(self) -> str:
        """The model to ask: ``--model``, else the first one the endpoint lists."""
        if self.model:
            return self.model

        async def ask() -> str:
            r = await self.http.get("/models")
            r.raise_for_status()
            return str(r.json()["data"][0]["id"])

        what = f"GET {self.cfg.base_url}/models"
        policy = RetryPolicy(attempts=self.cfg.max_retries + 3)
        self.model = await retry_call_async(ask, what, is_transient, policy, logger=log)
        return self.model

    async def _ask(self, messages: list[dict[str, str]]) -> str:
        body = {
            "model": self.model,
            "messages": messages,
            "max_tokens": self.cfg.max_tokens,
            "temperature": self.cfg.temperature,
            "n": 1,
        }
        self.requests += 1
        r = await self.http.post("/chat/completions", json=body)
        if 400 <= r.status_code < 500 and r.status_code != 429:
            raise RequestFailed(f"HTTP {r.status_code}: {r.text[:300]}")
        r.raise_for_status()
        choice = r.json()["choices"][0]
        return str((choice.get("message") or {}).get("content") or "")

    async def rationale(self, row: Mapping[str, Any]) -> Outcome:
        """Up to ``1 + max_retries`` requests: transient errors and bad answers are asked
        again after the policy's backoff; anything else fails the row at once."""
        messages = build_request_messages(row, self.cfg.max_context_chars)
        attempts = 0

        async def ask() -> str:
            nonlocal attempts
            attempts += 1
            answer = await self._ask(messages)
            return clean_rationale(answer, self.cfg.max_words, self.cfg.lenient)

        what = f"row {row['session_id']}/{row['step']}"
        policy = RetryPolicy(attempts=self.cfg.max_retries + 1)
        try:
            text = await retry_call_async(
                ask, what, _worth_asking_again, policy, logger=log, level=logging.DEBUG
            )
        except InvalidAnswer as e:
            return Outcome(None, attempts, f"invalid answer: {e}")
        except RequestFailed as e:
            return Outcome(None, attempts, str(e))
        except Exception as e:  # noqa: BLE001 - the row fails, the run goes on
            return Outcome(None, attempts, f"{type(e).__name__}: {e}")
        return Outcome(text, attempts)
