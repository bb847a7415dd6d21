"""One client's SubmitStep/Generate stream: its step's deltas and completions, merged while the
client is behind, with backpressure onto the worker streams beyond a bound."""

from __future__ import annotations

import asyncio
from collections import deque

from rlharvest.common.pb import rollout_manager_pb2 as mpb
from rlharvest.services.rollout_manager.step import Step

# One client event holds at most this many tokens (deltas + completions) so merged events stay far
# below any message size limit; more waiting output starts another event.
_MAX_EVENT_TOKENS = 1 << 16


class ClientStream:
    """One client's SubmitStep/Generate stream.

    Output waiting for the client is merged into the newest unsent event instead of queued as one
    event per worker step: a client that falls behind gets fewer, larger events, and the manager
    serializes fewer messages (bench/manager_relay.py). At most ``max_events`` events wait; a
    producer beyond that waits for the client (backpressure onto the worker streams).
    """

    def __init__(self, step: Step, max_events: int) -> None:
        self.step = step  # the core's step whose events this stream carries
        self._events: deque[tuple[mpb.StepEvent, list[int]]] = deque()  # event, [its tokens]
        self._max_events = max_events
        self._ready = asyncio.Event()
        self._room = asyncio.Event()
        self._room.set()
        self._ended = False
        self._detached = False  # its client went away; the step runs on (reattach.py)

    def _tail(self, tokens: int) -> mpb.StepEvent:
        if not self._events or self._events[-1][1][0] + tokens > _MAX_EVENT_TOKENS:
            self._events.append((mpb.StepEvent(), [0]))
            if len(self._events) >= self._max_events:
                self._room.clear()
        event, size = self._events[-1]
        size[0] += tokens
        self._ready.set()
        return event

    async def put_deltas(self, deltas: list, tokens: int) -> None:
        """Forward accepted wire deltas (copied into the event in C, not one by one)."""
        while not self._room.is_set():
            await self._room.wait()
        if not self._detached:
            self._tail(tokens).deltas.extend(deltas)

    def replay(self, deltas: list, tokens: int) -> None:
        """A re-attached client's first deltas (the tokens so far): never waits."""
        self._tail(tokens).deltas.extend(deltas)

    def put_completion(self, completion: mpb.Completion) -> None:
        """Never waits and never drops: a completion may exceed the event bound by one."""
        if not self._detached:
            self._tail(len(completion.token_ids)).completions.append(completion)

    def detach(self) -> None:
        """No client reads any more: output is dropped (the journal keeps the completions, the
        tracker the tokens) and no producer waits."""
        self._detached = True
        self._events.clear()
        self._room.set()

    def put_verdicts(self, verdicts: list[mpb.GroupVerdict]) -> None:
        if verdicts:
            self._tail(0).verdicts.extend(verdicts)

    def end(self, remote: mpb.RemoteTimings | None = None) -> None:
        """No more output; ``remote`` rides on the step's last event."""
        if remote is not None and not self._detached:
            self._tail(0).remote.CopyFrom(remote)
        self._ended = True
        self._ready.set()

    async def take(self) -> mpb.StepEvent | None:
        """The next event for the client; None once the step ended and everything was taken."""
        while not self._events:
            if self._ended:
                return None
            self._ready.clear()
            await self._ready.wait()
        event, _ = self._events.popleft()
        if len(self._events) < self._max_events:
            self._room.set()
        return event
