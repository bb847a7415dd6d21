"""Agentic rollout at cluster scale, simulated (ROSE §4.3, Table 3).

Drives the manager's real turn router (``rlharvest/services/rollout_manager/turn_routing.py``) and
Algorithm 2's ``select_instance`` on a virtual clock. Workers run in engine steps. A step decodes
one token of every running turn and prefills the turns admitted in it. It lasts
``decode_s + per_request_s * batch + prefill_token_s * prefill_tokens``: a GPU-like cost, where a
turn's prefill is what dominates agentic rollout. Each worker has a prefix cache of
``cache_tokens`` (whole histories, least recently used out). A turn that runs where its history
is cached prefills only what the last turn added. Trajectories start together. A trajectory's
next turn arrives ``env_s`` after its last one finished, with the environment's reply appended.

Serving GPUs (``ClusterModel.serving``, ROSE's end-to-end setup behind Table 3) are co-executors
lent to the rollout. Their serving traffic comes in bursts (``serving_period_s``, staggered over
the GPUs). Outside a burst one admits ``serving_slots`` turns. In a burst it admits
``burst_slots``, and its serving steps interleave with the rollout's (each rollout step takes
``burst_step_factor`` times as long). When a burst starts, it reclaims memory as our co-executor
does (``memory_sharing``): it aborts the turns beyond its cap newest first, which go back to the
manager with every token they sampled, and it drops its prefix cache. The manager sees its cap as
its capacity and ranks it after the dedicated workers (``TurnRouter``), and sends a co-executor
that gave turns up nothing for ``refusal_hold_s``, as the manager does.

With ``serving_kv_tokens`` a co-executor's KV memory for rollout is counted in tokens too, as our
co-executor reports it (``InstanceLoad.room_tokens``): outside a burst it holds that many, in
one ``burst_kv_tokens``. Every turn sent to it holds its context from the add (its pages are
taken then) and one more token per step. The router sends it only turns whose context fits its
room (``balancer.fits``), and when its turns outgrow the room, or a burst shrinks it, it aborts
the newest ones. Without it (0) the slots alone bound it. A pinned turn that outgrew its
co-executor's room can go back only there: give the router the manager's entry lifetime
(``trajectory_ttl_s``, 120 s), after which it is placed again.

Pure and deterministic: a workload in, a result out.
"""

from __future__ import annotations

import random
import statistics
from collections import OrderedDict
from dataclasses import dataclass, field

from rlharvest.services.rollout_manager.balancer import InstanceLoad, select_instance
from rlharvest.services.rollout_manager.control_loop import ControlConfig
from rlharvest.services.rollout_manager.turn_routing import TurnRouter, TurnRouting
from rlharvest.sim.ratios import spread


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
    serving: int = 0  # serving GPUs lent to the rollout (co-executors)
    serving_slots: int = 16  # turns one admits between serving bursts
    burst_slots: int = 2  # ... and during one
    serving_period_s: float = 120.0  # a burst starts every period on each serving GPU
    burst_fraction: float = 0.5  # of the period
    burst_step_factor: float = 2.0  # serving steps share the GPU during a burst
    serving_kv_tokens: int = 0  # a co-executor's KV tokens for rollout; 0: the slots alone
    burst_kv_tokens: int = 0  # ... and during a burst; 0: as outside one
    # How long the router keeps a trajectory's home (the manager's --trajectory-ttl-s is 120);
    # by default forever, so pinned means pinned. With a KV room give the manager's: a pinned
    # turn that outgrew its co-executor's room is placed again only once its entry ends.
    trajectory_ttl_s: float = 1e9
    # A co-executor that gave turns up for memory gets none for this long, as the manager
    # holds it.
    refusal_hold_s: float = ControlConfig.refusal_hold_s

    def serving_kv(self, serving_index: int, now: float) -> int | None:
        """Serving GPU ``serving_index``'s KV tokens for rollout now; None when not limited."""
        if not self.serving_kv_tokens:
            return None
        return self.burst_kv_tokens if self.burst_kv_tokens and \
            self.in_burst(serving_index, now) else self.serving_kv_tokens

    @property
    def stall_limit_s(self) -> float:
        """How long turns may wait with nothing running anywhere before the run is stuck: a
        burst ends within a period, and a home within its TTL when that is finite."""
        ttl = self.trajectory_ttl_s if self.trajectory_ttl_s < 1e6 else 0.0
        return ttl + 2 * self.serving_period_s

    def in_burst(self, serving_index: int, now: float) -> bool:
        """Serving GPU ``serving_index``'s traffic is bursting at ``now`` (staggered phases)."""
        phase = (now / self.serving_period_s + serving_index / max(1, self.serving)) % 1.0
        return phase < self.burst_fraction

    def serving_cap(self, serving_index: int, now: float) -> int:
        return self.burst_slots if self.in_burst(serving_index, now) else self.serving_slots

    def next_serving_change(self, now: float) -> float:
        """The next time any serving GPU's burst starts or ends."""
        out = float("inf")
        for i in range(self.serving):
            offset = i / self.serving
            for edge in (0.0, self.burst_fraction):
                k = (now / self.serving_period_s + offset - edge) // 1.0 + 1
                out = min(out, (k + edge - offset) * self.serving_period_s)
        return out


