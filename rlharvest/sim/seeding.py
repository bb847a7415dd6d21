"""A simulated RL step for RLBoost's seeding window (§4.1): what a step costs for a given T_seed
and number of remote instances, and the timings Algorithm 1 reads from it.

The plant, in simulated seconds, deterministic given the completion lengths:

- every rollout engine (the training cluster's ``n_resv`` local engines and each remote
  instance) runs up to ``slots`` requests at once and emits one token per running request every
  ``token_s``; a freed slot takes the next waiting request (one FIFO for the step);
- the local engines roll out during [0, T_seed]; then their unfinished requests go to the front
  of the queue with their tokens (remote engines take them at their next step; one that had gone
  idle wakes ``migrate_s`` later, its prefill), and the training cluster trains. With no remote instance the local engines roll out to the end (the
  co-located fallback) and training starts after;
- training takes the completions in the order they finished, ``train_s_per_token`` per token;
  it idles (t_train_wait) when the next completion is not there yet. The step ends when the last
  completion is trained. Remote instances idle from their last response to the step's end
  (t_remote_wait).

Pure: the bench (`bench/seeding_policy.py`) drives the real ``SeedingWindow`` with it.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from rlharvest.services.trainer.seeding_window import StepTimings


@dataclass(frozen=True)
class Plant:
    n_resv: int = 2  # local rollout engines of the training cluster
    slots: int = 8  # requests one engine runs at once
    token_s: float = 0.02  # one decode step of one engine
    train_s_per_token: float = 0.0004  # training cost of one generated token
    migrate_s: float = 0.05  # a migrated request's prefill at its new engine


@dataclass(frozen=True)
class StepResult:
    step_s: float
    tokens: int
    timings: StepTimings
    rollout_s: float  # when the last completion finished


@dataclass
class _Engine:
    local: bool
    running: list[list[int]]  # [request index, tokens left]
    last_done: float = 0.0


def simulate_step(lengths: Sequence[int], t_seed: float, n_remote: int, plant: Plant,
                  n_next: int | None = None) -> StepResult:
    """One step: ``lengths`` are the completions' token counts; ``n_next`` the instances the
    next step will have (default: the same)."""
    if n_remote == 0:
        t_seed = math.inf  # nobody else can finish the rollout: co-located
    engines = [_Engine(True, []) for _ in range(plant.n_resv)]
    engines += [_Engine(False, []) for _ in range(n_remote)]
    queue: deque[list[int]] = deque([i, n] for i, n in enumerate(lengths))
    done_at: list[tuple[float, int]] = []
    events = [(0.0, e) for e in range(len(engines))]  # (time of the engine's next step, engine)
    heapq.heapify(events)
    seeded = False
    while events:
        now, index = heapq.heappop(events)
        if not seeded and now >= t_seed:
            seeded = True
            now = _close_window(engines, queue, t_seed, plant, events, now)
            if index < plant.n_resv:
                continue
        engine = engines[index]
        if engine.local and seeded:
            continue
        while len(engine.running) < plant.slots and queue:
            engine.running.append(queue.popleft())
        if not engine.running:
            continue
        for req in engine.running:
            req[1] -= 1
        finished = [req for req in engine.running if req[1] <= 0]
        engine.running = [req for req in engine.running if req[1] > 0]
        for req in finished:
            done_at.append((now + plant.token_s, req[0]))
            engine.last_done = now + plant.token_s
        if engine.running or queue:
            heapq.heappush(events, (now + plant.token_s, index))
    return _train(lengths, done_at, t_seed, engines, n_remote, plant,
                  n_remote if n_next is None else n_next)


def _close_window(engines: list[_Engine], queue: deque, t_seed: float, plant: Plant,
                  events: list, now: float) -> float:
    """T_seed passed: local requests become seeds at the front of the queue; remote engines
    that were idle wake up to take them."""
    seeds = [req for e in engines if e.local for req in e.running]
    for e in engines:
        if e.local:
            e.running = []
    queue.extendleft(reversed(seeds))
    awake = {index for _, index in events}
    for index, e in enumerate(engines):
        if not e.local and index not in awake and queue:
            heapq.heappush(events, (t_seed + plant.migrate_s, index))
    return now


def _train(lengths: Sequence[int], done_at: list[tuple[float, int]], t_seed: float,
           engines: list[_Engine], n_remote: int, plant: Plant, n_next: int) -> StepResult:
    done_at.sort()
    rollout_s = done_at[-1][0] if done_at else 0.0
    # Training starts when the window closes, or when rollout ended inside it (nothing to seed).
    clock = min(t_seed, rollout_s)
    t_train = t_wait = 0.0
    for when, index in done_at:
        start = max(clock, when)
        t_wait += start - clock
        cost = lengths[index] * plant.train_s_per_token
        t_train += cost
        clock = start + cost
    remotes = [e for e in engines if not e.local]
    t_remote = sum(e.last_done for e in remotes) / len(remotes) if remotes else 0.0
    r_wait = sum(clock - e.last_done for e in remotes) / len(remotes) if remotes else 0.0
    return StepResult(clock, sum(lengths), StepTimings(t_train, t_wait, t_remote, r_wait,
                                                       float(n_remote), n_next), rollout_s)
