"""What a Session's commands do to an engine, and what comes back to the sessions.

An add is decided at once (the admission policy; a refusal is a ``CommandError``), held in the
hub (so a duplicate in the same batch of commands is caught) and started in the engine between
steps. An abort ends the request between steps and confirms it with a final delta. A session
that goes away has its requests taken out of the engine, or, with ``keep_s``, kept running for a
successor manager, whose add continuing one adopts it. A weight swap loads between steps and
ends the requests the policy says a swap ends. A load names the job whose weights it loads: the
worker serves that job's requests from then on, and no request kept before it may be adopted
(a version is a job's, never a bare integer). All engine calls go through a
``StepLoop`` — the ``EnginePump``, or a service's own loop that keeps the same promise:
mutations run between steps.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable, Mapping
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import grpc

from rlharvest.common.engine_types import (
    EngineInputError,
    EngineRequest,
    RequestOutput,
    sampling_from_proto,
)
from rlharvest.common.errors import FailedPrecondition, InvalidArgument, NotFound
from rlharvest.common.pb import common_pb2, rollout_worker_pb2 as pb
from rlharvest.common.worker_core import metrics
from rlharvest.common.worker_core.admission import Admission, Wanted, WorkerView
from rlharvest.common.worker_core.engine import Engine
from rlharvest.common.worker_core.session_hub import (
    Adoption,
    Session,
    SessionHub,
    request_identity,
)

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)
T = TypeVar("T")


class StepLoop(Protocol):
    """What the commands need from the loop that steps the engine (``EnginePump`` has it)."""

    last_load: common_pb2.Load  # as of the last step boundary
    steps: int  # engine steps completed so far

    def between_steps(self, mutation: Callable[[], Awaitable[object]]) -> None: ...

    def run_between_steps(self, work: Callable[[], Awaitable[T]]) -> Awaitable[T]: ...

    def in_engine_thread(self, fn: Callable[..., T], *args: Any) -> Awaitable[T]: ...

    def snapshot_load(self) -> common_pb2.Load: ...


class SessionCommands:
    """``on_version_change`` is called with the new version after each weight swap.
    ``keep_s``: a broken session's requests run on this long for a successor manager to adopt
    (the hub must record tokens: ``SessionHub(keep_tokens=True)``); 0 takes them out at once.
    ``job``: whose weights the engine was built with ("" for none: a co-executor lent to no job,
    a placed worker before its node's turn); every load says whose it loads."""

    def __init__(self, engine: Engine, hub: SessionHub, loop: StepLoop, admission: Admission, *,
                 on_version_change: Callable[[int], None] | None = None,
                 keep_s: float = 0.0, job: str = "") -> None:
        self._engine = engine
        self._hub = hub
        hub.job = job
        self._loop = loop
        self._admission = admission
        self._on_version_change = on_version_change
        self._keep_s = keep_s

    @property
    def job(self) -> str:
        """Whose weights the engine holds."""
        return self._hub.job

    async def serve(self, commands: AsyncIterator[pb.WorkerCommand], job: str = ""
                    ) -> AsyncGenerator[pb.WorkerEvent, None]:
        """One Session stream of ``job``'s manager: read ``commands``, yield the session's
        events until it ends. Closing the iterator (the stream went away) takes the session's
        requests out, or keeps them for a successor of the same job."""
        session = self._hub.open(self._loop.last_load, job)
        reader = asyncio.create_task(self._read(commands, session))
        try:
            async for event in self._hub.events(session):
                yield event
        finally:
            reader.cancel()
            self._orphaned(session, self._hub.close(session))

    def _orphaned(self, session: Session, request_ids: list[str]) -> None:
        """A session went away holding ``request_ids``: kept for a successor when keeping is
        on, else taken out of the engine. Kept however it ended, with those that finished on it
        lately: a manager that dies ends its command stream just as a half-close does (and a
        manager never half-closes: it cancels a session it ends), and its last deltas may not
        have reached its client. What nobody adopts is dropped after ``keep_s``."""
        kept: set[str] = set()
        if self._keep_s > 0:
            loop = asyncio.get_running_loop()
            kept = set(self._hub.keep(session, request_ids, loop.time() + self._keep_s))
            if kept:
                log.info("session gone: keeping %d requests for %.0fs for a successor manager",
                         len(kept), self._keep_s)
                loop.call_later(self._keep_s, self._expire, kept)
        for rid in request_ids:
            if rid not in kept:
                self._loop.between_steps(partial(self._abort_orphan, rid))

    def _expire(self, request_ids: set[str]) -> None:
        now = asyncio.get_running_loop().time()
        for rid in self._hub.expired(request_ids, now):
            self._drop_kept(rid, "expired", now)

    def _drop_kept(self, rid: str, outcome: str, now: float | None = None) -> None:
        if not self._hub.forget_finished_kept(rid, outcome, now):
            self._loop.between_steps(partial(self._drop_running_kept, rid, outcome, now))

    async def _drop_running_kept(self, rid: str, outcome: str, now: float | None) -> None:
        if self._hub.release_kept(rid, outcome, now):
            await self._abort_in_engine(rid)
        else:  # it finished since (or was adopted: then this finds nothing)
            self._hub.forget_finished_kept(rid, outcome, now)

    def add(self, session: Session, msg: pb.AddRequest) -> None:
        if msg.job != session.job:  # a manager sends its own job's requests only
            return self._hub.refuse(session, msg.request_id, InvalidArgument(
                f"job: request is job {msg.job!r}'s on a session of job {session.job!r}"),
                msg.handle)
        identity = request_identity(msg) if self._hub.keeps_tokens else 0
        adoption = self._hub.adopt(session, msg.request_id, msg.generated_token_ids,
                                   msg.weight_version, identity, self._loop.last_load,
                                   msg.handle)
        if adoption is Adoption.ADOPTED:
            log.debug("request %s adopted with %d tokens", msg.request_id,
                      len(msg.generated_token_ids))
            return
        if adoption is Adoption.MISMATCH and \
                not self._hub.forget_finished_kept(msg.request_id, "mismatched"):
            # Still running: it leaves the engine between steps, and the manager's retry is an
            # ordinary add. (A finished one is forgotten at once: the add is a new request.)
            log.warning("request %s kept here, but its add does not continue it: dropped",
                        msg.request_id)
            self._drop_kept(msg.request_id, "mismatched")
            return self._hub.refuse(session, msg.request_id, FailedPrecondition(
                f"request {msg.request_id!r} is kept here with tokens its add does not "
                "continue; dropped it, send the add again"), msg.handle)
        request = EngineRequest(request_id=msg.request_id,
                                prompt_token_ids=list(msg.prompt_token_ids),
                                sampling=sampling_from_proto(msg.sampling),
                                generated_token_ids=list(msg.generated_token_ids))
        view = WorkerView(self._engine.weight_version, self._hub.held_ids(), self._hub.draining,
                          self._hub.job, self._engine.start_weights)
        wanted = Wanted(msg.job, msg.weight_version, msg.start_weights)
        refusal = self._admission.admit(request, wanted, view)
        if refusal is not None:
            return self._hub.refuse(session, request.request_id, refusal, msg.handle)
        self._hub.hold(session, request.request_id, len(request.generated_token_ids),
                       msg.weight_version, identity, msg.handle)
        self._loop.between_steps(partial(self._start, request))

    def abort(self, session: Session, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            if self._hub.is_kept(rid):  # a manager that will not adopt it (it runs elsewhere)
                self._drop_kept(rid, "refused")
                continue
            if not self._hub.owns(session, rid):
                self._hub.refuse(session, rid, NotFound(
                    f"no request {rid!r} of this session on this worker"))
                continue
            self._loop.between_steps(partial(self._abort_held, rid, self._loop.steps))

    def end_all(self) -> int:
        """End every request held, between steps, each confirmed by its final abort delta (a
        manager re-dispatches it with its tokens kept). Returns how many."""
        held = list(self._hub.held_ids())
        for rid in held:
            self._loop.between_steps(partial(self._abort_held, rid))
        return len(held)

    async def swap_weights(self, read: Callable[[], Mapping[str, torch.Tensor]], version: int,
                           source: str, job: str | None = None) -> int:
        """Between steps: ``read`` the tensors — ``job``'s weights (None: the job served now) —
        and load them in the engine thread, then end the requests the admission policy says a
        swap ends and drop every kept one. Returns the number of tensors loaded; raises what
        ``read`` or the engine raised (the engine then keeps its weights and its job). A caller
        that goes away leaves the swap to happen all the same."""
        return await self._loop.run_between_steps(
            lambda: self._swap(read, version, source, self._hub.job if job is None else job))

    def drop_kept(self, reason: str) -> None:
        """The worker's lending or turn changed: what it keeps for a successor manager of the
        job it served is no one's now, finished or running."""
        self._loop.between_steps(partial(self._drop_all_kept, reason))

    async def _drop_all_kept(self, outcome: str) -> None:
        told = bool(self._hub.kept_ids())  # some manager may have been told of them
        for rid in self._hub.drop_kept(outcome):
            if self._hub.release_kept(rid, outcome):
                await self._abort_in_engine(rid)
        if told:
            self._hub.announce_kept()  # each list replaces the last: they forget them

    # ---- between steps -------------------------------------------------------------------------

    async def _read(self, commands: AsyncIterator[pb.WorkerCommand], session: Session) -> None:
        try:
            async for command in commands:
                which = command.WhichOneof("command")
                if which == "add":
                    self.add(session, command.add)
                elif which == "abort":
                    self.abort(session, command.abort.request_ids)
                else:
                    self._hub.refuse(session, "", InvalidArgument(
                        "command has neither add nor abort set"))
        except grpc.aio.AioRpcError:
            return  # the stream broke: serve()'s caller sees it too and closes the session
        except grpc.aio.AbortError:
            pass  # a command that was no protobuf: refused (server_guard); the session winds down
        self._hub.client_done(session)

    async def _start(self, request: EngineRequest) -> None:
        rid = request.request_id
        held = self._hub.holder(rid)
        # Aborted, swapped out or orphaned meanwhile; a kept one runs on for a successor.
        if held is None or (held.session.closed and not self._hub.is_kept(rid)):
            return
        if held.job != self._hub.job:  # admitted for weights a load replaced since
            return self._hub.refuse_start(rid, FailedPrecondition(
                f"request {rid!r}: the worker loaded job {self._hub.job!r}'s weights before "
                f"it started; send it again"))
        try:
            # In the engine's thread, as its steps run: an engine in another process answers
            # after the step it is computing, and the event loop must not wait for that.
            await self._loop.in_engine_thread(self._engine.add, request)
        except EngineInputError as exc:
            return self._hub.refuse_start(rid, InvalidArgument(str(exc)))
        metrics.REQUESTS_ADDED.labels(str(bool(request.generated_token_ids)).lower()).inc()

    async def _abort_held(self, rid: str, arrived_at_step: int | None = None) -> None:
        if self._hub.holder(rid) is not None:  # else it finished meanwhile: its final delta went
            await self._end(rid)
            if arrived_at_step is not None:  # a manager's abort (a migration), not a drain's
                metrics.ABORT_WAIT_STEPS.observe(self._loop.steps - arrived_at_step)

    async def _end(self, rid: str) -> None:
        final = await self._abort_in_engine(rid)
        if final is None:  # held but not started in the engine yet: confirm all the same
            final = RequestOutput(rid, [], [], finished=True, finish_reason="abort")
        self._hub.end(final, self._engine.weight_version, self._loop.snapshot_load())

    async def _abort_orphan(self, rid: str) -> None:
        if self._hub.holder(rid) is None:
            return
        self._hub.release(rid, "abort")
        await self._abort_in_engine(rid)

    async def _abort_in_engine(self, rid: str) -> RequestOutput | None:
        """The engine's final output of ``rid``; None when it had not started or finished
        meanwhile."""
        try:
            return await self._loop.in_engine_thread(self._engine.abort, rid)
        except KeyError:
            return None

    async def _swap(self, read: Callable[[], Mapping[str, torch.Tensor]], version: int,
                    source: str, job: str) -> int:
        tensors = await self._loop.in_engine_thread(read)
        await self._loop.in_engine_thread(self._engine.load_weights, tensors, version)
        # At once, with the engine's version: an add arriving during the awaits below is fenced
        # against the weights the engine holds now, not the job before.
        changed_job, self._hub.job = self._hub.job != job, job
        ended = self._admission.on_weight_swap(version, self._hub.held_versions())
        for rid in ended:  # their final deltas name the job that admitted them (Held.job)
            await self._end(rid)
        await self._drop_all_kept("weights changed")
        if changed_job:
            log.info("now holding job %r's weights", job)
        self._loop.snapshot_load()  # GetInfo and /healthz report the new version at once
        metrics.WEIGHT_VERSION.set(version)
        log.info("loaded weights version %d from %s (%d tensors; %d requests of the old version "
                 "aborted)", version, source, len(tensors), len(ended))
        if self._on_version_change is not None:
            self._on_version_change(version)
        return len(tensors)