@dataclass
class AgenticResult:
    makespan_s: float
    prefill_tokens: int
    cached_tokens: int
    turns: int
    aborted: int = 0  # turns a serving burst sent back to the manager

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

    @property
    def context(self) -> int:
        """Its prompt and what it sampled so far (an aborted turn resumes from here)."""
        return self.history + self.generated


@dataclass
class _Worker:
    name: str
    running: list[_Turn] = field(default_factory=list)
    queued: list[_Turn] = field(default_factory=list)
    cache: OrderedDict[int, int] = field(default_factory=OrderedDict)  # trajectory -> tokens
    busy_until: float = 0.0
    serving_index: int | None = None  # a serving GPU's index; None: a dedicated worker
    bursting: bool = False  # its serving burst has taken its memory back
    gave_up_at: float = -1e9  # when it last gave turns up for memory

    def cap(self, cluster: ClusterModel, now: float) -> int:
        if self.serving_index is None:
            return cluster.slots
        return cluster.serving_cap(self.serving_index, now)

    def kv_room(self, cluster: ClusterModel, now: float) -> int | None:
        """A co-executor's KV tokens not held by its turns (running or sent); None: unlimited."""
        if self.serving_index is None:
            return None
        kv = cluster.serving_kv(self.serving_index, now)
        if kv is None:
            return None
        return kv - sum(t.context for t in (*self.running, *self.queued))


