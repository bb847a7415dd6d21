"""The engine pump: runs an engine's steps in a dedicated thread, pipelined, and hands each
step's outputs to a sink (the session hub).

Step N+1 computes in the engine thread while step N's outputs are encoded and sent, and every
engine mutation (add, abort, weight load) runs on the event loop between steps, so the engine
needs no locks. Each step is measured around ``engine.step()`` — batch size, wall time, decoded
and prefilled tokens — and that true sample of the batching profile travels with its outputs.
``bench/worker_delivery.py`` measures what this loop costs against the bare engine.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from rlharvest.common.aio import wait_event
from rlharvest.common.engine_types import EngineLoad, RequestOutput
from rlharvest.common.pb import common_pb2, rollout_worker_pb2 as pb
from rlharvest.common.worker_core import metrics
from rlharvest.common.worker_core.engine import Engine, SelfTimed

T = TypeVar("T")
R = TypeVar("R")
# A step as the engine thread hands it over: outputs, seconds, prefill tokens, weight version.
TimedStep = tuple[list[RequestOutput], float, int, int]

_TOKEN_RATE_WINDOW_S = 5.0


@dataclass(frozen=True)
class EngineStep:
    """One engine step as the pump hands it on: numbered from 1, with the weight version that
    produced it, the engine's load right after it and its measured stats."""

    number: int
    outputs: list[RequestOutput]
    weight_version: int
    load: common_pb2.Load
    stats: pb.EngineStepStats


class StepSink(Protocol[R]):
    """Where steps go. ``route`` runs between steps, before queued mutations are applied (so they
    see requests the step finished as finished); ``send`` runs while the next step computes, and
    awaiting in it is backpressure on the engine."""

    def route(self, step: EngineStep) -> R: ...

    async def send(self, routed: R) -> None: ...

    def heartbeat(self, load: common_pb2.Load) -> None:
        """An idle engine's load, every ``heartbeat_s``."""
        ...


