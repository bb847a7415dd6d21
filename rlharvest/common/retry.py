"""Retry with exponential backoff: the one helper every service and client uses to ride out a
peer that restarts, a store that blips or a leader that fails over."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import grpc

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class Backoff:
    """Waits between tries: ``first_s`` after the first failure, times ``factor`` per failure,
    at most ``max_s``; each scaled by a random factor in [1 - jitter, 1 + jitter) so peers that
    failed together do not retry together."""

    first_s: float = 0.1
    max_s: float = 2.0
    factor: float = 2.0
    jitter: float = 0.5

    def delay(self, failures: int) -> float:
        """The wait after the ``failures``-th failure in a row (1, 2, ...)."""
        base = min(self.first_s * self.factor ** max(failures - 1, 0), self.max_s)
        return base * (1 - self.jitter + 2 * self.jitter * random.random())


async def retry(call: Callable[[], Awaitable[T]], *, retry_if: Callable[[Exception], bool],
                attempts: int | None = 5, deadline_s: float | None = None,
                backoff: Backoff = Backoff(), what: str = "call",
                on_retry: Callable[[Exception], Awaitable[None]] | None = None,
                log_each: bool = True) -> T:
    """``await call()`` until it returns, and return its result.

    After a failure ``retry_if`` accepts, wait the backoff (and ``await on_retry(exc)``, e.g. to
    drop a broken channel) and call again: at most ``attempts`` calls in all (None: no limit),
    and none after ``deadline_s`` seconds from now. The failure that ends the tries — the last
    one, or one ``retry_if`` refuses — propagates unchanged; cancellation always propagates.
    ``log_each=False``: the caller logs (once per outage, say), not each failure here."""
    if attempts is None and deadline_s is None:
        raise ValueError(f"retry of {what} needs attempts or deadline_s, or it never gives up")
    deadline = None if deadline_s is None else time.monotonic() + deadline_s
    failures = 0
    while True:
        try:
            return await call()
        except Exception as exc:
            failures += 1
            left = None if deadline is None else deadline - time.monotonic()
            if not retry_if(exc) or failures == attempts or (left is not None and left <= 0):
                raise
            delay = backoff.delay(failures)
            if left is not None:
                delay = min(delay, left)
            (log.warning if log_each else log.debug)(
                "%s failed (%s; attempt %d%s); retrying in %.2fs", what, _describe(exc),
                failures, f"/{attempts}" if attempts else "", delay)
            if on_retry is not None:
                await on_retry(exc)
        await asyncio.sleep(delay)


def _describe(exc: Exception) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):  # its str() is a multi-line dump
        return f"{exc.code().name}: {exc.details()}"
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:200]}" if text else type(exc).__name__
