"""A manager's view of a worker's Session stream, for tests: command builders, what came back
(``Collected``, which checks that positions arrive without a gap or a duplicate), and a session
driven in-process against the worker core (``InProcessSession``; the gRPC one is
``tests/integration/worker_client.WorkerSession``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import grpc

from rlharvest.common import delta_batch
from rlharvest.common.pb import common_pb2, rollout_worker_pb2 as pb
from rlharvest.common.worker_core.session_commands import SessionCommands


# Step outputs name requests by the handle their add gave (DeltaBatch.requests): one per id here.
_HANDLES: dict[str, int] = {}
_IDS: dict[int, str] = {}


def handle_of(request_id: str) -> int:
    if request_id not in _HANDLES:
        _HANDLES[request_id] = len(_HANDLES) + 1
        _IDS[_HANDLES[request_id]] = request_id
    return _HANDLES[request_id]


def id_of(handle: int) -> str:
    return _IDS[handle]


# The job a worker serves when it is not told one (rollout_worker/config.py: served_job).
DEFAULT_JOB = "default"


def add(request_id: str, prompt: list[int], max_tokens: int = 16, seed: int = 0,
        temperature: float = 1.0, version: int = 0, generated: list[int] | None = None,
        job: str = DEFAULT_JOB, start_weights: str = "", **sampling) -> pb.WorkerCommand:
    return pb.WorkerCommand(add=pb.AddRequest(
        request_id=request_id, prompt_token_ids=prompt, generated_token_ids=generated or [],
        weight_version=version, handle=handle_of(request_id), job=job,
        start_weights=start_weights,
        sampling=common_pb2.SamplingParams(temperature=temperature, max_tokens=max_tokens,
                                           seed=seed, **sampling)))


@dataclass(frozen=True)
class Delta:
    """One row of a step message, its request named by id."""

    request_id: str
    position: int
    token_ids: list[int]
    logprobs: list[float]
    weight_version: int
    finished: bool
    finish_reason: str


def deltas_of(step: pb.StepOutputs) -> list[Delta]:
    rows = delta_batch.decode(step.batch)
    return [Delta(id_of(r.request), r.position, r.token_ids, r.logprobs, rows.weight_version,
                  bool(r.end), r.end) for r in rows.iter()]


def abort(*request_ids: str) -> pb.WorkerCommand:
    return pb.WorkerCommand(abort=pb.AbortRequest(request_ids=list(request_ids)))


@dataclass
class Completion:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: set[int] = field(default_factory=set)
    finish_reason: str = ""
    deltas: int = 0


@dataclass
class Collected:
    completions: dict[str, Completion] = field(default_factory=dict)
    errors: dict[str, tuple[grpc.StatusCode, str]] = field(default_factory=dict)
    refused_handles: dict[str, int] = field(default_factory=dict)  # CommandError.handle
    step_messages: int = 0
    max_deltas_per_message: int = 0
    loads: list[common_pb2.Load] = field(default_factory=list)
    steps: list[pb.StepOutputs] = field(default_factory=list)  # every step message, in order
    draining: bool = False
    kinds: list[str] = field(default_factory=list)  # each event's kind, in order

    def absorb(self, event: pb.WorkerEvent) -> None:
        which = event.WhichOneof("event")
        self.kinds.append(which)
        if which == "step":
            self._absorb_step(event.step)
        elif which == "load":
            self.loads.append(event.load)
        elif which == "error":
            self.errors[event.error.request_id] = (status_code(event.error.code),
                                                   event.error.message)
            self.refused_handles[event.error.request_id] = event.error.handle
        elif which == "draining":
            self.draining = True

    def expect_resume(self, request_id: str, generated: list[int]) -> None:
        """A resumed request's deltas start at len(generated): seed the completion with them."""
        self.completions[request_id] = Completion(tokens=list(generated))

    def finished(self, request_ids) -> bool:
        """Every one of ``request_ids`` has its final delta or a refusal."""
        return all((r in self.completions and self.completions[r].finish_reason)
                   or r in self.errors for r in request_ids)

    def _absorb_step(self, step: pb.StepOutputs) -> None:
        self.step_messages += 1
        self.steps.append(step)
        rows = delta_batch.decode(step.batch)
        self.max_deltas_per_message = max(self.max_deltas_per_message, len(rows))
        self.loads.append(step.load)
        for row in rows.iter():
            rid = id_of(row.request)
            comp = self.completions.setdefault(rid, Completion())
            assert row.position == len(comp.tokens), \
                f"{rid}: gap or duplicate at {row.position} (have {len(comp.tokens)})"
            comp.tokens.extend(row.token_ids)
            comp.logprobs.extend(row.logprobs)
            comp.versions.add(rows.weight_version)
            comp.deltas += 1
            if row.end:
                comp.finish_reason = row.end


def status_code(value: int) -> grpc.StatusCode:
    return next(code for code in grpc.StatusCode if code.value[0] == value)


async def read_until(collected: Collected,
                     next_event: Callable[[], Awaitable[pb.WorkerEvent | None]],
                     done: Callable[[Collected], bool], timeout: float) -> Collected:
    """Absorb events from ``next_event()`` (an awaitable giving an event, or None at the end)
    until ``done(collected)`` holds or the stream ends."""
    async def loop() -> None:
        while not done(collected):
            event = await next_event()
            if event is None:
                return
            collected.absorb(event)
    await asyncio.wait_for(loop(), timeout)
    return collected


class InProcessSession:
    """One manager-like Session driven in-process against ``SessionCommands.serve``: the same
    protocol as over gRPC, without a process or a socket."""

    def __init__(self, commands: SessionCommands, job: str = DEFAULT_JOB) -> None:
        self._commands: asyncio.Queue[pb.WorkerCommand | None] = asyncio.Queue()
        self._events = commands.serve(self._command_stream(), job)
        self.collected = Collected()

    async def _command_stream(self) -> AsyncIterator[pb.WorkerCommand]:
        while (command := await self._commands.get()) is not None:
            yield command

    async def send(self, *commands: pb.WorkerCommand) -> None:
        for command in commands:
            self._commands.put_nowait(command)
        await asyncio.sleep(0)  # let the session's reader take them, as a write would

    def half_close(self) -> None:
        """The manager sends no more commands."""
        self._commands.put_nowait(None)

    async def next_event(self) -> pb.WorkerEvent | None:
        return await anext(self._events, None)

    async def read_until(self, done: Callable[[Collected], bool],
                         timeout: float = 30.0) -> Collected:
        return await read_until(self.collected, self.next_event, done, timeout)

    async def finish(self, request_ids, timeout: float = 30.0) -> Collected:
        ids = set(request_ids)
        return await self.read_until(lambda c: c.finished(ids), timeout)

    async def close(self) -> None:
        """The stream goes away (as when a manager dies)."""
        await self._events.aclose()
