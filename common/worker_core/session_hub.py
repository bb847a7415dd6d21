"""The session hub: a worker's manager sessions and the requests each one owns.

What a manager may rely on, whatever the engine or the admission policy:
- every event to a session goes through its ``Outbox``, in order; step outputs wait for room (a
  slow reader slows the engine), control events — refusals, abort confirmations, drain notices,
  the end of the session — are never dropped, and load heartbeats are dropped while it is backed
  up;
- a request's final delta decided between steps (an abort) goes out after the step outputs
  routed before it, so positions arrive in order;
- a session whose client half-closed ends once its last request ended;
- once draining, every session, open or opened later, gets the notice.

The hub touches no engine: the pump hands it steps, and ``SessionCommands`` tells it which
requests start and end.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Collection
from dataclasses import dataclass, field

from rlharvest.common.engine_types import RequestOutput
from rlharvest.common.errors import ServiceError
from rlharvest.common.pb import common_pb2, rollout_worker_pb2 as pb
from rlharvest.common.worker_core import metrics
from rlharvest.common.worker_core.engine_pump import EngineStep
from rlharvest.common.worker_core.outbox import Outbox

log = logging.getLogger(__name__)

_DRAIN_POLL_S = 0.05


@dataclass(eq=False)
class Session:
    """One manager's stream. ``outbox`` yields None once the session has ended."""

    outbox: Outbox[pb.WorkerEvent | None]
    requests: set[str] = field(default_factory=set)
    client_done: bool = False  # the manager half-closed: end once its requests have
    closed: bool = False  # the stream is gone: nothing more is queued

    def offer(self, event: pb.WorkerEvent) -> None:
        """Heartbeats: dropped while the session is backed up (the next one supersedes)."""
        if not self.closed:
            self.outbox.offer(event)

    def push(self, event: pb.WorkerEvent | None) -> None:
        """Control events and the end of the session (None): never dropped, in order."""
        if not self.closed:
            self.outbox.push(event)


@dataclass
class Held:
    """A request the worker holds for a session, from admission to its final delta."""

    session: Session
    next_position: int  # completion index of the next token this worker will produce
    weight_version: int  # the version it was admitted for


@dataclass
class RoutedStep:
    """One engine step's outputs, routed to sessions, waiting to be encoded and sent."""

    step: EngineStep
    items: list[tuple[Session, RequestOutput, int]] = field(default_factory=list)
    after: list[tuple[Session, pb.WorkerEvent]] = field(default_factory=list)  # see end()


