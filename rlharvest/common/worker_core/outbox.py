"""The ordered queue of events from a worker to one manager session.

Three kinds of event share it and must keep their order (a request's abort confirmation may not
overtake its last step outputs):
- step outputs wait for room: a slow reader slows the engine (backpressure);
- control events — refusals, abort confirmations, drain notices, end of session — are never
  dropped, even past the bound: losing one leaves the manager waiting on a request forever or
  misses a drain before the worker exits;
- load heartbeats are dropped while the session is backed up: the next one supersedes them.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Generic, TypeVar

T = TypeVar("T")


class Outbox(Generic[T]):
    def __init__(self, maxsize: int):
        if maxsize < 1:
            raise ValueError(f"outbox size must be >= 1, got {maxsize}")
        self._items: deque[T] = deque()
        self._maxsize = maxsize
        self._readable = asyncio.Event()
        self._room = asyncio.Event()
        self._room.set()

    def __len__(self) -> int:
        return len(self._items)

    def full(self) -> bool:
        return len(self._items) >= self._maxsize

    async def put(self, item: T) -> None:
        """Wait for room, then append (step outputs)."""
        while self.full():
            self._room.clear()
            await self._room.wait()
        self._append(item)

    def push(self, item: T) -> None:
        """Append now, past the bound if need be (control events)."""
        self._append(item)

    def offer(self, item: T) -> bool:
        """Append if there is room (heartbeats); say whether it was taken."""
        if self.full():
            return False
        self._append(item)
        return True

    async def get(self) -> T:
        while not self._items:
            self._readable.clear()
            await self._readable.wait()
        item = self._items.popleft()
        if not self.full():
            self._room.set()
        return item

    def clear(self) -> None:
        """Drop everything and release waiting writers (the session is gone)."""
        self._items.clear()
        self._room.set()

    def _append(self, item: T) -> None:
        self._items.append(item)
        self._readable.set()
