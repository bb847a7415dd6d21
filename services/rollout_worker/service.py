"""The rollout worker's async shell: moves commands from manager sessions into the engine and
batched step outputs back out. The engine runs one step at a time in a dedicated thread; every
engine mutation (add, abort, weight load) is applied on the event loop between steps, so the engine
itself needs no locks."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import torch

from rlharvest.common.pb import common_pb2, rollout_worker_pb2 as pb, rollout_worker_pb2_grpc
from rlharvest.services.rollout_worker import metrics
from rlharvest.services.rollout_worker.outbox import Outbox
from rlharvest.common.engine_types import (
    EngineInputError,
    EngineRequest,
    RequestOutput,
    sampling_from_proto,
)
from rlharvest.services.rollout_worker.engine import Engine

log = logging.getLogger(__name__)

_IDLE_LOAD_PERIOD = 1.0  # an idle worker still reports load this often: the manager's heartbeat


@dataclass(eq=False)
class _Session:
    queue: Outbox
    requests: set[str] = field(default_factory=set)
    client_done: bool = False
    closed: bool = False

    def offer(self, event: pb.WorkerEvent) -> None:
        """Heartbeats: dropped while the session is backed up (the next one supersedes)."""
        if not self.closed:
            self.queue.offer(event)

    def push(self, event: pb.WorkerEvent | None) -> None:
        """Control events and the end of the session (None): never dropped, in order."""
        if not self.closed:
            self.queue.push(event)


@dataclass
class _Routed:
    """One engine step's outputs, routed to sessions, waiting to be encoded and sent."""

    step: int
    weight_version: int
    load: common_pb2.Load
    items: list[tuple[_Session, RequestOutput, int]] = field(default_factory=list)
    after: list[tuple[_Session, pb.WorkerEvent]] = field(default_factory=list)  # see _emit_after_step


@dataclass
class _Owned:
    session: _Session
    next_position: int  # completion index of the next token this worker will produce


