"""Two models on one device, one forward at a time (ROSE §4.1): the co-executor's engine.

``DualEngine`` holds the serving model's engine and the RL job's rollout engine. To the worker
core it is the rollout side's ``Engine`` (the manager's requests come and go through it as
through a rollout worker's); the serving side adds and aborts through ``serving_side`` and gets
its outputs through ``deliver``. Each ``step`` is one tick of ``scheduler.CoexecScheduler``:
exactly one of the two engines steps (an admitted rollout step, else serving's), so serving
never shares a forward with rollout.

KV memory is one ``PagePool``: every request holds the pages its tokens need in its model's
layout (``tokens_per_page`` per model) — its prompt's when it arrives, one more before a token
needs it. With paged engines over one ``PageStore`` (``pool_pages.py``; the co-executor's
default) those pages are the KV memory itself: an engine reads its block tables from the pool.
With slot engines (``--kv-memory slots``) the pool only governs how much each model may hold. Memory sharing (``memory_sharing.py``) runs on it: B_roll from serving's recent
use at each weight version, the one halving cut when serving crosses the watermark, reclaim by
aborting rollout requests — their abort goes back to the manager with every token kept — and
leases. Serving is never refused for memory: when the pool is short, rollout gives way first.
Serving demand beyond the whole pool waits (FIFO, ahead of any rollout step) until pages free
up, and a running serving request that cannot grow preempts the latest-arrived serving request
by recomputation (vLLM's policy): it leaves the engine and its pages, and re-enters at the head
of the queue with the tokens it already streamed, which it prefills again and continues from —
its client sees no gap.

Rollout step costs are predicted from the rollout model's latency profile and serving's from
serving's; both profiles correct themselves from measured steps.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from rlharvest.common.engine_types import EngineLoad, EngineRequest, RequestOutput
from rlharvest.common.worker_core.engine import Engine
from rlharvest.services.coexecutor.admission import DecodeBatch, PendingPrefill, ServingWork
from rlharvest.services.coexecutor.latency_profile import LatencyProfile
from rlharvest.services.coexecutor import metrics
from rlharvest.services.coexecutor.memory_sharing import MemorySharing, MemoryState
from rlharvest.services.coexecutor.parked_prefixes import ParkedPrefixes
from rlharvest.services.coexecutor.page_pool import Owner, PageState, PoolExhausted, pages_for
from rlharvest.services.coexecutor.scheduler import ActionKind, CoexecScheduler, RolloutUnit

if TYPE_CHECKING:
    import torch


@dataclass
class _Held:
    """A request's KV accounting: tokens it holds (prompt + generated) and when it arrived."""

    tokens: int
    arrival: float
    generated: int = 0
    last_token: float | None = None  # serving: when its latest token came out
    request: EngineRequest | None = None  # serving: what to re-add after a preemption
    output: list[int] = field(default_factory=list)  # serving: its tokens so far
    ids: list[int] | None = None  # rollout with prefix reuse: prompt + generated token ids


@dataclass
class DualStats:
    steps: Counter = field(default_factory=Counter)  # by ActionKind value
    aborts: Counter = field(default_factory=Counter)  # rollout aborts by cause
    serving_queued: int = 0  # serving requests that waited for pages (the pool was full)
    serving_preempted: int = 0  # serving requests recomputed to let another one grow


