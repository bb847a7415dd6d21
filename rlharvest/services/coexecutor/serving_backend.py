"""Serving requests on an engine: the serving side of the co-executor, usable on its own.

``EngineServingBackend`` runs any ``Engine`` (the torch engine here, vLLM on GPUs) under the
worker core's ``EnginePump`` — steps in the engine's own thread, every add and abort between
steps — and hands each request's tokens to whoever awaits them (the OpenAI-compatible API).
A reader that is slow, or gone, never blocks the engine: tokens wait in the request's own queue
(a few bytes each, at most ``max_tokens`` of them), and a reader that stops (client
disconnect) aborts its request, which frees its KV at the next step boundary.

Stop tokens and ``min_tokens`` (vLLM's extension) are handled here rather than in the engine:
with ``min_tokens`` > 0 the engine generates without stop ids and this layer ends the request at
the first stop token at position >= ``min_tokens``. Deviation from vLLM, which masks stop tokens
out of sampling until ``min_tokens``: here one sampled earlier stays in the text as an ordinary
token. Trace replay uses ``ignore_eos`` (no stop ids at all), where the two agree.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol, cast

from rlharvest.common.engine_types import EngineInputError, EngineRequest, RequestOutput, SamplingParams
from rlharvest.common.errors import InvalidArgument, ResourceExhausted, Unavailable
from rlharvest.common.pb import common_pb2
from rlharvest.common.worker_core.engine import Engine
from rlharvest.common.worker_core.engine_pump import EnginePump, EngineStep
from rlharvest.services.coexecutor import metrics

log = logging.getLogger(__name__)


class Submitter(Protocol):
    """What serving adds requests to and aborts them from (an engine, or the co-executor's
    serving side)."""

    def add(self, request: EngineRequest) -> None: ...

    def abort(self, request_id: str) -> RequestOutput: ...


class ServingQueueFull(ResourceExhausted):
    """More requests wait than ``max_waiting``: answer 503 with Retry-After, shed nothing."""


class ServingStopped(Unavailable):
    """The engine stopped (shutdown) or failed: the request cannot be served here (a 503)."""


@dataclass(frozen=True)
class Generation:
    """Tokens a request produced since the last one, and why it ended (None: it goes on)."""

    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort"


@dataclass(frozen=True)
class ServingParams:
    sampling: SamplingParams
    min_tokens: int = 0


class EngineServingBackend:
    """Serves on ``engine``, stepped by a pump of its own — or, given ``pump``, by that one
    (the co-executor's, which steps both models): adds and aborts then go through it, the
    outputs come back through ``deliver``, and its owner runs its loop through
    ``run_pump`` so that the pump's end fails the requests waiting on it."""

    def __init__(self, engine: Submitter, *, max_waiting: int = 256,
                 pump: EnginePump | None = None,
                 slo: tuple[float, float] | None = None, step_delay_s: float = 0.0) -> None:
        self._slo = slo  # (TTFT, TPOT) seconds: finished requests count as met or not
        self._engine = engine
        self._own_pump = pump is None
        # Alone, ``engine`` is a whole Engine that this backend's own pump steps.
        # (``step_delay_s``, tests and benchmarks only: the own pump's emulated slower device.)
        self._pump: EnginePump = pump if pump is not None else EnginePump(
            cast(Engine, engine), self, step_delay_s=step_delay_s)
        self._max_waiting = max_waiting
        self._streams: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._ids = itertools.count(1)
        self._task: asyncio.Task | None = None
        self._running = False

    @property
    def in_flight(self) -> int:
        return len(self._streams)

    def start(self) -> None:
        self._running = True  # from now on: a request added before the first step waits for it
        if self._own_pump:  # else the owner runs the shared pump's loop through run_pump
            self._task = asyncio.get_running_loop().create_task(
                self.run_pump(self._pump.run), name="serving")

    @property
    def running(self) -> bool:
        return self._running

    async def run_pump(self, run: Callable[[], Awaitable[None]]) -> None:
        """Run the pump's loop (``run``: this backend's own pump's, or its owner's for a shared
        one, as the owner's engine loop). However it ends (cancelled at shutdown, or the engine
        failed), the requests waiting on it fail at once and new ones are refused: nothing
        would ever step them again."""
        self._running = True
        reason = "the serving engine stopped"
        try:
            await run()
        except Exception as exc:
            reason = f"the serving engine failed: {exc!r}"
            raise
        finally:
            self._stopped(reason)

    def _stopped(self, reason: str) -> None:
        """A stopped or broken engine fails every request in flight instead of leaving them
        waiting, and refuses new ones."""
        self._running = False
        for queue in self._streams.values():
            queue.put_nowait(ServingStopped(reason))

    async def close(self) -> None:
        self._running = False
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._own_pump:
            self._pump.close()

    async def generate(self, prompt_ids: Sequence[int],
                       params: ServingParams) -> AsyncGenerator[Generation, None]:
        """The request's tokens as the engine produces them; closing the iterator early (the
        client went away) aborts the request."""
        if not self.running:
            raise ServingStopped("the serving engine is not running")
        if len(self._streams) >= self._max_waiting:
            raise ServingQueueFull(f"{len(self._streams)} requests are in flight, the most "
                                   f"this server takes ({self._max_waiting}); retry shortly")
        rid = f"serve-{next(self._ids)}"
        stops = frozenset(params.sampling.stop_token_ids)
        sampling = replace(params.sampling, stop_token_ids=()) if params.min_tokens else \
            params.sampling
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._streams[rid] = queue
        metrics.IN_FLIGHT.set(len(self._streams))
        timing = _Timing(time.perf_counter(), self._slo)
        self._pump.between_steps(lambda: self._add(EngineRequest(rid, list(prompt_ids), sampling)))
        engine_done = False  # the engine ended it (else this layer did, or the reader left)
        produced = 0
        reason: str | None = None
        try:
            while reason is None:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                tokens, reason = item.new_token_ids, item.finish_reason or None
                if params.min_tokens and stops:
                    tokens, reason = _min_tokens_stop(tokens, reason, produced, stops,
                                                      params.min_tokens)
                if reason == "stop" and tokens and tokens[-1] in stops:
                    tokens = tokens[:-1]  # the stop token is not part of the text
                produced += len(item.new_token_ids)
                timing.tokens(len(item.new_token_ids))
                engine_done = item.finished
                reason = reason or ("length" if engine_done else None)
                yield Generation(tokens, reason)
        finally:
            self._streams.pop(rid, None)
            metrics.IN_FLIGHT.set(len(self._streams))
            timing.observe()
            if not engine_done:
                self._pump.between_steps(lambda: self._abort(rid))

    async def _add(self, request: EngineRequest) -> None:
        try:
            self._engine.add(request)
        except EngineInputError as exc:  # refused by the engine: the request's error, not ours
            queue = self._streams.get(request.request_id)
            if queue is not None:
                queue.put_nowait(InvalidArgument(str(exc)))

    async def _abort(self, request_id: str) -> None:
        try:
            self._engine.abort(request_id)
        except KeyError:
            pass  # it finished meanwhile

    # ---- StepSink ------------------------------------------------------------------------------

    def route(self, step: EngineStep) -> list[RequestOutput]:
        return step.outputs

    async def send(self, routed: list[RequestOutput]) -> None:
        self.deliver(routed)

    def deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs to the requests waiting for them (on the event loop)."""
        for out in outputs:
            queue = self._streams.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)

    def heartbeat(self, load: common_pb2.Load) -> None:
        pass


class _Timing:
    """TTFT and TPOT of one request, as the engine side sees them."""

    def __init__(self, started: float, slo: tuple[float, float] | None) -> None:
        self.started = started
        self.slo = slo
        self.first = self.last = 0.0
        self.count = 0

    def tokens(self, n: int) -> None:
        if n <= 0:
            return
        self.last = time.perf_counter()
        if not self.count:
            self.first = self.last
            metrics.TTFT.observe(self.first - self.started)
        self.count += n
        metrics.TOKENS.inc(n)

    def observe(self) -> None:
        tpot = (self.last - self.first) / (self.count - 1) if self.count >= 2 else 0.0
        if self.count >= 2:
            metrics.TPOT.observe(tpot)
        if self.slo is not None and self.count:
            met = self.first - self.started <= self.slo[0] and tpot <= self.slo[1]
            metrics.SLO.labels("yes" if met else "no").inc()


def _min_tokens_stop(tokens: list[int], reason: str | None, before: int, stops: frozenset[int],
                     min_tokens: int) -> tuple[list[int], str | None]:
    """End at the first stop token at position >= min_tokens (the engine ignores stops)."""
    for i, token in enumerate(tokens):
        if token in stops and before + i >= min_tokens:
            return tokens[:i + 1], "stop"
    return tokens, reason
