"""A discrete-event simulation of one rollout step, driving the real ``RolloutControl``.

Workers of unequal speed decode requests of long-tailed lengths with continuous batching; a decode
step costs ``weights + per_seq * batch + per_kv_token * kv_tokens`` (memory-bound until the batch's
KV reads dominate, which is what makes a batching plateau exist) plus prefill for admitted
requests. Commands reach an engine between its steps, as with the real engine, so a request
migrated mid-step still sends that step's tokens from its old worker: the tracker must drop them.
Each simulated step is a step of the control (added, its completions delivered, ended through
the same calls as the service makes), and each engine step reports its stats as a worker does,
so the batching profile P is captured and frozen exactly as in the service.

Used by ``bench/manager_policy.py`` (Algorithm 2 vs round-robin vs JSQ without migration, and
migrate vs recompute under preemption) and by the tests as an end-to-end check.
"""

from __future__ import annotations

import heapq
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from rlharvest.services.rollout_manager.balancer import InstanceLoad, RoundRobinSelect  # noqa: F401
from rlharvest.services.rollout_manager.batching_profile import StepStats
from rlharvest.services.rollout_manager.commands import Command, Dispatch, Fail, Migrate, Release
from rlharvest.services.rollout_manager.control_loop import ControlConfig, RolloutControl
from rlharvest.services.rollout_manager.step import Step
from rlharvest.services.rollout_manager.tracker import (
    NewRequest,
    RequestState,
    TokenDelta,
    TrackedRequest,
)
from rlharvest.common.engine_types import SamplingParams


@dataclass(frozen=True)
class CostModel:
    weights_s: float = 0.020  # per decode iteration: reading the weights once
    per_seq_s: float = 0.0003  # per sequence in the batch: its share of compute
    per_kv_token_s: float = 1.5e-6  # per context token in the batch: KV reads
    prefill_per_token_s: float = 2e-5

    def step_s(self, batch: int, kv_tokens: int, prefill_tokens: int, iterations: int,
               speed: float) -> float:
        decode = iterations * (self.weights_s + self.per_seq_s * batch
                               + self.per_kv_token_s * kv_tokens)
        return (decode + self.prefill_per_token_s * prefill_tokens) / speed


@dataclass(frozen=True)
class SimWorker:
    worker_id: str
    speed: float = 1.0
    capacity: int = 32
    kind: str = "gpu"


@dataclass(frozen=True)
class Scenario:
    workers: tuple[SimWorker, ...]
    lengths: tuple[int, ...]  # completion length of each request
    prompt_len: int = 64
    iterations_per_event: int = 4  # decode iterations per simulated engine step (coarsening)
    lb_interval_s: float = 0.1
    preempt_at_s: float | None = None
    preempt: tuple[str, ...] = ()
    recovery: Literal["migrate", "recompute"] = "migrate"
    cost: CostModel = field(default_factory=CostModel)


@dataclass
class SimResult:
    makespan_s: float
    finished: int
    tokens_generated: int
    tokens_regenerated: int
    tokens_dropped_stale: int
    migrations: int
    prefill_tokens: int
    contiguous: bool  # every completion equals the token sequence its request should have


def long_tail_lengths(n: int, seed: int, median: int = 256, sigma: float = 1.0,
                      max_tokens: int = 4096) -> tuple[int, ...]:
    """Log-normal completion lengths: most short, a few very long (RollPacker §2, RLBoost §2)."""
    rng = random.Random(seed)
    return tuple(min(max_tokens, max(1, int(rng.lognormvariate(0.0, sigma) * median)))
                 for _ in range(n))


def expected_token(request_index: int, position: int) -> int:
    """The token a request has at a position, whichever worker produces it."""
    return 3 + (request_index * 7919 + position * 104729) % 125


@dataclass
class _Seq:
    request_id: str
    index: int
    position: int  # next token position
    target: int
    prompt_len: int