def simulate(mode: TurnRouting, workload: AgenticWorkload = AgenticWorkload(),
             cluster: ClusterModel = ClusterModel()) -> AgenticResult:
    """Runs every trajectory to its last turn under ``mode``; the makespan and prefill totals."""
    outputs = workload.draw()
    now = 0.0
    router = TurnRouter(mode, ttl_s=cluster.trajectory_ttl_s, clock=lambda: now)
    workers = [_Worker(f"w{i}") for i in range(cluster.workers)]
    workers += [_Worker(f"s{i}", serving_index=i) for i in range(cluster.serving)]
    arrivals: list[tuple[float, _Turn]] = [
        (0.0, _Turn(t, 0, workload.prompt_tokens, outputs[t][0]))
        for t in range(workload.trajectories)]
    waiting: list[_Turn] = []
    result = AgenticResult(0.0, 0, 0, 0)
    # Placement changes only when a turn arrives or comes back, one finishes or a serving cap
    # moves: the held turns are tried again only then.
    changed, cap_change = True, cluster.next_serving_change(now)
    stalled_since: float | None = None
    while arrivals or waiting or any(w.running or w.queued for w in workers):
        arrivals.sort(key=lambda a: a[0])
        while arrivals and arrivals[0][0] <= now:
            waiting.append(arrivals.pop(0)[1])
            changed = True
        for worker in workers:
            if worker.busy_until <= now:
                aborted = _reclaim(worker, now, cluster, result)
                waiting += aborted
                changed = changed or bool(aborted)
        if now >= cap_change:
            changed, cap_change = True, cluster.next_serving_change(now)
        if waiting and changed:
            waiting = _dispatch(waiting, workers, router, cluster, now)
        changed = False
        for worker in workers:
            if worker.busy_until <= now and (worker.running or worker.queued) and (
                    worker.running or worker.cap(cluster, now)):
                finished = _step(worker, now, cluster, result)
                changed = changed or bool(finished)
                for turn in finished:
                    turns = len(outputs[turn.trajectory])
                    router.finished(str(turn.trajectory), worker.name, turn.index == turns - 1)
                    _remember(worker, turn, cluster.cache_tokens)
                    if turn.index + 1 < turns:
                        history = turn.history + turn.output + workload.reply_tokens
                        nxt = _Turn(turn.trajectory, turn.index + 1, history,
                                    outputs[turn.trajectory][turn.index + 1])
                        arrivals.append((worker.busy_until + workload.env_s, nxt))
        idle = not arrivals and not any(w.running or w.queued for w in workers)
        stalled_since = (stalled_since if stalled_since is not None else now) \
            if waiting and idle else None
        upcoming = [w.busy_until for w in workers if (w.running or w.queued)
                    and w.busy_until > now]
        upcoming += [a[0] for a in arrivals]
        if cluster.serving and (waiting or any(w.queued for w in workers)):
            upcoming.append(cap_change)
        # Stuck: nothing will happen, or only serving caps move and have for too long.
        if stalled_since is not None and (
                not upcoming or now - stalled_since > cluster.stall_limit_s):
            raise RuntimeError(f"{len(waiting)} turns wait with every worker idle: the router "
                               "holds them (a home that can never take them? see "
                               "ClusterModel.trajectory_ttl_s)")
        if not upcoming:
            continue
        now = min(upcoming)
    result.makespan_s = max(w.busy_until for w in workers)
    return result


def _loads(workers: list[_Worker], cluster: ClusterModel, now: float) -> list[InstanceLoad]:
    """The manager's view. A dedicated worker's cap is its batching plateau; a co-executor's
    is what its admission takes now (no plateau: its capacity is the cap)."""
    return [InstanceLoad(w.name, w.cap(cluster, now),
                         queued=tuple(f"q{id(t)}" for t in w.queued),
                         running=tuple(f"r{id(t)}" for t in w.running),
                         plateau=None if w.serving_index is not None else cluster.slots,
                         serving=w.serving_index is not None,
                         room_tokens=w.kv_room(cluster, now),
                         refusing=now - w.gave_up_at < cluster.refusal_hold_s)
            for w in workers]


def _dispatch(waiting: list[_Turn], workers: list[_Worker], router: TurnRouter,
              cluster: ClusterModel, now: float) -> list[_Turn]:
    """The manager's own turn placement (``TurnRouter.dispatch``); returns the turns held."""
    by_name = {w.name: w for w in workers}
    by_id = {str(id(turn)): turn for turn in waiting}
    placed = router.dispatch(list(by_id), lambda key: str(by_id[key].trajectory),
                             _loads(workers, cluster, now), cluster.theta, select_instance,
                             need_of=lambda key: by_id[key].context + 1)
    for command in placed:
        by_name[command.worker_id].queued.append(by_id.pop(command.request_id))
    return list(by_id.values())


def _step(worker: _Worker, now: float, cluster: ClusterModel, result: AgenticResult
          ) -> list[_Turn]:
    """One engine step from ``now``: admits queued turns into free slots (their prefill minus
    what the worker's cache holds of their history), decodes every running turn."""
    admitted: list[_Turn] = []
    cap = worker.cap(cluster, now)
    while worker.queued and len(worker.running) + len(admitted) < cap:
        turn = worker.queued.pop(0)
        cached = min(worker.cache.get(turn.trajectory, 0), turn.context - 1)
        if cached:
            worker.cache.move_to_end(turn.trajectory)
        turn.prefill = turn.context - cached
        result.prefill_tokens += turn.prefill
        result.cached_tokens += cached
        admitted.append(turn)
    prefill = sum(t.prefill for t in admitted)
    worker.running += admitted
    batch = len(worker.running)
    duration = cluster.decode_s + cluster.per_request_s * batch + cluster.prefill_token_s * prefill
    if worker.serving_index is not None and cluster.in_burst(worker.serving_index, now):
        duration *= cluster.burst_step_factor
    worker.busy_until = now + duration
    finished = []
    for turn in list(worker.running):
        turn.generated += 1
        if turn.generated >= turn.output:
            worker.running.remove(turn)
            finished.append(turn)
            result.turns += 1
    return finished


