"""One policy for etcd being away, in every service.

etcd restarts, fails over and stalls; none of that may stop a service. Every etcd call made from
a loop or a request path goes through ``with_etcd``: the call is retried with backoff while the
etcd client says it cannot reach etcd — by the type of its error (``etcd_away``: aetcd's
connection and timeout errors do not derive from ``ConnectionError``) — for as long as the
caller allows (by default until etcd answers). The outage is logged once when it starts and
once, with its duration, when etcd answers again; ``rlh_etcd_up`` says meanwhile that the process
is waiting for etcd. Errors etcd answers with (a compacted revision, a failed precondition, bad
credentials) are not outages and propagate at once.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import aetcd
from prometheus_client import Gauge

from rlharvest.common.retry import Backoff, retry

log = logging.getLogger(__name__)
T = TypeVar("T")

ETCD_UP = Gauge("rlh_etcd_up", "1 while this process reaches etcd; 0 during an outage it waits "
                "out (every etcd call retried until etcd answers)")
ETCD_UP.set(1)
BACKOFF = Backoff(first_s=0.2, max_s=2.0)

# OSError covers ConnectionError; asyncio.TimeoutError is an OSError only from Python 3.11 on,
# and this project runs on 3.10 too.
_AWAY = (aetcd.ConnectionFailedError, aetcd.ConnectionTimeoutError, OSError, asyncio.TimeoutError)


def etcd_away(exc: BaseException) -> bool:
    """Whether ``exc`` says etcd could not be reached (refused, reset, unresolvable, timed out):
    worth waiting for, unlike an answer etcd gave."""
    return isinstance(exc, _AWAY)


class _Outage:
    """This process's view of etcd: since when it is away (None: it answers)."""

    since: float | None = None


def etcd_failed(exc: BaseException, what: str) -> None:
    """An etcd call for ``what`` failed with ``exc``: an outage (``etcd_away``) is logged when
    it starts, not at every retry; any other failure is logged as it comes."""
    if not etcd_away(exc):
        log.warning("%s failed: %r", what, exc)
    elif _Outage.since is None:
        _Outage.since = time.monotonic()
        ETCD_UP.set(0)
        log.warning("etcd unreachable (%s: %s); waiting for it, every etcd call retried",
                    what, type(exc).__name__)


def tolerate(exc: Exception, what: str) -> None:
    """A loop that retries on its own schedule met ``exc``: an outage is noted (logged once),
    an answer etcd gave (an ``aetcd.ClientError``) logged, anything else raised again."""
    if not (etcd_away(exc) or isinstance(exc, aetcd.ClientError)):
        raise exc
    etcd_failed(exc, what)


def etcd_answered() -> None:
    """An etcd call succeeded: an outage under way has ended."""
    if _Outage.since is not None:
        log.warning("etcd answers again after %.1fs", time.monotonic() - _Outage.since)
        _Outage.since = None
        ETCD_UP.set(1)


async def with_etcd(call: Callable[[], Awaitable[T]], what: str,
                    deadline_s: float | None = None) -> T:
    """``await call()`` (one etcd operation, or a few that may be repeated), waiting out etcd
    being away for at most ``deadline_s`` (None: until it answers). Other errors propagate at
    once; so does the last outage error once ``deadline_s`` has passed."""
    async def attempt() -> T:
        try:
            result = await call()
        except Exception as exc:
            if etcd_away(exc):  # other errors propagate: their caller says what they mean
                etcd_failed(exc, what)
            raise
        etcd_answered()
        return result

    return await retry(attempt, retry_if=etcd_away, attempts=None,
                       deadline_s=math.inf if deadline_s is None else deadline_s,
                       backoff=BACKOFF, what=what, log_each=False)
