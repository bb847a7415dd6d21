"""The session hub: a worker's manager sessions and the requests each one owns.

What a manager may rely on, whatever the engine or the admission policy:
- every event to a session goes through its ``Outbox``, in order; step outputs wait for room (a
  slow reader slows the engine), control events — refusals, abort confirmations, drain notices,
  the end of the session — are never dropped, and load heartbeats are dropped while it is backed
  up;
- a request's final delta decided between steps (an abort) goes out after the step outputs
  routed before it, so positions arrive in order;
- a session whose client half-closed ends once its last request ended;
- once draining, every session, open or opened later, gets the notice;
- with ``keep_s``, the requests of a session that broke (its manager died) run on, kept for a
  successor: a new session's add of one of them, carrying a prefix of its tokens, adopts it and
  gets every token beyond that prefix at once (``adopt``), so a manager's death regenerates
  nothing. Unadopted ones are dropped after ``keep_s``;
- kept requests belong to the job they were admitted for: only a session of that job
  (``Session.job``, the manager's job) hears of them or adopts them, and a weight load, a job
  switch or a lending change drops them all, finished ones too (``drop_kept``);
- every step message names the job whose weights produced it (``job``, set at each load).

The hub touches no engine: the pump hands it steps, and ``SessionCommands`` tells it which
requests start and end.
"""

from __future__ import annotations

import asyncio
import logging
import time
from array import array
from collections import deque
from collections.abc import AsyncIterator, Collection, Sequence
from dataclasses import dataclass, field
from enum import Enum

from rlharvest.common import delta_batch
from rlharvest.common.delta_batch import RowsBuilder
from rlharvest.common.engine_types import RequestOutput
from rlharvest.common.errors import ServiceError
from rlharvest.common.pb import common_pb2, rollout_worker_pb2 as pb
from rlharvest.common.worker_core import metrics
from rlharvest.common.worker_core.engine_pump import EngineStep
from rlharvest.common.worker_core.outbox import Outbox

log = logging.getLogger(__name__)

_DRAIN_POLL_S = 0.05
# How long a finished request's tokens stay with its session for a successor: far longer than
# a delta takes from the worker through the manager to the trainer.
_FINISHED_LINGER_S = 5.0


@dataclass(eq=False)
class Session:
    """One manager's stream. ``outbox`` yields None once the session has ended."""

    outbox: Outbox[pb.WorkerEvent | None]
    job: str = ""  # the job of the manager that opened it (its session metadata)
    requests: set[str] = field(default_factory=set)
    client_done: bool = False  # the manager half-closed: end once its requests have
    closed: bool = False  # the stream is gone: nothing more is queued
    # With keeping on: requests that finished here lately (when, id, record). Their last tokens
    # may not have reached the client when the manager dies, so those are kept too.
    finished: deque[tuple[float, str, Held]] = field(default_factory=deque)

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
    job: str = ""  # the job it was admitted for
    # With keeping on: every token (and logprob) this worker produced for it, from position
    # ``base`` (its admission's resume point) on, so a successor can be handed what it lacks.
    base: int = 0
    tokens: array[int] | None = None  # compact: kept for every request while keeping is on
    logprobs: array[float] = field(default_factory=lambda: array("f"))
    finish_reason: str = ""  # a kept request that finished while no session held it
    kept_until: float = 0.0  # kept: dropped once the event loop's clock passes this
    identity: int = 0  # of its prompt and sampling: an add adopts only the same request
    handle: int = 0  # the session's name for it on step outputs (AddRequest.handle)


class Adoption(Enum):
    ADOPTED = "adopted"  # the session holds it now and has been sent the tokens it lacked
    ABSENT = "absent"  # not kept here: admit the add as usual
    MISMATCH = "mismatch"  # kept, but the add's tokens do not continue it: dropped, refuse


@dataclass
class RoutedStep:
    """One engine step's outputs, routed to sessions, waiting to be encoded and sent."""

    step: EngineStep
    job: str  # whose weights computed it: a load between routing and sending changes the hub's
    items: list[tuple[Session, int, RequestOutput, int]] = field(default_factory=list)
    after: list[tuple[Session, pb.WorkerEvent]] = field(default_factory=list)  # see end()


