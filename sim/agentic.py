"""Agentic rollout at cluster scale, simulated (ROSE §4.3, Table 3; issue 18).

Drives the manager's real turn router (``services/rollout_manager/turn_routing.py``) and
Algorithm 2's ``select_instance`` on a virtual clock. Workers run in engine steps. A step decodes
one token of every running turn and prefills the turns admitted in it. It lasts
``decode_s + per_request_s * batch + prefill_token_s * prefill_tokens``: a GPU-like cost, where a
turn's prefill is what dominates agentic rollout. Each worker has a prefix cache of
``cache_tokens`` (whole histories, least recently used out). A turn that runs where its history
is cached prefills only what the last turn added. Trajectories start together. A trajectory's
next turn arrives ``env_s`` after its last one finished, with the environment's reply appended.

Pure and deterministic: a workload in, a result out.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass, field

from rlharvest.services.rollout_manager.balancer import InstanceLoad, select_instance
from rlharvest.services.rollout_manager.turn_routing import TurnRouter, TurnRouting


@dataclass(frozen=True)
class AgenticWorkload:
    """Trajectories differ as agentic tasks do: each has its own number of turns (uniform in
    ``turn_range``) and its own length scale (log-normal, ``trajectory_sigma``), and each turn
    varies around it (``turn_sigma``), so some trajectories run far longer than others."""

    trajectories: int = 64
    turn_range: tuple[int, int] = (2, 10)
    prompt_tokens: int = 600
    reply_tokens: int = 300  # the environment's observation, appended every turn
    output_median: int = 96  # tokens a turn samples, median over trajectories and turns
    trajectory_sigma: float = 0.8
    turn_sigma: float = 0.5
    max_output: int = 1024
    env_s: float = 0.5
    seed: int = 0

    def draw(self) -> dict[int, list[int]]:
        """Per trajectory, each turn's output length (the same for every routing mode)."""
        rng = random.Random(self.seed)
        out = {}
        for t in range(self.trajectories):
            scale = rng.lognormvariate(0, self.trajectory_sigma)
            turns = rng.randint(*self.turn_range)
            out[t] = [max(1, min(self.max_output, round(
                self.output_median * scale * rng.lognormvariate(0, self.turn_sigma))))
                for _ in range(turns)]
        return out


@dataclass(frozen=True)
class ClusterModel:
    workers: int = 8
    slots: int = 16  # running turns per worker (the cap: the plateau of App. A)
    theta: int = 2
    decode_s: float = 0.020
    per_request_s: float = 0.0005
    prefill_token_s: float = 0.0002
    cache_tokens: int = 200_000  # KV tokens a worker's prefix cache keeps


@dataclass
class AgenticResult:
    makespan_s: float
    prefill_tokens: int
    cached_tokens: int
    turns: int

    @property
    def hit_rate(self) -> float:
        total = self.prefill_tokens + self.cached_tokens
        return self.cached_tokens / total if total else 0.0


@dataclass
class _Turn:
    trajectory: int
    index: int
    history: int  # tokens in its prompt
    output: int
    generated: int = 0
    prefill: int = 0  # tokens still to prefill (set at admission)


@dataclass
class _Worker:
    name: str
    running: list[_Turn] = field(default_factory=list)
    queued: list[_Turn] = field(default_factory=list)
    cache: OrderedDict[int, int] = field(default_factory=OrderedDict)  # trajectory -> tokens
    busy_until: float = 0.0


def simulate(mode: TurnRouting, workload: AgenticWorkload = AgenticWorkload(),
             cluster: ClusterModel = ClusterModel()) -> AgenticResult:
    """Runs every trajectory to its last turn under ``mode``; the makespan and prefill totals."""
    outputs = workload.draw()
    now = 0.0
    router = TurnRouter(mode, ttl_s=1e9, clock=lambda: now)
    workers = [_Worker(f"w{i}") for i in range(cluster.workers)]
    arrivals: list[tuple[float, _Turn]] = [
        (0.0, _Turn(t, 0, workload.prompt_tokens, outputs[t][0]))
        for t in range(workload.trajectories)]
    waiting: list[_Turn] = []
    result = AgenticResult(0.0, 0, 0, 0)
    while arrivals or waiting or any(w.running or w.queued for w in workers):
        arrivals.sort(key=lambda a: a[0])
        while arrivals and arrivals[0][0] <= now:
            waiting.append(arrivals.pop(0)[1])
        waiting = _dispatch(waiting, workers, router, cluster)
        for worker in workers:
            if worker.busy_until <= now and (worker.running or worker.queued):
                finished = _step(worker, now, cluster, result)
                for turn in finished:
                    turns = len(outputs[turn.trajectory])
                    router.finished(str(turn.trajectory), worker.name, turn.index == turns - 1)
                    _remember(worker, turn, cluster.cache_tokens)
                    if turn.index + 1 < turns:
                        history = turn.history + turn.output + workload.reply_tokens
                        nxt = _Turn(turn.trajectory, turn.index + 1, history,
                                    outputs[turn.trajectory][turn.index + 1])
                        arrivals.append((worker.busy_until + workload.env_s, nxt))
        upcoming = [w.busy_until for w in workers if (w.running or w.queued)
                    and w.busy_until > now]
        upcoming += [a[0] for a in arrivals]
        if not upcoming:
            if waiting and not any(w.running or w.queued for w in workers):
                raise RuntimeError("turns wait with every worker idle: the router held them")
            continue
        now = min(upcoming)
    result.makespan_s = max(w.busy_until for w in workers)
    return result