class _Engine:
    """One worker's continuous batching; add/abort take effect between steps."""

    def __init__(self, spec: SimWorker, scenario: Scenario) -> None:
        self.spec = spec
        self.scenario = scenario
        self.queue: deque[_Seq] = deque()
        self.batch: dict[str, _Seq] = {}
        self.aborts: set[str] = set()
        self.busy_until: float | None = None
        self.prefill_tokens = 0
        self.step_prefill_tokens = 0  # of the step in progress
        self.alive = True

    def add(self, seq: _Seq) -> None:
        self.queue.append(seq)

    def abort(self, request_id: str) -> None:
        self.aborts.add(request_id)

    def start(self, now: float) -> float | None:
        """Apply commands, admit, and start a step; returns when it ends (None: nothing to do)."""
        for rid in self.aborts:
            self.batch.pop(rid, None)
        self.queue = deque(s for s in self.queue if s.request_id not in self.aborts)
        self.aborts.clear()
        prefill = 0
        while self.queue and len(self.batch) < self.spec.capacity:
            seq = self.queue.popleft()
            self.batch[seq.request_id] = seq
            prefill += seq.prompt_len + seq.position
        if not self.batch:
            self.busy_until = None
            return None
        self.prefill_tokens += prefill
        self.step_prefill_tokens = prefill
        kv = sum(s.prompt_len + s.position for s in self.batch.values())
        k = self.scenario.iterations_per_event
        self.busy_until = now + self.scenario.cost.step_s(len(self.batch), kv, prefill, k,
                                                          self.spec.speed)
        return self.busy_until

    def finish(self, version: int) -> tuple[list[TokenDelta], int]:
        """The step's outputs (aborted requests included: they were in the batch) and batch size."""
        deltas: list[TokenDelta] = []
        size = len(self.batch)
        for seq in list(self.batch.values()):
            n = min(self.scenario.iterations_per_event, seq.target - seq.position)
            tokens = tuple(expected_token(seq.index, p) for p in range(seq.position,
                                                                         seq.position + n))
            done = seq.position + n >= seq.target
            deltas.append(TokenDelta(seq.request_id, seq.position, tokens, (-1.0,) * n, version,
                                     finished=done, finish_reason="stop" if done else ""))
            seq.position += n
            if done:
                del self.batch[seq.request_id]
        return deltas, size


