"""The one retry helper: what it retries, when it gives up, and how long it waits."""

from __future__ import annotations

import asyncio
import time

import pytest

from rlharvest.common.retry import Backoff, retry

QUICK = Backoff(first_s=0.001, max_s=0.002, jitter=0.0)


class Flaky:
    """Fails with ``error`` the first ``failures`` calls, then returns the call count."""

    def __init__(self, failures: int, error: Exception) -> None:
        self.failures, self.error, self.calls = failures, error, 0

    async def __call__(self) -> int:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error
        return self.calls


async def test_retries_what_the_predicate_accepts_until_the_call_returns():
    call = Flaky(3, ConnectionError("peer restarting"))
    result = await retry(call, retry_if=lambda exc: isinstance(exc, ConnectionError),
                         attempts=5, backoff=QUICK)
    assert result == 4 and call.calls == 4


async def test_gives_up_after_the_attempts_with_the_last_failure_unchanged():
    error = ConnectionError("still down")
    call = Flaky(10, error)
    with pytest.raises(ConnectionError) as raised:
        await retry(call, retry_if=lambda exc: True, attempts=3, backoff=QUICK)
    assert raised.value is error and call.calls == 3


async def test_a_failure_the_predicate_refuses_is_raised_at_once():
    call = Flaky(10, ValueError("bad input"))
    with pytest.raises(ValueError, match="bad input"):
        await retry(call, retry_if=lambda exc: isinstance(exc, ConnectionError), attempts=5,
                    backoff=QUICK)
    assert call.calls == 1


async def test_no_try_starts_after_the_deadline():
    call = Flaky(1_000, TimeoutError("no leader"))
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        await retry(call, retry_if=lambda exc: True, attempts=None, deadline_s=0.2,
                    backoff=Backoff(first_s=0.05, max_s=0.05, jitter=0.0))
    assert 0.2 <= time.monotonic() - started < 1.0
    assert 3 <= call.calls <= 6


async def test_on_retry_runs_before_each_new_try():
    seen: list[str] = []

    async def forget(exc: Exception) -> None:
        seen.append(str(exc))

    await retry(Flaky(2, ConnectionError("x")), retry_if=lambda exc: True, attempts=3,
                backoff=QUICK, on_retry=forget)
    assert seen == ["x", "x"]


async def test_cancellation_is_never_retried():
    call_started = asyncio.Event()

    async def hangs() -> None:
        call_started.set()
        await asyncio.Event().wait()

    task = asyncio.create_task(retry(hangs, retry_if=lambda exc: True, attempts=None,
                                     deadline_s=60))
    await call_started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_retry_that_could_never_give_up_is_refused():
    with pytest.raises(ValueError, match="never gives up"):
        await retry(Flaky(0, ValueError()), retry_if=lambda exc: True, attempts=None)


def test_backoff_doubles_per_failure_up_to_its_cap_and_jitters_within_bounds():
    plain = Backoff(first_s=0.1, max_s=1.0, factor=2.0, jitter=0.0)
    assert [plain.delay(n) for n in range(1, 7)] == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0])
    jittered = Backoff(first_s=1.0, max_s=1.0, jitter=0.5)
    assert all(0.5 <= jittered.delay(3) < 1.5 for _ in range(200))