def _loads(workers: list[_Worker], cluster: ClusterModel) -> list[InstanceLoad]:
    return [InstanceLoad(w.name, cluster.slots,
                         queued=tuple(f"q{id(t)}" for t in w.queued),
                         running=tuple(f"r{id(t)}" for t in w.running), plateau=cluster.slots)
            for w in workers]


def _dispatch(waiting: list[_Turn], workers: list[_Worker], router: TurnRouter,
              cluster: ClusterModel) -> list[_Turn]:
    """The manager's own turn placement (``TurnRouter.dispatch``); returns the turns held."""
    by_name = {w.name: w for w in workers}
    by_id = {str(id(turn)): turn for turn in waiting}
    placed = router.dispatch(list(by_id), lambda key: str(by_id[key].trajectory),
                             _loads(workers, cluster), cluster.theta, select_instance)
    for command in placed:
        by_name[command.worker_id].queued.append(by_id.pop(command.request_id))
    return list(by_id.values())


def _step(worker: _Worker, now: float, cluster: ClusterModel, result: AgenticResult
          ) -> list[_Turn]:
    """One engine step from ``now``: admits queued turns into free slots (their prefill minus
    what the worker's cache holds of their history), decodes every running turn."""
    admitted: list[_Turn] = []
    while worker.queued and len(worker.running) + len(admitted) < cluster.slots:
        turn = worker.queued.pop(0)
        cached = min(worker.cache.get(turn.trajectory, 0), turn.history - 1)
        if cached:
            worker.cache.move_to_end(turn.trajectory)
        turn.prefill = turn.history - cached
        result.prefill_tokens += turn.prefill
        result.cached_tokens += cached
        admitted.append(turn)
    prefill = sum(t.prefill for t in admitted)
    worker.running += admitted
    batch = len(worker.running)
    duration = cluster.decode_s + cluster.per_request_s * batch + cluster.prefill_token_s * prefill
    worker.busy_until = now + duration
    finished = []
    for turn in list(worker.running):
        turn.generated += 1
        if turn.generated >= turn.output:
            worker.running.remove(turn)
            finished.append(turn)
            result.turns += 1
    return finished


def _remember(worker: _Worker, turn: _Turn, capacity: int) -> None:
    """The worker's cache now holds the turn's history and completion; LRU out past capacity."""
    worker.cache[turn.trajectory] = turn.history + turn.output - 1
    worker.cache.move_to_end(turn.trajectory)
    while sum(worker.cache.values()) > capacity and len(worker.cache) > 1:
        worker.cache.popitem(last=False)


def compare(workload: AgenticWorkload = AgenticWorkload(),
            cluster: ClusterModel = ClusterModel()) -> dict[str, AgenticResult]:
    return {mode.value: simulate(mode, workload, cluster) for mode in TurnRouting}


def main() -> None:
    import argparse
    import dataclasses

    parser = argparse.ArgumentParser(description="agentic routing at cluster scale, simulated")
    parser.add_argument("--trajectories", type=int, default=AgenticWorkload.trajectories)
    parser.add_argument("--turns", default="2-10", help="turns per trajectory, uniform: lo-hi")
    parser.add_argument("--per-request-s", type=float, default=ClusterModel.per_request_s,
                        help="step cost per running turn (GPU-like 0.0005; CPU-like 0.002+)")
    parser.add_argument("--decode-s", type=float, default=ClusterModel.decode_s,
                        help="fixed cost of an engine step (tools/step_costs.py measures it)")
    parser.add_argument("--prefill-token-s", type=float, default=ClusterModel.prefill_token_s,
                        help="cost of one prefilled token (tools/step_costs.py measures it)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    lo, hi = (int(x) for x in args.turns.split("-"))
    workload = dataclasses.replace(AgenticWorkload(), trajectories=args.trajectories,
                                   turn_range=(lo, hi), seed=args.seed)
    cluster = dataclasses.replace(ClusterModel(), per_request_s=args.per_request_s,
                                  decode_s=args.decode_s, prefill_token_s=args.prefill_token_s)
    results = compare(workload, cluster)
    static = results["pinned-static"].makespan_s
    pinned = results["pinned"].makespan_s
    for mode, r in results.items():
        print(f"{mode:18s} makespan {r.makespan_s:7.1f} s  vs pinned-static (the paper's "
              f"baseline) {static / r.makespan_s:.2f}x, vs pinned {pinned / r.makespan_s:.2f}x"
              f"  prefill {r.prefill_tokens:>8d} tokens, cache hit rate {r.hit_rate:.0%}")


if __name__ == "__main__":
    main()