class SessionHub:
    """``StepSink`` of the engine pump. ``session_queue``: step messages buffered per session
    before a slow reader slows the engine."""

    def __init__(self, session_queue: int = 256) -> None:
        if session_queue < 1:
            raise ValueError(f"session_queue must be >= 1, got {session_queue}")
        self._session_queue = session_queue
        self._sessions: set[Session] = set()
        self._held: dict[str, Held] = {}
        self._unsent: RoutedStep | None = None
        self._last_step = 0
        self._drain_notice: pb.Draining | None = None

    # ---- sessions ------------------------------------------------------------------------------

    def open(self, hello: common_pb2.Load) -> Session:
        """A new session; its first event is ``hello``, then the drain notice if draining."""
        session = Session(Outbox(self._session_queue))
        self._sessions.add(session)
        metrics.SESSIONS.set(len(self._sessions))
        session.offer(pb.WorkerEvent(load=hello))
        if self._drain_notice is not None:
            session.push(pb.WorkerEvent(draining=self._drain_notice))
        return session

    async def events(self, session: Session) -> AsyncIterator[pb.WorkerEvent]:
        """The session's events, in order, until it ends."""
        while True:
            event = await session.outbox.get()
            if event is None:
                return
            yield event

    def client_done(self, session: Session) -> None:
        """The manager sends no more commands: end the session once its requests have ended."""
        session.client_done = True
        self._maybe_end(session)

    def close(self, session: Session) -> list[str]:
        """The stream is gone. Returns the ids it still holds: the caller takes them out of the
        engine and ``release``s them (the manager re-dispatches them elsewhere)."""
        session.closed = True
        self._sessions.discard(session)
        metrics.SESSIONS.set(len(self._sessions))
        session.outbox.clear()  # unblocks a pump awaiting room in this outbox
        return list(session.requests)

    @property
    def session_count(self) -> int:
        return len(self._sessions)

    # ---- requests ------------------------------------------------------------------------------

    def hold(self, session: Session, request_id: str, next_position: int,
             weight_version: int) -> None:
        """``session`` owns ``request_id`` from now on (admitted; the engine may not have it yet)."""
        self._held[request_id] = Held(session, next_position, weight_version)
        session.requests.add(request_id)

    def holder(self, request_id: str) -> Held | None:
        return self._held.get(request_id)

    def owns(self, session: Session, request_id: str) -> bool:
        held = self._held.get(request_id)
        return held is not None and held.session is session

    def held_ids(self) -> Collection[str]:
        """A live view of the ids held (running, queued or starting)."""
        return self._held.keys()

    def held_versions(self) -> dict[str, int]:
        """Request id -> the weight version it was admitted for."""
        return {rid: held.weight_version for rid, held in self._held.items()}

    def release(self, request_id: str, finish_reason: str = "") -> None:
        """The worker no longer holds ``request_id``; a finish reason counts it as finished."""
        held = self._held.pop(request_id, None)
        if held is None:
            return
        held.session.requests.discard(request_id)
        if finish_reason:
            metrics.REQUESTS_FINISHED.labels(finish_reason).inc()

    def end(self, final: RequestOutput, weight_version: int, load: common_pb2.Load) -> None:
        """Send a held request's final output (an abort's, decided between steps) to its session
        after the step outputs routed before it, and release the request."""
        held = self._held.get(final.request_id)
        if held is None:
            return
        delta = _token_delta(final, held.next_position, weight_version)
        event = pb.WorkerEvent(step=pb.StepOutputs(step=self._last_step, deltas=[delta], load=load))
        self.release(final.request_id, final.finish_reason)
        if self._unsent is not None:
            self._unsent.after.append((held.session, event))
        else:
            held.session.push(event)
            self._maybe_end(held.session)

    def refuse(self, session: Session, request_id: str, error: ServiceError) -> None:
        """A refused command: a ``CommandError`` to its session (never dropped)."""
        metrics.COMMAND_ERRORS.labels(error.code.name).inc()
        session.push(pb.WorkerEvent(error=pb.CommandError(
            request_id=request_id, code=error.code.value[0], message=str(error))))

    # ---- steps (the pump's sink) ---------------------------------------------------------------

    def route(self, step: EngineStep) -> RoutedStep:
        """Advance positions and release finished requests now, so mutations applied before the
        next step see the truth; encoding waits for ``send``."""
        routed = self._unsent = RoutedStep(step)
        self._last_step = step.number
        items, held_requests = routed.items, self._held
        for out in step.outputs:
            held = held_requests.get(out.request_id)
            if held is None:  # ended between the step's launch and now
                continue
            items.append((held.session, out, held.next_position))
            held.next_position += len(out.new_token_ids)
            if out.finished:
                self.release(out.request_id, out.finish_reason)
        return routed

    async def send(self, routed: RoutedStep) -> None:
        """One ``StepOutputs`` per session with deltas in the step, then the final deltas
        decided since it was routed."""
        step = routed.step
        version = step.weight_version
        by_session: dict[Session, list[common_pb2.TokenDelta]] = {}
        for session, out, position in routed.items:
            by_session.setdefault(session, []).append(_token_delta(out, position, version))
        for session, deltas in by_session.items():
            if not session.closed:
                # Awaiting a full outbox is the backpressure: a slow reader slows the engine.
                await session.outbox.put(pb.WorkerEvent(step=pb.StepOutputs(
                    step=step.number, deltas=deltas, load=step.load, stats=step.stats)))
        if self._unsent is routed:
            self._unsent = None
        for session, event in routed.after:
            session.push(event)
        for session in {*by_session, *(session for session, _ in routed.after)}:
            self._maybe_end(session)

    def heartbeat(self, load: common_pb2.Load) -> None:
        event = pb.WorkerEvent(load=load)
        for session in self._sessions:
            session.offer(event)

    # ---- drain ---------------------------------------------------------------------------------

    @property
    def draining(self) -> bool:
        return self._drain_notice is not None

    async def drain(self, timeout: float, reason: str) -> bool:
        """Tell every session to migrate its requests (admission refuses new ones from now on)
        and wait up to ``timeout`` for the worker to hold none. True when none were left."""
        self._drain_notice = pb.Draining(deadline_unix=time.time() + timeout, reason=reason)
        metrics.DRAINING.set(1)
        for session in self._sessions:
            session.push(pb.WorkerEvent(draining=self._drain_notice))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._held and loop.time() < deadline:
            await asyncio.sleep(_DRAIN_POLL_S)
        left = len(self._held)
        if left:
            log.warning("drain timed out with %d requests still here", left)
        return left == 0

    def _maybe_end(self, session: Session) -> None:
        if session.client_done and not session.requests and not session.closed:
            session.push(None)


def _token_delta(out: RequestOutput, position: int, weight_version: int) -> common_pb2.TokenDelta:
    """One request's output of a step (or its final abort output) on the wire."""
    return common_pb2.TokenDelta(
        request_id=out.request_id, position=position, token_ids=out.new_token_ids,
        logprobs=out.new_logprobs, weight_version=weight_version, finished=out.finished,
        finish_reason=out.finish_reason)
