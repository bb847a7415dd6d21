"""Running user code that may hang (a reward function, an environment) off the event loop.

``asyncio.to_thread`` would park such code on the default executor's few threads, and a hung call
would hold one forever. Each call here gets a new daemon thread instead: a timeout abandons the
call, and the thread dies with the process.
"""

from __future__ import annotations

import asyncio
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

    def target() -> None:
        try:
            result = fn()
        except BaseException as exc:  # noqa: BLE001 - delivered to the awaiting coroutine
            loop.call_soon_threadsafe(settle, future.set_exception, exc)
        else:
            loop.call_soon_threadsafe(settle, future.set_result, result)

    threading.Thread(target=target, name=name, daemon=True).start()
    return future