class WorkerService(rollout_worker_pb2_grpc.RolloutWorkerServicer):
    def __init__(self, engine: Engine, worker_id: str, endpoint: str, model: str, kind: int,
                 capacity: int, max_len: int, session_queue: int = 256,
                 on_version_change: Callable[[int], None] | None = None,
                 step_delay_s: float = 0.0, max_pending: int = 4096):
        self._engine = engine
        self._info = dict(worker_id=worker_id, endpoint=endpoint, model=model, kind=kind,
                          capacity=capacity, max_len=max_len)
        self._session_queue = session_queue
        # Running plus queued requests this worker accepts; beyond it an add is refused with
        # RESOURCE_EXHAUSTED (the manager places the request elsewhere) instead of queueing
        # without bound.
        self._max_owned = capacity + max_pending
        self._on_version_change = on_version_change
        self._step_delay_s = step_delay_s  # benchmarks only: emulates slower hardware
        self._commands: deque[Callable[[], object]] = deque()
        self._owned: dict[str, _Owned] = {}
        self._sessions: set[_Session] = set()
        self._wakeup = asyncio.Event()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="engine")
        self._step = 0
        self._tokens_window: deque[tuple[float, int]] = deque()
        self.draining = False
        self._drain_deadline = 0.0
        self._drain_reason = ""
        self._last_load = common_pb2.Load()
        self._unsent: _Routed | None = None
        self._load_proto()  # the engine is idle at construction
        metrics.WEIGHT_VERSION.set(engine.weight_version)

    # ---- the engine loop -------------------------------------------------------------------

    async def run_engine(self) -> None:
        """Step N+1 computes in the engine thread while step N's outputs are encoded and sent:
        the engine is only ever touched (commands, load) between steps, never during one."""
        loop = asyncio.get_running_loop()
        running: asyncio.Future | None = None
        while True:
            if running is None:
                await self._apply_commands()
                if not self._engine.has_work():
                    await self._idle()
                    continue
                running = self._launch(loop)
            outputs = await running
            routed = self._unsent = self._route(outputs)
            await self._apply_commands()
            running = self._launch(loop) if self._engine.has_work() else None
            self._unsent = None
            await self._send(routed)
            if self._step_delay_s:
                await asyncio.sleep(self._step_delay_s)

    async def _apply_commands(self) -> None:
        while self._commands:
            await self._commands.popleft()()

    async def _idle(self) -> None:
        self._wakeup.clear()
        try:
            await asyncio.wait_for(self._wakeup.wait(), _IDLE_LOAD_PERIOD)
        except asyncio.TimeoutError:
            self._heartbeat()

    def _launch(self, loop: asyncio.AbstractEventLoop) -> asyncio.Future:
        started = time.perf_counter()

        def timed_step() -> list[RequestOutput]:
            outputs = self._engine.step()
            metrics.STEP_SECONDS.observe(time.perf_counter() - started)
            return outputs

        return loop.run_in_executor(self._executor, timed_step)

    def _emit_after_step(self, session: _Session, event: pb.WorkerEvent) -> None:
        """A delta decided by a command (abort) goes out after the step outputs routed before
        it, which are still unsent while commands run: positions must arrive in order."""
        if self._unsent is not None:
            self._unsent.after.append((session, event))
        else:
            session.push(event)

    def _enqueue(self, command: Callable[[], object]) -> None:
        self._commands.append(command)
        self._wakeup.set()

    def _route(self, outputs: list[RequestOutput]) -> _Routed:
        """Between steps: advance positions and release finished requests (so commands applied
        next see the truth), and capture what the protos need; encoding happens in _send."""
        metrics.ENGINE_STEPS.inc()
        self._step += 1
        routed = _Routed(self._step, self._engine.weight_version, self._load_proto())
        new_tokens = 0
        for out in outputs:
            owned = self._owned.get(out.request_id)
            if owned is None:
                continue
            new_tokens += len(out.new_token_ids)
            routed.items.append((owned.session, out, owned.next_position))
            owned.next_position += len(out.new_token_ids)
            if out.finished:
                self._release(out.request_id, out.finish_reason)
        metrics.TOKENS_GENERATED.inc(new_tokens)
        self._tokens_window.append((time.monotonic(), new_tokens))
        return routed

    async def _send(self, routed: _Routed) -> None:
        by_session: dict[_Session, list[common_pb2.TokenDelta]] = {}
        for session, out, position in routed.items:
            by_session.setdefault(session, []).append(common_pb2.TokenDelta(
                request_id=out.request_id, position=position, token_ids=out.new_token_ids,
                logprobs=out.new_logprobs, weight_version=routed.weight_version,
                finished=out.finished, finish_reason=out.finish_reason))
        for session, deltas in by_session.items():
            if not session.closed:
                # Awaiting a full queue is the backpressure: a slow reader slows the engine.
                await session.queue.put(pb.WorkerEvent(step=pb.StepOutputs(
                    step=routed.step, deltas=deltas, load=routed.load)))
        for session, event in routed.after:
            session.push(event)
        for session in {*by_session, *(session for session, _ in routed.after)}:
            self._maybe_end(session)

    def _delta(self, out: RequestOutput, owned: _Owned) -> common_pb2.TokenDelta:
        return common_pb2.TokenDelta(
            request_id=out.request_id, position=owned.next_position,
            token_ids=out.new_token_ids, logprobs=out.new_logprobs,
            weight_version=self._engine.weight_version, finished=out.finished,
            finish_reason=out.finish_reason)

    def _release(self, request_id: str, reason: str) -> None:
        owned = self._owned.pop(request_id, None)
        if owned is not None:
            owned.session.requests.discard(request_id)
            metrics.REQUESTS_FINISHED.labels(reason).inc()

    def _heartbeat(self) -> None:
        event = pb.WorkerEvent(load=self._load_proto())
        for session in self._sessions:
            session.offer(event)

    # ---- commands ----------------------------------------------------------------------------

    def _refuse(self, session: _Session, request_id: str, code: grpc.StatusCode, message: str) -> None:
        metrics.COMMAND_ERRORS.labels(code.name).inc()
        session.push(pb.WorkerEvent(error=pb.CommandError(
            request_id=request_id, code=code.value[0], message=message)))

    def _add(self, session: _Session, msg: pb.AddRequest) -> None:
        rid = msg.request_id
        if self.draining:
            return self._refuse(session, rid, grpc.StatusCode.UNAVAILABLE,
                                "worker is draining before shutdown; dispatch elsewhere")
        if not rid:
            return self._refuse(session, rid, grpc.StatusCode.INVALID_ARGUMENT, "empty request_id")
        if msg.weight_version != self._engine.weight_version:
            return self._refuse(session, rid, grpc.StatusCode.FAILED_PRECONDITION,
                                f"request wants weight version {msg.weight_version}, this worker "
                                f"holds {self._engine.weight_version}")
        if rid in self._owned:
            return self._refuse(session, rid, grpc.StatusCode.ALREADY_EXISTS,
                                f"request id {rid!r} is already running on this worker")
        if len(self._owned) >= self._max_owned:
            return self._refuse(session, rid, grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"worker holds {len(self._owned)} requests, its limit of running "
                                f"plus pending; dispatch elsewhere")
        request = EngineRequest(request_id=rid, prompt_token_ids=list(msg.prompt_token_ids),
                                sampling=sampling_from_proto(msg.sampling),
                                generated_token_ids=list(msg.generated_token_ids))
        # Reserve the id now so a duplicate in the same batch of commands is caught.
        self._owned[rid] = _Owned(session, len(request.generated_token_ids))
        session.requests.add(rid)

        async def apply() -> None:
            if session.closed or self._owned.get(rid) is None:
                return
            if msg.weight_version != self._engine.weight_version:  # a load slipped in between
                self._drop(rid)
                return self._refuse(session, rid, grpc.StatusCode.FAILED_PRECONDITION,
                                    f"weights changed to {self._engine.weight_version} before "
                                    f"request {rid!r} started")
            try:
                self._engine.add(request)
            except EngineInputError as exc:
                self._drop(rid)
                return self._refuse(session, rid, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            metrics.REQUESTS_ADDED.labels(str(bool(request.generated_token_ids)).lower()).inc()
            metrics.PREFILL_TOKENS.inc(len(request.prompt_token_ids) + len(request.generated_token_ids))

        self._enqueue(apply)

    def _drop(self, rid: str) -> None:
        owned = self._owned.pop(rid, None)
        if owned is not None:
            owned.session.requests.discard(rid)

    def _abort(self, session: _Session, request_ids: list[str]) -> None:
        for rid in request_ids:
            owned = self._owned.get(rid)
            if owned is None or owned.session is not session:
                self._refuse(session, rid, grpc.StatusCode.NOT_FOUND,
                             f"no request {rid!r} of this session on this worker")
                continue

            async def apply(rid: str = rid) -> None:
                owned = self._owned.get(rid)
                if owned is None:  # finished meanwhile: its final delta already went out
                    return
                try:
                    final = self._engine.abort(rid)
                except KeyError:  # aborted before the engine saw it: confirm all the same
                    final = RequestOutput(rid, [], [], finished=True, finish_reason="abort")
                delta = self._delta(final, owned)
                self._release(rid, "abort")
                self._emit_after_step(owned.session, pb.WorkerEvent(step=pb.StepOutputs(
                    step=self._step, deltas=[delta], load=self._load_proto())))
                self._maybe_end(owned.session)

            self._enqueue(apply)

    # ---- RPCs --------------------------------------------------------------------------------

    async def Session(self, request_iterator: AsyncIterator[pb.WorkerCommand],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[pb.WorkerEvent]:
        session = _Session(Outbox(self._session_queue))
        self._sessions.add(session)
        metrics.SESSIONS.set(len(self._sessions))
        reader = asyncio.create_task(self._read(request_iterator, session))
        try:
            session.offer(pb.WorkerEvent(load=self._last_load))
            if self.draining:
                session.push(self._draining_event())
            while True:
                event = await session.queue.get()
                if event is None:
                    return
                yield event
        finally:
            reader.cancel()
            self._close(session)

    async def _read(self, commands: AsyncIterator[pb.WorkerCommand], session: _Session) -> None:
        try:
            async for command in commands:
                which = command.WhichOneof("command")
                if which == "add":
                    self._add(session, command.add)
                elif which == "abort":
                    self._abort(session, list(command.abort.request_ids))
                else:
                    self._refuse(session, "", grpc.StatusCode.INVALID_ARGUMENT,
                                 "command has neither add nor abort set")
        except (asyncio.CancelledError, grpc.aio.AioRpcError):
            return
        session.client_done = True
        self._maybe_end(session)

    def _maybe_end(self, session: _Session) -> None:
        """A session whose client half-closed ends once its last request finished."""
        if session.client_done and not session.requests and not session.closed:
            session.push(None)

    def _close(self, session: _Session) -> None:
        """The manager went away: abort its requests (it re-dispatches them elsewhere)."""
        session.closed = True
        self._sessions.discard(session)
        metrics.SESSIONS.set(len(self._sessions))
        session.queue.clear()  # unblocks an engine loop awaiting put() on this queue
        for rid in list(session.requests):
            self._enqueue(lambda rid=rid: self._abort_orphan(rid))

    async def _abort_orphan(self, rid: str) -> None:
        if self._owned.pop(rid, None) is None:
            return
        try:
            self._engine.abort(rid)
            metrics.REQUESTS_FINISHED.labels("abort").inc()
        except KeyError:
            pass

    async def GetInfo(self, request: pb.GetInfoRequest, context) -> pb.WorkerInfo:
        return pb.WorkerInfo(**self._info, vocab_size=self._engine.vocab_size,
                             weight_version=self._engine.weight_version, load=self._last_load,
                             draining=self.draining)

    async def LoadWeights(self, request: pb.LoadWeightsRequest, context) -> pb.LoadWeightsResponse:
        path = Path(request.path)
        if not request.path or not path.is_file():
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no weights file at {request.path!r}")
        if request.version < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "version must be >= 0")
        done: asyncio.Future = asyncio.get_running_loop().create_future()

        async def apply() -> None:
            try:
                done.set_result(await self.load_weights_file(path, request.version))
            except Exception as exc:  # surfaced to the caller as a status below
                done.set_exception(exc)

        self._enqueue(apply)
        try:
            count = await done
        except EngineInputError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except Exception as exc:  # e.g. not a safetensors file: the worker keeps its weights
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"could not load {request.path!r}: {exc}")
        return pb.LoadWeightsResponse(weight_version=self._engine.weight_version,
                                      tensors_loaded=count)

    async def load_weights_file(self, path: Path, version: int) -> int:
        """Between steps: load, then abort requests of the old version — continuing them would
        mix weight versions inside one completion (the on-policy invariant)."""
        from safetensors.torch import load_file

        loop = asyncio.get_running_loop()
        tensors = await loop.run_in_executor(self._executor, load_file, str(path))
        return await self._swap_weights(tensors, version, str(path))

    async def load_weights_tensors(self, tensors: Mapping[str, torch.Tensor], version: int) -> int:
        """Load an in-memory tensor dict (a pull from a transfer agent) between engine steps;
        returns the number of tensors loaded. Raises EngineInputError, loading nothing, when a
        name, shape or value does not fit the model."""
        done: asyncio.Future = asyncio.get_running_loop().create_future()

        async def apply() -> None:
            try:
                done.set_result(await self._swap_weights(tensors, version, "a transfer agent"))
            except Exception as exc:  # handed to the awaiting caller
                done.set_exception(exc)

        self._enqueue(apply)
        return await done

    async def _swap_weights(self, tensors: Mapping[str, torch.Tensor], version: int,
                            path: str) -> int:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._executor, self._engine.load_weights, tensors, version)
        stale = list(self._owned)
        for rid in stale:
            owned = self._owned[rid]
            final = self._engine.abort(rid)
            self._emit_after_step(owned.session, pb.WorkerEvent(step=pb.StepOutputs(
                step=self._step, deltas=[self._delta(final, owned)], load=self._load_proto())))
            self._release(rid, "abort")
        self._load_proto()  # GetInfo and /healthz report the new version at once
        metrics.WEIGHT_VERSION.set(version)
        log.info("loaded weights version %d from %s (%d tensors; %d requests of the old version "
                 "aborted)", version, path, len(tensors), len(stale))
        if self._on_version_change is not None:
            self._on_version_change(version)
        return len(tensors)

    # ---- load and drain ----------------------------------------------------------------------

    def _load_proto(self) -> common_pb2.Load:
        """Read the engine's load; only between steps (the engine is not thread-safe). RPCs that
        come at any time read ``_last_load``, the value of the last step boundary."""
        load = self._engine.load()
        metrics.PENDING.set(load.pending)
        metrics.EXECUTING.set(load.executing)
        metrics.KV_USED.set(load.kv_used_tokens)
        self._last_load = common_pb2.Load(pending=load.pending, executing=load.executing,
                                          kv_used_tokens=load.kv_used_tokens,
                                          kv_capacity_tokens=load.kv_capacity_tokens,
                                          weight_version=load.weight_version,
                                          tokens_per_second=self._tokens_per_second())
        return self._last_load

    def _tokens_per_second(self, window: float = 5.0) -> float:
        now = time.monotonic()
        while self._tokens_window and self._tokens_window[0][0] < now - window:
            self._tokens_window.popleft()
        if len(self._tokens_window) < 2:
            return 0.0
        span = now - self._tokens_window[0][0]
        return sum(n for _, n in self._tokens_window) / max(span, 1e-3)

    def _draining_event(self) -> pb.WorkerEvent:
        return pb.WorkerEvent(draining=pb.Draining(deadline_unix=self._drain_deadline,
                                                   reason=self._drain_reason))

    async def drain(self, timeout: float, reason: str = "worker shutting down") -> bool:
        """Refuse new work, tell every manager to migrate, and wait for the requests to leave.
        Returns True when none were left behind."""
        self.draining = True
        self._drain_reason = reason
        metrics.DRAINING.set(1)
        self._drain_deadline = time.time() + timeout
        for session in self._sessions:
            session.push(self._draining_event())
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._owned and loop.time() < deadline:
            await asyncio.sleep(0.05)
        left = len(self._owned)
        if left:
            log.warning("drain timed out with %d requests still here", left)
        return left == 0

    def set_endpoint(self, endpoint: str) -> None:
        self._info["endpoint"] = endpoint

    def health(self) -> dict:
        load = self._last_load
        return {"status": "ok", "draining": self.draining, "weight_version": load.weight_version,
                "pending": load.pending, "executing": load.executing,
                "sessions": len(self._sessions)}

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