class SessionHub:
    """``StepSink`` of the engine pump. ``session_queue``: step messages buffered per session
    before a slow reader slows the engine. ``keep_tokens``: record every request's tokens, so a
    broken session's requests can be kept for a successor (``keep``/``adopt``)."""

    def __init__(self, session_queue: int = 256, keep_tokens: bool = False) -> None:
        if session_queue < 1:
            raise ValueError(f"session_queue must be >= 1, got {session_queue}")
        self._session_queue = session_queue
        self._keep_tokens = keep_tokens
        self._sessions: set[Session] = set()
        self._held: dict[str, Held] = {}
        # Kept requests: running ones stay in _held under this closed session, finished ones
        # move to _kept_done (they hold no engine capacity) until adopted or dropped.
        self._orphanage = Session(Outbox(1), closed=True)
        self._kept_done: dict[str, Held] = {}
        self._unsent: RoutedStep | None = None
        self._last_step = 0
        self._drain_notice: pb.Draining | None = None
        # Whose weights the engine holds: set by every load (SessionCommands), named on every
        # step message, so a manager can tell one job's tokens from another's.
        self.job = ""

    # ---- sessions ------------------------------------------------------------------------------

    def open(self, hello: common_pb2.Load, job: str = "") -> Session:
        """A new session of ``job``'s manager; its first event is ``hello`` (after the requests
        this worker keeps for that job), then the drain notice if draining."""
        session = Session(Outbox(self._session_queue), job)
        self._sessions.add(session)
        metrics.SESSIONS.set(len(self._sessions))
        if kept := self.kept_ids(job):  # before the hello: the manager knows them once greeted
            session.push(pb.WorkerEvent(kept=pb.KeptRequests(request_ids=sorted(kept))))
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

    # ---- kept requests (a broken session's, for a successor manager) ---------------------------

    def keep(self, session: Session, request_ids: Collection[str], until: float) -> list[str]:
        """Keep these requests of a closed ``session`` running for a successor until ``until``
        (the event loop's clock), and those that finished on it lately; returns those kept. The
        caller drops them then (``expired``, ``release_kept``)."""
        kept = []
        for rid in request_ids:
            held = self._held.get(rid)
            if held is not None and held.tokens is not None:
                held.session, held.kept_until = self._orphanage, until
                kept.append(rid)
        recent = time.monotonic() - _FINISHED_LINGER_S
        for finished_at, rid, held in session.finished:
            if finished_at >= recent and rid not in self._held and rid not in self._kept_done:
                held.session, held.kept_until = self._orphanage, until
                self._kept_done[rid] = held
                kept.append(rid)
        session.finished.clear()
        metrics.KEPT.set(len(self.kept_ids()))
        if kept:  # a successor may have opened its session already (a handover on SIGTERM)
            self.announce_kept(session.job)  # another job's manager never hears of them
        return kept

    def kept_ids(self, job: str | None = None) -> list[str]:
        """The ids kept for a successor: all, or ``job``'s."""
        running = [rid for rid, held in self._held.items()
                   if held.session is self._orphanage and job in (None, held.job)]
        return running + [rid for rid, held in self._kept_done.items() if job in (None, held.job)]

    def drop_kept(self, outcome: str) -> list[str]:
        """The weights changed (a load, a job switch, a lending change): no kept request may be
        adopted any more. Finished ones, and the finished ones live sessions would keep if they
        broke, are forgotten now; returns the running ones, which the caller takes out of the
        engine (``release_kept``), then calls ``announce_kept``."""
        for rid in list(self._kept_done):
            self.forget_finished_kept(rid, outcome)
        for session in self._sessions:
            session.finished.clear()
        return [rid for rid, held in self._held.items() if held.session is self._orphanage]

    def announce_kept(self, job: str | None = None) -> None:
        """Every open session (of ``job``, when given) gets its job's kept list anew. Each list
        replaces the one before: one emptied by ``drop_kept`` tells the managers to forget what
        they were told."""
        for session in self._sessions:
            if job in (None, session.job):
                session.push(pb.WorkerEvent(kept=pb.KeptRequests(
                    request_ids=sorted(self.kept_ids(session.job)))))

    def is_kept(self, request_id: str) -> bool:
        held = self._held.get(request_id)
        return request_id in self._kept_done or (held is not None and
                                                 held.session is self._orphanage)

    def expired(self, request_ids: Collection[str], now: float) -> list[str]:
        """Those of ``request_ids`` still kept past their time (one adopted and kept again
        since runs to its own, later, time)."""
        return [rid for rid in request_ids if self.is_kept(rid) and
                (self._kept_done.get(rid) or self._held[rid]).kept_until <= now]

    def forget_finished_kept(self, request_id: str, outcome: str,
                             now: float | None = None) -> bool:
        """Forget a kept request that finished (nothing of it is in the engine), expired past
        ``now`` if given. False when it is not one: a running kept one leaves with the engine
        (``release_kept``)."""
        held = self._kept_done.get(request_id)
        if held is None or (now is not None and held.kept_until > now):
            return False
        del self._kept_done[request_id]
        metrics.KEPT_OUTCOMES.labels(outcome).inc()
        metrics.KEPT.set(len(self.kept_ids()))
        return True

    def release_kept(self, request_id: str, outcome: str, now: float | None = None) -> bool:
        """Between steps: release a running kept request (expired past ``now``, refused by a
        manager, or not continued by an add); True when the caller must now abort it in the
        engine, False when it was adopted (or finished) meanwhile. Done in one go with the
        engine's abort: released earlier, a step's tokens of it would go to a new holder."""
        held = self._held.get(request_id)
        if held is None or held.session is not self._orphanage or \
                (now is not None and held.kept_until > now):
            return False
        self.release(request_id, "abort")
        metrics.KEPT_OUTCOMES.labels(outcome).inc()
        metrics.KEPT_TOKENS_DROPPED.inc(len(held.tokens or ()))
        metrics.KEPT.set(len(self.kept_ids()))
        return True

    def adopt(self, session: Session, request_id: str, generated: Sequence[int],
              weight_version: int, identity: int, load: common_pb2.Load,
              handle: int = 0) -> Adoption:
        """An add of ``request_id`` with ``generated`` tokens on ``session``: if this worker
        keeps it for the session's job (same prompt and sampling: ``identity``) on the same
        version and ``generated`` is a prefix of what it produced, the session holds it from now
        on and gets the tokens beyond ``generated`` at once. Another job's request of the same
        id is not this one: ABSENT, and admission's job fence answers the add."""
        finished = self._kept_done.get(request_id)
        held = finished or self._held.get(request_id)
        if held is None or held.tokens is None or held.job != session.job or \
                held.job != self.job or \
                (finished is None and held.session is not self._orphanage):
            return Adoption.ABSENT  # not kept (or held by a live session: admission refuses)
        have, n = held.next_position, len(generated)
        if held.weight_version != weight_version or held.identity != identity or \
                not held.base <= n <= have or \
                array("i", generated[held.base:]) != held.tokens[:n - held.base]:
            return Adoption.MISMATCH
        done = self._kept_done.pop(request_id, None) is not None  # finished while kept
        held.handle = handle
        rows = RowsBuilder(weight_version)
        rows.add(handle, n, held.tokens[n - held.base:], held.logprobs[n - held.base:],
                 (held.finish_reason or "stop") if done else "")
        metrics.KEPT_OUTCOMES.labels("adopted").inc()
        metrics.KEPT_TOKENS_ADOPTED.inc(have - n)
        if done:  # in case this session breaks too before its client has the final delta
            self._linger(session, request_id, held)
        else:
            held.session = session
            session.requests.add(request_id)
        if have > n or done:  # with the load, as every step message (the manager reads it)
            session.push(_step_event(self._last_step, rows, load, held.job))
        metrics.KEPT.set(len(self.kept_ids()))
        return Adoption.ADOPTED

    # ---- requests ------------------------------------------------------------------------------

    def hold(self, session: Session, request_id: str, next_position: int,
             weight_version: int, identity: int = 0, handle: int = 0) -> None:
        """``session`` owns ``request_id`` from now on (admitted for the session's job; the
        engine may not have it yet). ``identity``: see ``request_identity``; ``handle``: its
        name on step outputs."""
        self._held[request_id] = Held(session, next_position, weight_version, session.job,
                                      next_position, array("i") if self._keep_tokens else None,
                                      identity=identity, handle=handle)
        session.requests.add(request_id)

    @property
    def keeps_tokens(self) -> bool:
        return self._keep_tokens

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
        if held.session is self._orphanage:  # ended kept (a weight swap, a drain's end_all)
            metrics.KEPT.set(len(self.kept_ids()))
        held.session.requests.discard(request_id)
        if finish_reason:
            metrics.REQUESTS_FINISHED.labels(finish_reason).inc()

    def end(self, final: RequestOutput, weight_version: int, load: common_pb2.Load) -> None:
        """Send a held request's final output (an abort's, decided between steps) to its session
        after the step outputs routed before it, and release the request."""
        held = self._held.get(final.request_id)
        if held is None:
            return
        rows = RowsBuilder(weight_version)
        rows.add(held.handle, held.next_position, final.new_token_ids, final.new_logprobs,
                 _end(final))
        event = _step_event(self._last_step, rows, load, held.job)
        self.release(final.request_id, final.finish_reason)
        self._last_word(held.session, event)

    def refuse(self, session: Session, request_id: str, error: ServiceError,
               handle: int = 0) -> None:
        """A refused command (an add's names its ``handle``): a ``CommandError`` to its session
        (never dropped)."""
        session.push(_refusal(request_id, error, handle))

    def refuse_start(self, request_id: str, error: ServiceError) -> None:
        """A held request the engine would not start: release it and refuse its add. Like
        ``end``, a request's last word: a half-closed session whose last request it was ends,
        after the step outputs routed before it."""
        held = self._held.get(request_id)
        if held is None:
            return
        self.release(request_id)
        self._last_word(held.session, _refusal(request_id, error, held.handle))

    def _last_word(self, session: Session, event: pb.WorkerEvent) -> None:
        """A released request's last event to its session, after the step outputs routed
        before it (``send`` pushes it after the step, then ends a half-closed session); at
        once when no step is unsent."""
        if self._unsent is not None:
            self._unsent.after.append((session, event))
        else:
            session.push(event)
            self._maybe_end(session)

    # ---- steps (the pump's sink) ---------------------------------------------------------------

    def route(self, step: EngineStep) -> RoutedStep:
        """Advance positions and release finished requests now, so mutations applied before the
        next step see the truth; encoding waits for ``send``."""
        routed = self._unsent = RoutedStep(step, self.job)
        self._last_step = step.number
        items, held_requests, orphanage = routed.items, self._held, self._orphanage
        for out in step.outputs:
            held = held_requests.get(out.request_id)
            if held is None:  # ended between the step's launch and now
                continue
            if held.tokens is not None:
                held.tokens.extend(out.new_token_ids)
                held.logprobs.extend(out.new_logprobs)
            if held.session is not orphanage:
                items.append((held.session, held.handle, out, held.next_position))
            held.next_position += len(out.new_token_ids)
            if out.finished:
                held.finish_reason = out.finish_reason
                if held.session is orphanage:  # kept for a successor, off the engine's books
                    self._kept_done[out.request_id] = held
                elif held.tokens is not None:
                    self._linger(held.session, out.request_id, held)
                self.release(out.request_id, out.finish_reason)
        return routed

    async def send(self, routed: RoutedStep) -> None:
        """One ``StepOutputs`` per session with deltas in the step, then the final deltas
        decided since it was routed."""
        step = routed.step
        version = step.weight_version
        by_session: dict[Session, RowsBuilder] = {}
        for session, handle, out, position in routed.items:
            rows = by_session.get(session)
            if rows is None:
                rows = by_session[session] = RowsBuilder(version)
            rows.add(handle, position, out.new_token_ids, out.new_logprobs, _end(out))
        for session, rows in by_session.items():
            if not session.closed:
                # Awaiting a full outbox is the backpressure: a slow reader slows the engine.
                await session.outbox.put(_step_event(step.number, rows, step.load, routed.job,
                                                     step.stats))
        if self._unsent is routed:
            self._unsent = None
        for session, event in routed.after:
            session.push(event)
        for session in {*by_session, *(session for session, _ in routed.after)}:
            self._maybe_end(session)

    @staticmethod
    def _linger(session: Session, request_id: str, held: Held) -> None:
        now = time.monotonic()
        finished = session.finished
        finished.append((now, request_id, held))
        while finished[0][0] < now - _FINISHED_LINGER_S:
            finished.popleft()

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
        # Kept requests are no session's: a successor adopts them elsewhere, not from here.
        while self._owned() and loop.time() < deadline:
            await asyncio.sleep(_DRAIN_POLL_S)
        left = self._owned()
        if left:
            log.warning("drain timed out with %d requests still here", left)
        return left == 0

    def _owned(self) -> int:
        return sum(1 for held in self._held.values() if held.session is not self._orphanage)

    def _maybe_end(self, session: Session) -> None:
        if session.client_done and not session.requests and not session.closed:
            session.push(None)


def request_identity(msg: pb.AddRequest) -> int:
    """What must match for an add to adopt a kept request: its prompt and sampling."""
    return hash((tuple(msg.prompt_token_ids), msg.sampling.SerializeToString(deterministic=True)))


def _end(out: RequestOutput) -> str:
    """A row's end: "" while the request goes on; an output finished without a reason ends
    as "stop" (the manager's reading of a bare "finished")."""
    return (out.finish_reason or "stop") if out.finished else ""


def _refusal(request_id: str, error: ServiceError, handle: int) -> pb.WorkerEvent:
    metrics.COMMAND_ERRORS.labels(error.code.name).inc()
    return pb.WorkerEvent(error=pb.CommandError(
        request_id=request_id, code=error.code.value[0], message=str(error), handle=handle))


def _step_event(number: int, rows: RowsBuilder, load: common_pb2.Load, job: str,
                stats: pb.EngineStepStats | None = None) -> pb.WorkerEvent:
    """One session's rows of a step (or an adoption's, or an abort's) with the load, named by
    the job whose weights produced them."""
    event = pb.WorkerEvent(step=pb.StepOutputs(step=number, load=load, stats=stats))
    delta_batch.encode(rows.build(), event.step.batch)
    event.step.batch.job = job
    return event
