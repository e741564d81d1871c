"""The one retry policy of every service: the API client, the env's inference and endpoint
calls, the trainer's weight sync and bridge set-up, the launcher's health waits.

Built on tenacity. What it does (numbers and reasons: docs/FAULT_TOLERANCE.md, "Retry policy"):

- retries only what the caller's ``retryable(exc)`` accepts; anything else is raised at once;
- waits ``min(cap_s, base_s * 2**(n - 1) + uniform(0, base_s))`` before retry ``n``
  (tenacity's ``wait_exponential_jitter``): 0.5-1 s, 1-1.5 s, 2-2.5 s, 4-4.5 s, then 5 s;
- gives up after ``attempts`` tries or once ``deadline_s`` seconds have passed since the first
  failure, whichever comes first (``None``: no such limit), raising the last error;
- logs every retry in one line: what failed, how, and when the next try is.

Idempotency is the caller's rule, expressed in ``retryable``: :func:`is_transient` with
``idempotent=False`` accepts only failures that prove the request never reached the server.
This module imports no service package and no torch.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
import tenacity

log = logging.getLogger(__name__)
T = TypeVar("T")

BASE_S = 0.5
"""First backoff (seconds); also the most random jitter added to each backoff."""
CAP_S = 5.0
"""Longest backoff (seconds): a server that comes back is tried again within this long."""

NEVER_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)
"""Transport errors raised before the request left this process: always safe to send again."""
OUR_BUG = (httpx.UnsupportedProtocol, httpx.LocalProtocolError)
"""Transport errors of a malformed request or URL: retrying cannot fix them."""
NOT_PROCESSED = frozenset({429, 502, 503, 504, 507})
"""Statuses that say the request was not processed (rate limit, proxy, overload, restart, a
full disk: our API rolls back before it answers 507, ``api.storage``)."""


@dataclass(frozen=True)
class RetryPolicy:
    """How long to keep trying; the backoff numbers are the module's ``BASE_S``/``CAP_S``."""

    attempts: int | None = None
    """Most tries in all (the first one included); ``None``: no limit."""
    deadline_s: float | None = None
    """Give up once this many seconds have passed since the first failure; ``None``: never."""
    base_s: float = BASE_S
    cap_s: float = CAP_S

    def __post_init__(self) -> None:
        if self.attempts is not None and self.attempts < 1:
            raise ValueError(f"attempts must be at least 1, got {self.attempts}")
        if not 0 < self.base_s <= self.cap_s:
            raise ValueError(f"need 0 < base_s <= cap_s, got {self.base_s}, {self.cap_s}")

    def wait(self) -> tenacity.wait.wait_base:
        return tenacity.wait_exponential_jitter(
            multiplier=self.base_s, max=self.cap_s, jitter=self.base_s
        )


def is_transient(exc: BaseException, idempotent: bool = True) -> bool:
    """Worth retrying: the peer is down, slow, overloaded or restarting.

    A request that may have reached the server (a read timeout, a dropped connection, a 500)
    is only worth repeating when repeating it is harmless (``idempotent``); one that surely
    did not (refused connection, 429/502/503/504/507) always is.
    """
    if isinstance(exc, httpx.HTTPStatusError):
        code = exc.response.status_code
        return code in NOT_PROCESSED or (idempotent and code >= 500)
    if isinstance(exc, NEVER_SENT):
        return True
    if isinstance(exc, OUR_BUG):
        return False
    return idempotent and isinstance(exc, httpx.TransportError)


class _GiveUp(tenacity.stop.stop_base):
    """Stop after ``attempts`` tries or ``deadline_s`` after the first failure (one call)."""

    def __init__(self, policy: RetryPolicy, clock: Callable[[], float]) -> None:
        self.policy, self.clock = policy, clock
        self.first_failure: float | None = None

    def __call__(self, retry_state: tenacity.RetryCallState) -> bool:
        now = self.clock()
        if self.first_failure is None:
            self.first_failure = now
        p = self.policy
        if p.attempts is not None and retry_state.attempt_number >= p.attempts:
            return True
        return p.deadline_s is not None and now - self.first_failure >= p.deadline_s


def _kwargs(
    what: str,
    retryable: Callable[[BaseException], bool],
    policy: RetryPolicy,
    logger: logging.Logger,
    level: int,
    clock: Callable[[], float],
) -> dict[str, Any]:
    def before_sleep(state: tenacity.RetryCallState) -> None:
        e = state.outcome.exception() if state.outcome is not None else None
        why = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"  # one line
        next_try = f"retry {state.attempt_number} in {state.upcoming_sleep:.1f}s"
        logger.log(level, "%s failed (%s); %s", what, why, next_try)

    return {
        "retry": tenacity.retry_if_exception(lambda e: isinstance(e, Exception) and retryable(e)),
        "stop": _GiveUp(policy, clock),
        "wait": policy.wait(),
        "before_sleep": before_sleep,
        "reraise": True,
    }


def retry_call(
    fn: Callable[[], T],
    what: str,
    retryable: Callable[[BaseException], bool],
    policy: RetryPolicy,
    *,
    logger: logging.Logger = log,
    level: int = logging.WARNING,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """``fn()`` under ``policy``; the last error is raised when it gives up."""
    kwargs = _kwargs(what, retryable, policy, logger, level, clock)
    return tenacity.Retrying(sleep=sleep, **kwargs)(fn)


async def retry_call_async(
    fn: Callable[[], Awaitable[T]],
    what: str,
    retryable: Callable[[BaseException], bool],
    policy: RetryPolicy,
    *,
    logger: logging.Logger = log,
    level: int = logging.WARNING,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], Awaitable[None]] | None = None,
) -> T:
    """``await fn()`` under ``policy`` (backoffs are ``asyncio.sleep``: cancellable)."""
    kwargs = _kwargs(what, retryable, policy, logger, level, clock)
    if sleep is not None:
        kwargs["sleep"] = sleep
    return await tenacity.AsyncRetrying(**kwargs)(fn)
