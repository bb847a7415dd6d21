"""run_in_daemon_thread: user code that may hang runs off the loop and may outlive it."""

from __future__ import annotations

import asyncio
import threading

import pytest

from rlharvest.common.daemon_thread import run_in_daemon_thread


def test_a_result_and_an_exception_reach_the_awaiting_coroutine():
    async def main():
        assert await run_in_daemon_thread(lambda: 42) == 42
        with pytest.raises(ZeroDivisionError):
            await run_in_daemon_thread(lambda: 1 / 0)

    asyncio.run(main())


def test_a_call_that_returns_after_its_loop_closed_raises_nothing_in_its_thread(monkeypatch):
    release, finished = threading.Event(), threading.Event()
    errors: list[BaseException] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: errors.append(args.exc_value))

    def slow() -> int:
        release.wait(10)
        finished.set()
        return 1

    async def main():
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(run_in_daemon_thread(slow, name="outlives-its-loop"), 0.05)

    asyncio.run(main())  # the loop is closed when this returns
    thread = next(t for t in threading.enumerate() if t.name == "outlives-its-loop")
    release.set()
    thread.join(10)
    assert finished.is_set() and errors == []