class EnginePump(Generic[R]):
    """``step_delay_s`` (benchmarks only) sleeps after each step to emulate slower hardware."""

    def __init__(self, engine: Engine, sink: StepSink[R], *, step_delay_s: float = 0.0,
                 heartbeat_s: float = 1.0) -> None:
        self._engine = engine
        self._timing = engine if isinstance(engine, SelfTimed) else None
        self._sink = sink
        self._step_delay_s = step_delay_s
        self._heartbeat_s = heartbeat_s
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="engine")
        self._mutations: deque[Callable[[], Awaitable[object]]] = deque()
        self._wakeup = asyncio.Event()
        self._token_counts: deque[tuple[float, int]] = deque()
        self._token_sum = 0  # of the counts in the window: kept, not summed every step
        self.steps = 0  # engine steps run so far
        self.last_load = common_pb2.Load()  # as of the last step boundary; readable any time
        self._last_prefix = EngineLoad(0, 0, 0, 0, 0)  # prefix-cache totals at the last snapshot
        self.snapshot_load()  # the engine is idle at construction

    async def run(self) -> None:
        """Step while there is work, forever. An exception from the engine or a mutation ends
        it: a broken engine must not look like a healthy worker."""
        loop = asyncio.get_running_loop()
        running: asyncio.Future[TimedStep] | None = None
        while True:
            if running is None:
                await self._apply_mutations()
                if not self._engine.has_work():
                    await self._idle()
                    continue
                running = self._launch(loop)
            routed = self._sink.route(self._record(*await running))
            await self._apply_mutations()
            running = self._launch(loop) if self._engine.has_work() else None
            await self._sink.send(routed)
            if self._step_delay_s:
                await asyncio.sleep(self._step_delay_s)

    def between_steps(self, mutation: Callable[[], Awaitable[object]]) -> None:
        """Run ``mutation`` on the event loop before the next step launches, after those queued
        before it. It may touch the engine (and await ``in_engine_thread``)."""
        self._mutations.append(mutation)
        self._wakeup.set()

    async def run_between_steps(self, work: Callable[[], Awaitable[T]]) -> T:
        """``between_steps(work)`` and its result (or exception). If the caller goes away the
        work still runs: it was queued."""
        done: asyncio.Future[T] = asyncio.get_running_loop().create_future()

        async def run() -> None:
            try:
                value = await work()
            except Exception as exc:  # handed to the awaiting caller
                if not done.done():
                    done.set_exception(exc)
                return
            if not done.done():
                done.set_result(value)

        self.between_steps(run)
        return await done

    async def in_engine_thread(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a blocking engine call in the engine's thread (only from a mutation)."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def snapshot_load(self) -> common_pb2.Load:
        """Read the engine's load, update the gauges and ``last_load``; only between steps (the
        engine is not thread-safe)."""
        load = self._engine.load()
        metrics.PENDING.set(load.pending)
        metrics.EXECUTING.set(load.executing)
        metrics.KV_USED.set(load.kv_used_tokens)
        # The engine reports a total; the counter takes what is new since the last snapshot.
        metrics.PREEMPTIONS.inc(max(0, load.preemptions - self.last_load.preemptions))
        self._count_prefix_cache(load)
        self.last_load = common_pb2.Load(pending=load.pending, executing=load.executing,
                                         kv_used_tokens=load.kv_used_tokens,
                                         kv_capacity_tokens=load.kv_capacity_tokens,
                                         weight_version=load.weight_version,
                                         tokens_per_second=self._tokens_per_second(),
                                         preemptions=load.preemptions)
        return self.last_load

    def _count_prefix_cache(self, load: EngineLoad) -> None:
        """The engine reports totals; the counters take what is new since the last snapshot."""
        last = self._last_prefix
        metrics.PREFIX_LOOKUPS.inc(max(0, load.prefix_lookups - last.prefix_lookups))
        metrics.PREFIX_HITS.inc(max(0, load.prefix_hits - last.prefix_hits))
        metrics.PREFIX_CACHED_TOKENS.inc(max(0, load.prefix_cached_tokens
                                             - last.prefix_cached_tokens))
        metrics.PREFIX_PAGES.set(load.prefix_cache_pages)
        self._last_prefix = load

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    # ---- one step ------------------------------------------------------------------------------

    def _launch(self, loop: asyncio.AbstractEventLoop) -> asyncio.Future[TimedStep]:
        return loop.run_in_executor(self._executor, self._timed_step)

    def _timed_step(self) -> TimedStep:
        """In the engine thread: the step, its wall time, what it prefilled and the weight
        version that computed it. An engine that hands out steps it computed earlier (in another
        process, ahead of its caller) times them itself (``SelfTimed``)."""
        engine, timing = self._engine, self._timing
        if timing is not None:
            outputs = engine.step()
            return (outputs, timing.last_step_seconds, engine.last_step_prefill_tokens,
                    timing.last_step_weight_version)
        started = time.perf_counter()
        outputs = engine.step()
        duration_s = time.perf_counter() - started
        return outputs, duration_s, engine.last_step_prefill_tokens, engine.weight_version

    def _record(self, outputs: list[RequestOutput], duration_s: float, prefill_tokens: int,
                weight_version: int) -> EngineStep:
        batch_size = decode_tokens = 0
        for out in outputs:
            if out.new_token_ids:
                batch_size += 1
                decode_tokens += len(out.new_token_ids)
        self.steps += 1
        metrics.ENGINE_STEPS.inc()
        metrics.STEP_SECONDS.observe(duration_s)
        metrics.TOKENS_GENERATED.inc(decode_tokens)
        metrics.PREFILL_TOKENS.inc(prefill_tokens)
        self._token_counts.append((time.monotonic(), decode_tokens))
        self._token_sum += decode_tokens
        stats = pb.EngineStepStats(batch_size=batch_size, duration_s=duration_s,
                                   decode_tokens=decode_tokens, prefill_tokens=prefill_tokens)
        return EngineStep(self.steps, outputs, weight_version, self.snapshot_load(), stats)

    async def _apply_mutations(self) -> None:
        while self._mutations:
            await self._mutations.popleft()()

    async def _idle(self) -> None:
        self._wakeup.clear()
        if not await wait_event(self._wakeup, self._heartbeat_s):
            self._sink.heartbeat(self.snapshot_load())

    def _tokens_per_second(self) -> float:
        """Tokens over the last few seconds: the load report's rate (a window average; the step
        stats are the true samples)."""
        now = time.monotonic()
        counts = self._token_counts
        while counts and counts[0][0] < now - _TOKEN_RATE_WINDOW_S:
            self._token_sum -= counts.popleft()[1]
        if len(counts) < 2:
            return 0.0
        return self._token_sum / max(now - counts[0][0], 1e-3)