def _reclaim(worker: _Worker, now: float, cluster: ClusterModel, result: AgenticResult
             ) -> list[_Turn]:
    """A serving burst takes a co-executor's memory back: the turns beyond its cap, and those
    its KV room no longer holds (sent ones first, then the newest running), are aborted and go
    back to the manager with their tokens; its prefix cache is dropped."""
    if worker.serving_index is None:
        return []
    burst = cluster.in_burst(worker.serving_index, now)
    if burst and not worker.bursting:
        worker.cache.clear()
    worker.bursting = burst
    aborted: list[_Turn] = []
    room = worker.kv_room(cluster, now)
    while room is not None and room < 0 and (worker.queued or worker.running):
        turn = worker.queued.pop() if worker.queued else worker.running.pop()
        aborted.append(turn)
        room += turn.context
    if burst:
        cap = worker.cap(cluster, now)
        while len(worker.running) > cap:
            aborted.append(worker.running.pop())
    result.aborted += len(aborted)
    if aborted:
        worker.gave_up_at = now
    return aborted


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
    parser.add_argument("--serving", type=int, default=0,
                        help="serving GPUs lent to the rollout (co-executors with serving bursts)")
    parser.add_argument("--serving-kv-tokens", type=int, default=0,
                        help="a serving GPU's KV tokens for rollout (0: its slots alone bound it)")
    parser.add_argument("--burst-kv-tokens", type=int, default=0,
                        help="... during one of its serving bursts (0: as outside one)")
    parser.add_argument("--trajectory-ttl-s", type=float, default=ClusterModel.trajectory_ttl_s,
                        help="how long a trajectory's home lasts (the manager's default: 120; "
                        "give it with a KV room: a pinned turn that outgrew its home waits it out)")
    parser.add_argument("--workers", type=int, default=ClusterModel.workers,
                        help="dedicated rollout GPUs (and serving GPUs with --serving N)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seeds", type=int, default=1,
                        help="workloads drawn (seed, seed+1, ...): the makespan is the longest "
                        "trajectory's, so one draw is noisy; prints median ratios and spread")
    args = parser.parse_args()
    lo, hi = (int(x) for x in args.turns.split("-"))
    cluster = dataclasses.replace(ClusterModel(), per_request_s=args.per_request_s,
                                  decode_s=args.decode_s, prefill_token_s=args.prefill_token_s,
                                  workers=args.workers, serving=args.serving,
                                  serving_kv_tokens=args.serving_kv_tokens,
                                  burst_kv_tokens=args.burst_kv_tokens,
                                  trajectory_ttl_s=args.trajectory_ttl_s)
    runs = [compare(dataclasses.replace(AgenticWorkload(), trajectories=args.trajectories,
                                        turn_range=(lo, hi), seed=args.seed + k), cluster)
            for k in range(args.seeds)]
    for mode in runs[0]:
        print(f"{mode:18s} makespan {statistics.median(r[mode].makespan_s for r in runs):7.1f} s"
              f"  vs pinned-static (the paper's baseline) {_ratio(runs, 'pinned-static', mode)},"
              f" vs pinned {_ratio(runs, 'pinned', mode)}  prefill "
              f"{statistics.median(r[mode].prefill_tokens for r in runs):>9.0f} tokens, cache hit "
              f"rate {statistics.median(r[mode].hit_rate for r in runs):.0%}, "
              f"{statistics.median(r[mode].aborted for r in runs):.0f} turns aborted by bursts")


def _ratio(runs: list[dict[str, AgenticResult]], base: str, mode: str) -> str:
    """How much faster ``mode`` ran than ``base``: the median over the draws [spread]."""
    return spread([r[base].makespan_s / r[mode].makespan_s for r in runs])


if __name__ == "__main__":
    main()
