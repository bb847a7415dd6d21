"""One client's SubmitStep/Generate stream: its step's deltas and completions, merged while the
client is behind, with backpressure onto the worker streams beyond a bound."""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field

from rlharvest.common import delta_batch
from rlharvest.common.delta_batch import Rows
from rlharvest.common.pb import rollout_manager_pb2 as mpb
from rlharvest.services.rollout_manager.step import Step

# One client event holds at most this many tokens (deltas + completions) so merged events stay far
# below any message size limit; more waiting output starts another event.
_MAX_EVENT_TOKENS = 1 << 16


@dataclass
class _Undelivered:
    """An event not yet taken: its rows as batches (joined once, when taken) and the rest."""

    event: mpb.StepEvent = field(default_factory=mpb.StepEvent)
    rows: list[Rows] = field(default_factory=list)
    tokens: int = 0

    def finish(self) -> mpb.StepEvent:
        if self.rows:
            delta_batch.encode(delta_batch.concat(self.rows), self.event.batch)
        return self.event


class ClientStream:
    """One client's SubmitStep/Generate stream.

    Output waiting for the client is merged into the newest unsent event instead of queued as one
    event per worker step: a client that falls behind gets fewer, larger events, and the manager
    serializes fewer messages (bench/manager_relay.py). At most ``max_events`` events wait,
    plus what producers queued before waiting: a producer beyond that queues its rows and then
    waits for the client (backpressure onto the worker streams).
    """

    def __init__(self, step: Step, max_events: int) -> None:
        self.step = step  # the core's step whose events this stream carries
        self._events: deque[_Undelivered] = deque()
        self._max_events = max_events
        self._ready = asyncio.Event()
        self._room = asyncio.Event()
        self._room.set()
        self._ended = False
        self._detached = False  # its client went away; the step runs on (reattach.py)

    def _tail(self, tokens: int) -> _Undelivered:
        # A completion after rows in the same event: the client reads rows first (trainer).
        if not self._events or self._events[-1].tokens + tokens > _MAX_EVENT_TOKENS:
            self._events.append(_Undelivered())
            if len(self._events) >= self._max_events:
                self._room.clear()
        undelivered = self._events[-1]
        undelivered.tokens += tokens
        self._ready.set()
        return undelivered

    def put_rows(self, rows: Rows) -> bool:
        """Queue accepted rows (requests named by their index in the step), now; True when the
        client was already ``max_events`` behind: the producer then waits in ``room`` before it
        reads on (backpressure onto its worker stream).

        Rows go in when the tracker accepts them, never after a wait: a producer waiting first
        could be overtaken by the rows that continue its own (a migrated request's next worker,
        resumed after the rows the tracker holds; its rows to another step's stream; a producer
        that came when room was made but before the waiter woke), and a waiting producer whose
        worker is lost has its read loop cancelled, which would drop rows the next worker
        resumed after. Either leaves the client a gap (the trainer's record breaks)."""
        behind = not self._room.is_set()
        if not self._detached:
            self._tail(len(rows.token_ids)).rows.append(rows)
        return behind

    async def room(self) -> None:
        """Until the client is less than ``max_events`` behind (or went away)."""
        while not self._room.is_set():
            await self._room.wait()

    def replay(self, rows: Rows) -> None:
        """A re-attached client's first rows (the tokens so far): never waits."""
        self._tail(len(rows.token_ids)).rows.append(rows)

    def put_completion(self, completion: mpb.Completion) -> None:
        """Never waits and never drops: a completion may exceed the event bound by one."""
        if not self._detached:
            self._tail(len(completion.token_ids)).event.completions.append(completion)

    def detach(self) -> None:
        """No client reads any more: output is dropped (the journal keeps the completions, the
        tracker the tokens) and no producer waits."""
        self._detached = True
        self._events.clear()
        self._room.set()

    def put_verdicts(self, verdicts: list[mpb.GroupVerdict]) -> None:
        if verdicts:
            self._tail(0).event.verdicts.extend(verdicts)

    def end(self, remote: mpb.RemoteTimings | None = None) -> None:
        """No more output; ``remote`` rides on the step's last event."""
        if remote is not None and not self._detached:
            self._tail(0).event.remote.CopyFrom(remote)
        self._ended = True
        self._ready.set()

    async def take(self) -> mpb.StepEvent | None:
        """The next event for the client; None once the step ended and everything was taken."""
        while not self._events:
            if self._ended:
                return None
            self._ready.clear()
            await self._ready.wait()
        undelivered = self._events.popleft()
        if len(self._events) < self._max_events:
            self._room.set()
        return undelivered.finish()
