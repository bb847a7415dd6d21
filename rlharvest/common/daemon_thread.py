"""Running user code that may hang (a reward function, an environment) off the event loop.

``asyncio.to_thread`` would park such code on the default executor's few threads, and a hung call
would hold one forever. Each call here gets a new daemon thread instead: a timeout abandons the
call, and the thread dies with the process.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import Any


def run_in_daemon_thread(fn: Callable[[], Any], name: str = "user-code") -> asyncio.Future:
    """Run ``fn`` on a new daemon thread; the future resolves on the caller's loop."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()

    def settle(setter: Callable[[Any], None], value: Any) -> None:
        if not future.done():  # it may have been cancelled by the timeout meanwhile
            setter(value)

    def deliver(setter: Callable[[Any], None], value: Any) -> None:
        # An abandoned call may return after its loop has closed (the caller timed out and
        # the program moved on): there is no one left to tell.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(settle, setter, value)

    def target() -> None:
        try:
            result = fn()
        except BaseException as exc:  # noqa: BLE001 - delivered to the awaiting coroutine
            deliver(future.set_exception, exc)
        else:
            deliver(future.set_result, result)

    threading.Thread(target=target, name=name, daemon=True).start()
    return future