class DualEngine:
    def __init__(self, rollout: Engine, serving: Engine, *, scheduler: CoexecScheduler,
                 memory: MemorySharing, rollout_profile: LatencyProfile,
                 tokens_per_page: tuple[int, int],
                 deliver: Callable[[list[RequestOutput]], None] = lambda outputs: None,
                 clock: Callable[[], float] = time.perf_counter,
                 idle_sleep_s: float = 0.001, stall_s: float = 2.0,
                 rollout_prefill_chunk: int = 0, prefix_reuse: bool = False) -> None:
        self.rollout = rollout
        self.serving = serving
        self.scheduler = scheduler
        self.memory = memory
        self.pool = memory.pool
        self.rollout_profile = rollout_profile
        self.serving_tpp, self.rollout_tpp = tokens_per_page
        self.deliver = deliver
        self._clock = clock
        self._idle_sleep_s = idle_sleep_s
        self._stall_s = stall_s  # ROSE: no progress this long -> back to the manager
        self._chunk = rollout_prefill_chunk  # the rollout engine's prefill_chunk (0: whole)
        self._last_rollout_step = float("-inf")
        self._serving: dict[str, _Held] = {}
        self._serving_queue: deque[str] = deque()  # waiting for pages, in the serving engine not yet
        self._rollout: dict[str, _Held] = {}
        self._last_prefill = 0
        self._queued_aborts: list[RequestOutput] = []
        # Finished rollout requests' tables parked for the next turn to adopt (the rollout
        # engine's pages must be the pool's: PoolPages(prefix_reuse=True)).
        self._parked = ParkedPrefixes(self.rollout_tpp) if prefix_reuse else None
        self.stats = DualStats()
        self.serving_side = _ServingSide(self)

    # ---- the rollout side's Engine ------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.rollout.vocab_size

    @property
    def weight_version(self) -> int:
        return self.rollout.weight_version

    @property
    def start_weights(self) -> str:
        return self.rollout.start_weights

    @property
    def batch_admission(self) -> str:
        return self.rollout.batch_admission

    @property
    def last_step_prefill_tokens(self) -> int:
        return self._last_prefill

    def add(self, request: EngineRequest) -> None:
        """Into the rollout engine with the pages its known tokens need (a paged engine writes
        them at its prefill); when B_roll cannot grant them it goes back to the manager."""
        self.rollout.add(request)
        rid = request.request_id
        ids = [*request.prompt_token_ids, *request.generated_token_ids]
        now = self._clock()
        self._rollout[rid] = _Held(len(ids), now, generated=len(request.generated_token_ids),
                                   ids=ids if self._parked is not None else None)
        try:
            held = self._adopt_prefix(rid, ids, now)
            self.pool.allocate(rid, Owner.ROLLOUT, pages_for(len(ids), self.rollout_tpp) - held,
                               now)
        except PoolExhausted:  # admission saw room; a step since took it
            self._queued_aborts.append(self._abort_active(rid, "budget"))

    def _adopt_prefix(self, rid: str, ids: list[int], now: float) -> int:
        """With prefix reuse: ``rid`` takes over the pages of the parked table holding the
        longest run of its full pages (the trajectory's last turn, most likely). Returns the
        pages it holds now."""
        if self._parked is None:
            return 0
        if rid in self._parked:  # the same id again (a retried turn): its old table goes
            self._parked.forget(rid)
            self.pool.free(rid)
        hit = self._parked.match(ids, self.rollout.weight_version)
        if hit is None:
            return 0
        parked, pages = hit
        self._parked.forget(parked)
        return len(self.pool.adopt(parked, rid, pages, now))

    def abort(self, request_id: str) -> RequestOutput:
        out = self.rollout.abort(request_id)
        self._forget(self._rollout, request_id)
        return out

    def has_work(self) -> bool:
        return self.rollout.has_work() or self.serving.has_work() or bool(self._serving_queue)

    def load(self) -> EngineLoad:
        load = self.rollout.load()
        return EngineLoad(pending=load.pending, executing=load.executing,
                          kv_used_tokens=self.pool.rollout_pages * self.rollout_tpp,
                          kv_capacity_tokens=self.pool.rollout_budget * self.rollout_tpp,
                          weight_version=load.weight_version,
                          prefix_lookups=load.prefix_lookups, prefix_hits=load.prefix_hits,
                          prefix_cached_tokens=load.prefix_cached_tokens,
                          prefix_cache_pages=self.pool.count(PageState.ROLLOUT_CACHED))

    def load_weights(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        """A new weight version: the rollout model loads it and the RL step starts (B_roll is
        set again from serving's recent use and the freeze ends)."""
        self.rollout.load_weights(tensors, version)
        for parked in self._parked.clear() if self._parked is not None else []:
            self.pool.free(parked)  # KV of the old weights is no prefix of the new
        self.memory.start_step(self._clock())

    def export_gauges(self) -> None:
        """Pages by state, B_roll and the pressure state into the gauges (at scrape time)."""
        for state in PageState:
            metrics.PAGES.labels(state.value).set(self.pool.count(state))
        metrics.ROLLOUT_BUDGET.set(self.pool.rollout_budget)
        metrics.PRESSURE.set(1 if self.memory.state is MemoryState.PRESSURE else 0)

    def rollout_room_pages(self) -> int:
        """Pages rollout may still take under B_roll."""
        return max(0, self.pool.rollout_budget - self.pool.rollout_pages)

    # ---- one tick ------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        now = self._clock()
        reclaimed, self._queued_aborts = self._queued_aborts, []
        reclaimed += self._expire(now) + self._stalled(now)
        if self.memory.on_serving_use(now, self.pool.serving_pages):
            metrics.PRESSURE_EVENTS.inc()
            reclaimed += self._reclaim(now, "memory_pressure")
        reclaimed += self._admit_queued(now)
        units = [self._rollout_unit()] if self.rollout.has_work() else []
        action = self.scheduler.next_action(now, self._serving_work(), units,
                                            self.pool.free_pages)
        self.stats.steps[action.kind.value] += 1
        metrics.TICKS.labels(action.kind.value).inc()
        self._last_prefill = 0
        if action.kind is ActionKind.ROLLOUT:
            return reclaimed + self._rollout_step()
        if action.kind is ActionKind.IDLE:
            time.sleep(self._idle_sleep_s)  # nothing may run now (no headroom): do not spin
            return reclaimed
        return reclaimed + self._serving_step()

    def _rollout_step(self) -> list[RequestOutput]:
        executing = self.rollout.load().executing
        started = self._clock()
        outputs = self.rollout.step()
        self._last_rollout_step = self._clock()
        took = self._last_rollout_step - started
        self._last_prefill = self.rollout.last_step_prefill_tokens
        self.rollout_profile.observe_step(executing, self._last_prefill, took)
        metrics.ROLLOUT_TOKENS.inc(sum(len(out.new_token_ids) for out in outputs))
        return outputs + self._account_rollout(outputs, self._clock())

    def _serving_step(self) -> list[RequestOutput]:
        executing = self.serving.load().executing
        started = self._clock()
        outputs = self.serving.step()
        now = self._clock()
        self.scheduler.admission.profile.observe_step(
            executing, self.serving.last_step_prefill_tokens, now - started)
        aborted = self._account_serving(outputs, now)
        self.deliver(outputs)
        return aborted

    # ---- what the scheduler sees ---------------------------------------------------------------

    def _serving_work(self) -> ServingWork:
        prefills = tuple(PendingPrefill(rid, held.arrival, held.tokens)
                         for rid, held in self._serving.items() if held.last_token is None)
        lasts = [held.last_token for held in self._serving.values() if held.last_token is not None]
        return ServingWork(prefills, DecodeBatch(len(lasts), min(lasts, default=float("inf"))))

    def _rollout_unit(self) -> RolloutUnit:
        """The next rollout step: one decode of the running batch plus the prefill of what it
        admits, its predicted cost and the pages it needs."""
        load = self.rollout.load()
        # Every waiting request is counted as admitted: an upper bound when slots are short. With
        # chunked prefill the engine prefills at most one chunk per step.
        pending = [(rid, held) for rid, held in self._rollout.items() if held.last_token is None]
        prefill_tokens = sum(held.tokens for _, held in pending)
        if self._chunk:
            prefill_tokens = min(prefill_tokens, self._chunk)
        cost = (self.rollout_profile.decode_s(load.executing)
                + self.rollout_profile.prefill_s(prefill_tokens))
        pages = sum(self._missing_pages(rid, held.tokens + 1, self.rollout_tpp)
                    for rid, held in self._rollout.items())
        return RolloutUnit("step", cost, pages)

    # ---- accounting ----------------------------------------------------------------------------

    def _missing_pages(self, rid: str, tokens: int, tokens_per_page: int) -> int:
        """Pages ``rid`` needs beyond those it holds to hold ``tokens`` tokens."""
        held = len(self.pool.table(rid).pages) if self.pool.holds(rid) else 0
        return max(0, pages_for(tokens, tokens_per_page) - held)

    def _advance(self, table: dict[str, _Held], outputs: list[RequestOutput],
                 now: float) -> list[tuple[str, _Held]]:
        """Count a step's tokens into ``table``; forget the finished requests and return the
        others, which may need more pages."""
        growing = []
        for out in outputs:
            held = table.get(out.request_id)
            if held is None:
                continue
            held.tokens += len(out.new_token_ids)
            held.generated += len(out.new_token_ids)
            held.last_token = now
            if held.ids is not None:
                held.ids += out.new_token_ids
            if not out.finished:
                growing.append((out.request_id, held))
            elif held.ids is not None and out.finish_reason in ("stop", "length"):
                self._park(out.request_id, held.ids, now)
            else:
                self._forget(table, out.request_id)
        return growing

    def _park(self, rid: str, ids: list[int], now: float) -> None:
        """A finished rollout request's table stays in the pool (ROLLOUT_CACHED: under its
        lease, reclaimed first) for its trajectory's next turn; its last token has no KV."""
        assert self._parked is not None
        del self._rollout[rid]
        if not self.pool.holds(rid):
            return  # no table: nothing to keep, and nothing the index may point at
        if self._parked.park(rid, ids[:-1], self.rollout.weight_version):
            self.pool.park(rid, now)
        else:
            self.pool.free(rid)  # not one full page: nothing to reuse

    def _account_rollout(self, outputs: list[RequestOutput], now: float) -> list[RequestOutput]:
        aborted: list[RequestOutput] = []
        for rid, held in self._advance(self._rollout, outputs, now):
            try:
                self.pool.allocate(rid, Owner.ROLLOUT,
                                   self._missing_pages(rid, held.tokens, self.rollout_tpp), now)
            except PoolExhausted:  # past B_roll or the pool: this request gives way
                aborted.append(self._abort_active(rid, "budget"))
        return aborted

    def _account_serving(self, outputs: list[RequestOutput], now: float) -> list[RequestOutput]:
        aborted: list[RequestOutput] = []
        for out in outputs:
            if (held := self._serving.get(out.request_id)) is not None:
                held.output += out.new_token_ids
        for rid, held in self._advance(self._serving, outputs, now):
            while rid not in self._serving_queue:
                grown, reclaimed = self._grant_serving(rid, held.tokens, now)
                aborted += reclaimed
                if grown:
                    break
                self._preempt_serving(now)  # the latest arrival, maybe ``rid`` itself
        return aborted

    def _grant_serving(self, rid: str, tokens: int, now: float
                       ) -> tuple[bool, list[RequestOutput]]:
        """Serving's pages, taking them from rollout when the pool is short; whether they were
        granted, and the rollout requests aborted for them."""
        need = self._missing_pages(rid, tokens, self.serving_tpp)
        aborted: list[RequestOutput] = []
        if need > self.pool.free_pages:
            aborted = self._reclaim(now, "memory_pressure", serving_need=need)
        try:
            self.pool.allocate(rid, Owner.SERVING, need, now)
        except PoolExhausted:
            return False, aborted
        return True, aborted

    def _admit_queued(self, now: float) -> list[RequestOutput]:
        """Serving requests waiting for pages enter the engine, in order, while they fit."""
        aborted: list[RequestOutput] = []
        while self._serving_queue:
            rid = self._serving_queue[0]
            held = self._serving[rid]
            granted, reclaimed = self._grant_serving(rid, held.tokens, now)
            aborted += reclaimed
            if not granted:
                break
            self._serving_queue.popleft()
            assert held.request is not None
            self.serving.add(replace(held.request, generated_token_ids=list(held.output)))
        return aborted

    def _preempt_serving(self, now: float) -> None:
        """Recompute the latest-arrived running serving request: out of the engine and the
        pool, back at the head of the queue with its tokens."""
        running = [(held.arrival, rid) for rid, held in self._serving.items()
                   if rid not in self._serving_queue]
        _, victim = max(running)
        self.serving.abort(victim)  # its abort output is ours, not the client's
        if self.pool.holds(victim):
            self.pool.free(victim)
        self._serving[victim].last_token = None  # a prefill again, to the scheduler
        self._serving_queue.appendleft(victim)
        self.stats.serving_preempted += 1
        metrics.SERVING_PREEMPTED.inc()

    def _reclaim(self, now: float, cause: str, serving_need: int = 0) -> list[RequestOutput]:
        generated = {rid: held.generated for rid, held in self._rollout.items()}
        return [out for rid in self.memory.victims(now, generated, serving_need)
                if (out := self._abort_rollout(rid, cause)) is not None]

    def _stalled(self, now: float) -> list[RequestOutput]:
        """Rollout requests that made no progress for ``stall_s`` because no rollout step ran
        (serving left no slack): aborted so the manager reroutes them with their tokens (ROSE
        §4.1). One merely queued for a slot while rollout steps run is not stalled."""
        if now - self._last_rollout_step < self._stall_s:
            return []
        stalled = [rid for rid, held in self._rollout.items()
                   if now - (held.last_token if held.last_token is not None else held.arrival)
                   >= self._stall_s]
        return [out for rid in stalled if (out := self._abort_rollout(rid, "stall")) is not None]

    def _expire(self, now: float) -> list[RequestOutput]:
        """Free the parked prefixes whose lease ran out. An active request's pages are in use
        even while it waits for a slot (no output renews them then): ``_stalled`` is its rule,
        and a lease would bounce every request queued longer than ``lease_s`` behind a full
        batch back to its manager."""
        return [out for rid in self.pool.expired(now) if rid not in self._rollout
                if (out := self._abort_rollout(rid, "lease")) is not None]

    def _abort_rollout(self, rid: str, cause: str) -> RequestOutput | None:
        """Abort a rollout request for memory: the manager gets its abort (its tokens are
        already streamed) and places it elsewhere. A parked prefix (a finished request's
        table) is only freed: no request stands behind it, so nothing is aborted."""
        if rid in self._rollout:
            return self._abort_active(rid, cause)
        self.pool.free(rid)
        if self._parked is not None:
            self._parked.forget(rid)
        metrics.PREFIXES_DROPPED.labels(cause).inc()
        return None

    def _abort_active(self, rid: str, cause: str) -> RequestOutput:
        self.stats.aborts[cause] += 1
        metrics.ROLLOUT_ABORTS.labels(cause).inc()
        return self.abort(rid)

    def _forget(self, table: dict[str, _Held], rid: str) -> None:
        table.pop(rid, None)
        if self.pool.holds(rid):
            self.pool.free(rid)


class _ServingSide:
    """What the serving backend adds to and aborts from: the serving engine, with the arrival
    times and KV pages the scheduler and the pool need."""

    def __init__(self, dual: DualEngine) -> None:
        self._dual = dual

    def add(self, request: EngineRequest) -> None:
        """Into the engine (which refuses bad input at once), with its pages — or, when the
        pool cannot hold it even after rollout gave way, into the queue for pages."""
        dual = self._dual
        rid = request.request_id
        dual.serving.add(request)
        now = dual._clock()
        dual._serving[rid] = _Held(len(request.prompt_token_ids), now, request=request)
        granted = False
        if not dual._serving_queue:  # first come, first served: none may pass a waiting one
            granted, reclaimed = dual._grant_serving(rid, len(request.prompt_token_ids), now)
            # Rollout requests reclaimed for this prompt reach the manager with the next step.
            dual._queued_aborts += reclaimed
        if not granted:
            dual.serving.abort(rid)  # nothing ran yet: it waits outside the engine
            dual._serving_queue.append(rid)
            dual.stats.serving_queued += 1
            metrics.SERVING_QUEUED.inc()

    def abort(self, request_id: str) -> RequestOutput:
        dual = self._dual
        if request_id in dual._serving_queue:  # waiting for pages: never reached the engine
            dual._serving_queue.remove(request_id)
            dual._forget(dual._serving, request_id)
            return RequestOutput(request_id, [], [], finished=True, finish_reason="abort")
        out = dual.serving.abort(request_id)
        dual._forget(dual._serving, request_id)
        return out

