"""asyncio helpers that keep a task's cancellation.

On Python < 3.12, ``asyncio.wait_for(event.wait(), timeout)`` returns normally when the task is
cancelled in the same loop iteration as the event is set: the cancellation is lost. A service
loop that waits that way (``while True: ...; wait_for(wake.wait(), tick)``) and is cancelled
at shutdown while a peer's shutdown sets its event (an etcd change) then runs on, and the
service's teardown waits for it until it is SIGKILLed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def wait_event(event: asyncio.Event, timeout: float | None) -> bool:
    """Whether ``event`` was set within ``timeout`` seconds. A cancellation of the caller
    always propagates, even one that arrives as the event is set."""
    if event.is_set():
        return True
    waiter = asyncio.ensure_future(event.wait())
    try:
        done, _ = await asyncio.wait({waiter}, timeout=timeout)
    finally:
        waiter.cancel()
    return bool(done)


async def wait_for(aw: Awaitable[T], timeout: float | None) -> T:
    """``asyncio.wait_for`` that never loses the caller's cancellation (see above): ``aw``'s
    result, or asyncio.TimeoutError once ``timeout`` seconds passed (``aw`` is cancelled)."""
    task = asyncio.ensure_future(aw)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout)
    except BaseException:
        task.cancel()
        raise
    if not done:
        task.cancel()
        await asyncio.wait({task})  # it winds down; a cancellation of ours meanwhile propagates
        raise asyncio.TimeoutError
    return task.result()