class SimClock:
    """Simulated time; the control reads it through ``__call__`` like any injected clock."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class StepSimulation:
    """Runs one step of ``scenario`` through ``control`` (which may carry P from earlier steps).

    Steps run end to end on one ``SimClock``; times in the result are relative to this step's start.
    """

    VERSION = 0

    def __init__(self, scenario: Scenario, control: RolloutControl, clock: SimClock,
                 step_name: str) -> None:
        self.s = scenario
        self.control = control
        self.clock = clock
        self.t0 = clock.now
        self.engines = {w.worker_id: _Engine(w, scenario) for w in scenario.workers}
        self.ids = [f"{step_name}/{i}" for i in range(len(scenario.lengths))]
        self.index = {rid: i for i, rid in enumerate(self.ids)}
        self._events: list[tuple[float, int, str, str]] = []
        self._seq = 0
        self._step_started: dict[str, float] = {}
        self._name = step_name
        self.step: Step | None = None
        self.delivered: dict[str, TrackedRequest] = {}  # completions, as the client got them

    def run(self) -> SimResult:
        self.step = self._start()
        while not self.step.ended and self._events:
            self.clock.now, _, kind, worker_id = heapq.heappop(self._events)
            if kind == "step":
                self._on_step(worker_id)
            elif kind == "tick":
                self._execute(self.control.tick())
                self._push(self.clock.now + self.s.lb_interval_s, "tick", "")
            elif kind == "preempt":
                self._preempt()
        return self._result()

    def _start(self) -> Step:
        sampling = SamplingParams(max_tokens=max(self.s.lengths))
        for w in self.s.workers:
            if w.worker_id not in self.control.pool:
                self.control.worker_joined(w.worker_id, self.VERSION, w.capacity, w.kind)
        step = self.control.add_step(self._name, [
            NewRequest(rid, rid, (5,) * self.s.prompt_len, sampling, self.VERSION)
            for rid in self.ids], self.VERSION)
        self._push(self.t0, "tick", "")
        if self.s.preempt_at_s is not None:
            self._push(self.t0 + self.s.preempt_at_s, "preempt", "")
        return step

    def _push(self, at: float, kind: str, worker_id: str) -> None:
        self._seq += 1
        heapq.heappush(self._events, (at, self._seq, kind, worker_id))

    def _on_step(self, worker_id: str) -> None:
        engine = self.engines[worker_id]
        if not engine.alive or engine.busy_until != self.clock.now:
            return  # a preempted worker's last step never reports
        deltas, size = engine.finish(self.VERSION)
        report = self.control.step_deltas(worker_id, deltas)
        self.control.engine_step(worker_id, StepStats(
            size, self.clock.now - self._step_started[worker_id],
            sum(len(d.token_ids) for d in deltas), engine.step_prefill_tokens))
        for request_id in report.finished:
            self._deliver(request_id)
        if report.finished and self.control.tracker.waiting():
            self._execute(self.control.tick())  # SELECTINSTANCE waits on any completion
        self._kick(worker_id)

    def _kick(self, worker_id: str) -> None:
        engine = self.engines[worker_id]
        if engine.alive and (engine.busy_until is None or engine.busy_until <= self.clock.now):
            self._step_started[worker_id] = self.clock.now
            end = engine.start(self.clock.now)
            if end is not None:
                self._push(end, "step", worker_id)

    def _execute(self, commands: Sequence[Command]) -> None:
        touched = set()
        for c in commands:
            if isinstance(c, Dispatch):
                self._send(c.request_id, c.worker_id)
                touched.add(c.worker_id)
            elif isinstance(c, Migrate):
                self.engines[c.src].abort(c.request_id)
                self._send(c.request_id, c.dst)
                touched.update((c.src, c.dst))
            elif isinstance(c, Release) and self.engines[c.worker_id].alive:
                self.engines[c.worker_id].abort(c.request_id)
            elif isinstance(c, Fail):
                if c.worker_id is not None:
                    self.engines[c.worker_id].abort(c.request_id)
                self._deliver(c.request_id)
        for worker_id in sorted(touched):  # a fixed order keeps runs reproducible
            self._kick(worker_id)

    def _deliver(self, request_id: str) -> None:
        """Hand the completion to the client, as the service does: the control forgets it."""
        self.delivered[request_id] = self.control.tracker.get(request_id)
        self.control.deliver(request_id)

    def _send(self, request_id: str, worker_id: str) -> None:
        payload = self.control.tracker.resume_payload(request_id)
        i = self.index[request_id]
        self.engines[worker_id].add(_Seq(request_id, i, len(payload.generated_token_ids),
                                         self.s.lengths[i], len(payload.prompt_token_ids)))

    def _preempt(self) -> None:
        released = []
        for worker_id in self.s.preempt:
            self.engines[worker_id].alive = False
            released += self.control.worker_lost(worker_id, "preempted (spot reclaim)")
        if self.s.recovery == "recompute":
            # The traditional strategy collects only complete responses: partial ones restart.
            for c in released:
                if isinstance(c, Release):  # what a loss releases
                    self.control.tracker.restart_from_prompt(c.request_id)
        self._execute(self.control.tick())

    def _result(self) -> SimResult:
        tracker = self.control.tracker
        requests = [self.delivered[r] if r in self.delivered else tracker.get(r) for r in self.ids]
        finished = [r for r in requests if r.state is RequestState.FINISHED]
        contiguous = all(
            r.token_ids == [expected_token(self.index[r.request_id], p)
                            for p in range(self.s.lengths[self.index[r.request_id]])]
            for r in finished)
        c = tracker.counters
        end = max((r.finished_at or 0.0) for r in finished) if finished else self.clock.now
        return SimResult(
            makespan_s=end - self.t0, finished=len(finished),
            tokens_generated=c.tokens_generated, tokens_regenerated=c.tokens_regenerated,
            tokens_dropped_stale=c.tokens_dropped_stale, migrations=c.migrations,
            prefill_tokens=sum(e.prefill_tokens for e in self.engines.values()),
            contiguous=contiguous)


# rlboost: Algorithm 2 in full, as the paper writes it. cost_aware: Algorithm 2 with the
# cost-aware migration rule (balancer.MoveCosts). jsq_delayed: SELECTINSTANCE (with Θ) but no
# CONTINUOUSLB. jsq: classic JSQ, every request dispatched at once, no migration. round_robin:
# likewise.
Strategy = Literal["rlboost", "cost_aware", "jsq_delayed", "jsq", "round_robin"]


def make_control(strategy: Strategy, clock: SimClock, theta: int = 2) -> RolloutControl:
    if strategy == "rlboost":
        return RolloutControl(ControlConfig(theta=theta, migration_rule="paper"), clock)
    if strategy == "cost_aware":
        return RolloutControl(ControlConfig(theta=theta, migration_rule="cost-aware"), clock)
    if strategy == "jsq_delayed":
        return RolloutControl(ControlConfig(theta=theta, continuous_lb=False), clock)
    never_hold = 1_000_000_000  # the classic baselines dispatch at once
    config = ControlConfig(theta=never_hold, continuous_lb=False)
    if strategy == "jsq":
        return RolloutControl(config, clock)
    return RolloutControl(config, clock, select=RoundRobinSelect())


def simulate(scenario: Scenario, strategy: Strategy, warmup: Scenario | None = None,
             theta: int = 2) -> SimResult:
    """Run ``warmup`` (the previous step: P is frozen from it when it ends) and then ``scenario``.

    Counters in the result cover both steps; makespan covers ``scenario`` only.
    """
    clock = SimClock()
    control = make_control(strategy, clock, theta)
    if warmup is not None:
        StepSimulation(warmup, control, clock, "warmup").run()
    return StepSimulation(scenario, control, clock, "step").run()
