"""The intra-group round-robin meta-iteration and its cycle-time analysis (WEAVE §4.3, Theorem 1,
Appendix "Proof of Meta-iteration Schedule's Optimality").

``simulate_round_robin`` replays the group's schedule with the *same* permit state machine the
service runs (``permits.PhaseQueues``: each node runs its jobs' phases in round-robin order, a
finished phase makes the job's next phase wait on the other pool), on worst-case durations, and
reports each member's steady-state iteration time T^co-exec. ``fast_round_robin`` is the same
replay on plain integers (held equal to it by a property test); Algorithm 1 (line 10) uses it.

Every member runs each phase once per meta-iteration, so in steady state all members share one
period, bounded below by max(T_cycle, T_load). Theorem 1 says it equals T_cycle when the group
is not overloaded (proved for one rollout node; property-tested here). With overlapping
multi-node rollout placements the period can exceed the bound, which is why we simulate.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from rlharvest.services.placement_scheduler.model import Group, Job, PlacementError, Pool
from rlharvest.services.placement_scheduler.permits import PhaseQueues

# Iterations of the slowest member to simulate; the later half is the steady state we measure.
DEFAULT_ITERATIONS = 8


@dataclass(frozen=True)
class Member:
    """One job as the schedule sees it: phase durations and the rollout nodes it is pinned to."""

    job_id: str
    t_roll: float
    t_train: float
    rollout_node_ids: tuple[str, ...]
    # Long-tail migration (§4.3), for the simulator's actual runs (admission plans the worst
    # case, where every response runs to the limit and no tail frees anything): ``tail_s``
    # into its rollout the phase is tail-bound and keeps only its first ``tail_keep`` nodes;
    # the others pass to the next job's turn. None: never migrates.
    tail_s: float | None = None
    tail_keep: int = 1

    def migrates(self) -> bool:
        return self.tail_s is not None and self.tail_s < self.t_roll and \
            0 < self.tail_keep < len(self.rollout_node_ids)


def members_of(group: Group) -> list[Member]:
    """The group's jobs in round-robin (admission) order, at the group's DP degree."""
    return [Member(j.job_id, j.t_roll, group.train_s(j), group.placements[j.job_id].rollout_node_ids)
            for j in group.jobs.values()]


def t_cycle(jobs: Iterable[Job | Member]) -> float:
    """T_G^cycle = max_j (T_j^roll + T_j^train) (§4.2)."""
    return max((j.t_roll + j.t_train for j in jobs), default=0.0)


def t_load(members: Iterable[Member]) -> float:
    """T_G^load: work on the bottleneck node. Every member trains on every training node, so the
    training side is Σ T_train; a rollout node carries the rollouts pinned to it (§4.2)."""
    train = 0.0
    per_node: dict[str, float] = {}
    for m in members:
        train += m.t_train
        for node_id in m.rollout_node_ids:
            per_node[node_id] = per_node.get(node_id, 0.0) + m.t_roll
    return max(train, max(per_node.values(), default=0.0))


def theorem1_meta_iteration_s(members: Sequence[Member]) -> float | None:
    """Theorem 1: for a group that is not overloaded (T_load <= T_cycle) the round-robin
    meta-iteration completes in exactly T_cycle, the longest member's solo time, which maximises
    the utilisation of both pools. None for an overloaded group, where the theorem is silent."""
    cycle = t_cycle(members)
    return cycle if t_load(members) <= cycle else None


def utilization(members: Sequence[Member], meta_iteration_s: float) -> tuple[float, float]:
    """(U_R, U_T) of one rollout and one training node over a meta-iteration (Appendix)."""
    if meta_iteration_s <= 0:
        raise PlacementError(f"meta-iteration must be > 0 s, got {meta_iteration_s}")
    return (sum(m.t_roll for m in members) / meta_iteration_s,
            sum(m.t_train for m in members) / meta_iteration_s)


def simulate_round_robin(members: Sequence[Member], train_node_ids: Sequence[str] = ("train",),
                         iterations: int = DEFAULT_ITERATIONS) -> dict[str, float]:
    """Steady-state iteration time of every member under the group's FIFO round-robin schedule.

    Runs until every member has finished ``iterations`` iterations and averages each member's
    iteration time over the later half of its completions (the first meta-iteration includes
    start-up queueing that does not repeat).
    """
    if iterations < 2:
        raise PlacementError(f"need >= 2 simulated iterations to measure a period, "
                             f"got {iterations}")
    if not members:
        return {}
    queues = PhaseQueues()
    durations: dict[tuple[str, Pool], float] = {}
    for m in members:
        queues.add_job(m.job_id, m.rollout_node_ids, train_node_ids)
        durations[(m.job_id, Pool.ROLLOUT)] = m.t_roll
        durations[(m.job_id, Pool.TRAIN)] = m.t_train
    by_id = {m.job_id: m for m in members}
    done: dict[str, list[float]] = {m.job_id: [] for m in members}
    events: list[tuple[float, int, str, Pool, bool]] = []  # (.., is the tail point)
    seq, now, unfinished = 0, 0.0, len(members)

    def start(job_id: str, phase: Pool) -> None:
        """The phase's clock starts at its grant, a partial one included: a rollout granted
        part of its nodes while a migrated tail holds the rest runs on those (§4.3: that is
        what the migration is for) and gets the others as the tail releases them."""
        nonlocal seq
        seq += 1
        heapq.heappush(events, (now + durations[(job_id, phase)], seq, job_id, phase, False))
        m = by_id[job_id]
        if phase is Pool.ROLLOUT and m.migrates():
            seq += 1
            heapq.heappush(events, (now + (m.tail_s or 0.0), seq, job_id, phase, True))

    ended: set[str] = set()  # time up, but a node of theirs is still a migrated tail's

    def finish(job_id: str, phase: Pool) -> None:
        nonlocal unfinished
        grown = queues.release(job_id, phase, now)
        if phase is Pool.TRAIN:
            done[job_id].append(now)
            unfinished -= len(done[job_id]) == iterations
        for permit in grown:
            if not permit.pending_node_ids and permit.job_id in ended:
                ended.discard(permit.job_id)
                finish(permit.job_id, permit.phase)

    while True:
        for job_id, phase in queues.runnable():
            if queues.acquire(job_id, phase, now) is not None:
                start(job_id, phase)
        if unfinished == 0:
            break
        now, _, job_id, phase, tail = heapq.heappop(events)
        running = next(p for p in queues.running() if p.job_id == job_id)
        if tail:  # no migration while the rollout still waits for a node itself
            if not running.pending_node_ids:
                m = by_id[job_id]
                queues.shrink(job_id, m.rollout_node_ids[:m.tail_keep])
            continue
        if running.pending_node_ids:
            ended.add(job_id)
            continue
        finish(job_id, phase)
    return {job_id: _steady_period(times) for job_id, times in done.items()}


def fast_round_robin(members: Sequence[Member], iterations: int = DEFAULT_ITERATIONS
                     ) -> dict[str, float]:
    """``simulate_round_robin`` with plain integer state, for Algorithm 1's inner loop.

    Same rules as ``PhaseQueues`` (each node runs its jobs' phases in round-robin order, a gang
    phase starts when it is its turn on all its nodes, the training pool acts as one resource
    because every member trains on all of it) and the same tie-breaking (phases that can start
    together start in admission order; events at equal times complete in start order), so it
    returns identical periods; a property test holds the two together.
    """
    if iterations < 2:
        raise PlacementError(f"need >= 2 simulated iterations to measure a period, "
                             f"got {iterations}")
    index: dict[str, int] = {}
    for m in members:
        for node_id in m.rollout_node_ids:
            index.setdefault(node_id, len(index))
    train = len(index)
    phase_nodes = [[tuple(index[n] for n in m.rollout_node_ids), (train,)] for m in members]
    durations = [(m.t_roll, m.t_train) for m in members]
    cycle: list[list[int]] = [[] for _ in range(train + 1)]
    for j, (roll_nodes, _) in enumerate(phase_nodes):
        for n in (*roll_nodes, train):
            cycle[n].append(j)
    replay = _replay_with_tails if any(m.migrates() for m in members) else _replay_gangs
    done = replay(members, phase_nodes, durations, cycle, iterations)
    return {m.job_id: _steady_period(done[j]) for j, m in enumerate(members)}


Layout = list[list[tuple[int, ...]]]  # per job: (rollout node indices, (the training pool,))


def _replay_gangs(members: Sequence[Member], phase_nodes: Layout,
                  durations: list[tuple[float, float]], cycle: list[list[int]],
                  iterations: int) -> list[list[float]]:
    """No member migrates (admission's worst case): every phase a gang on its nodes. The hot
    path of Algorithm 1, so kept apart from the tails' bookkeeping."""
    turn = [0] * len(cycle)
    busy = [False] * len(cycle)
    phase = [0] * len(members)  # 0: next/running phase is rollout, 1: training
    running = [False] * len(members)
    done: list[list[float]] = [[] for _ in members]
    events: list[tuple[float, int, int]] = []
    dirty, seq, now, unfinished = set(range(len(cycle))), 0, 0.0, len(members)
    while True:
        for j in sorted({cycle[n][turn[n]] for n in dirty if not busy[n]}):
            nodes = phase_nodes[j][phase[j]]
            if not running[j] and all(not busy[n] and cycle[n][turn[n]] == j for n in nodes):
                for n in nodes:
                    busy[n] = True
                running[j] = True
                seq += 1
                heapq.heappush(events, (now + durations[j][phase[j]], seq, j))
        dirty.clear()
        if unfinished == 0:
            return done
        now, _, j = heapq.heappop(events)
        for n in phase_nodes[j][phase[j]]:
            busy[n] = False
            turn[n] = (turn[n] + 1) % len(cycle[n])
            dirty.add(n)
        if phase[j]:
            done[j].append(now)
            unfinished -= len(done[j]) == iterations
        phase[j] ^= 1
        running[j] = False
        dirty.update(phase_nodes[j][phase[j]])


def _replay_with_tails(members: Sequence[Member], phase_nodes: Layout,
                       durations: list[tuple[float, float]], cycle: list[list[int]],
                       iterations: int) -> list[list[float]]:
    """Long-tail migration as the permits grant it: a tail keeps its first nodes, the next
    rollout starts on the freed ones and takes the rest as the tail releases them."""
    return _TailReplay(members, phase_nodes, durations, cycle, iterations).run()


class _TailReplay:
    """The event replay behind ``_replay_with_tails``: each node's turn in ``cycle``, which
    phase each job runs on which nodes, and a heap of phase ends and tail points."""

    def __init__(self, members: Sequence[Member], phase_nodes: Layout,
                 durations: list[tuple[float, float]], cycle: list[list[int]],
                 iterations: int) -> None:
        self.members, self.phase_nodes, self.durations = members, phase_nodes, durations
        self.cycle, self.iterations = cycle, iterations
        nodes, jobs = len(cycle), len(members)
        self.turn = [0] * nodes
        self.busy = [False] * nodes
        self.holder = [-1] * nodes
        self.phase = [0] * jobs  # 0: next/running phase is rollout, 1: training
        self.running = [False] * jobs
        self.tailing = [False] * jobs  # a running rollout shrunk onto its tail
        self.ended = [False] * jobs  # time up, but a node of theirs is still a tail's
        self.held: list[list[int]] = [[] for _ in members]  # nodes a running phase holds
        self.owed: list[list[int]] = [[] for _ in members]  # ... and waits for from a tail
        self.done: list[list[float]] = [[] for _ in members]
        self.events: list[tuple[float, int, int, bool]] = []  # (time, seq, job, tail point?)
        self.dirty, self.seq, self.now, self.unfinished = set(range(nodes)), 0, 0.0, jobs
        self.after_tail: set[int] = set()

    def run(self) -> list[list[float]]:
        while True:
            self._start_granted()
            if self.unfinished == 0:
                return self.done
            self.now, _, j, tail = heapq.heappop(self.events)
            if tail:
                self._tail_point(j)
            elif self.owed[j]:
                self.ended[j] = True
            else:
                self._finish(j)

    def _start_granted(self) -> None:
        """Whose turn it is on a node that changed; and after a tail point, whose turn follows
        on the tail's nodes (they may start on their free nodes now, as in _grantable)."""
        cycle, turn = self.cycle, self.turn
        for j in sorted({cycle[n][turn[n]] for n in self.dirty if not self.busy[n]}
                        | self.after_tail):
            found = None if self.running[j] else self._grant(j)
            if found is None:
                continue
            for n in found[0]:
                self.busy[n], self.holder[n] = True, j
            self.running[j], self.held[j], self.owed[j] = True, found[0], found[1]
            self._push(self.durations[j][self.phase[j]], j, False)
            if self.phase[j] == 0 and self.members[j].migrates():
                self._push(self.members[j].tail_s or 0.0, j, True)
        self.dirty.clear()
        self.after_tail.clear()

    def _push(self, after: float, j: int, tail: bool) -> None:
        self.seq += 1
        heapq.heappush(self.events, (self.now + after, self.seq, j, tail))

    def _grant(self, j: int) -> tuple[list[int], list[int]] | None:
        """As ``PhaseQueues._grantable``: free nodes whose turn is j's, and nodes a migrated
        tail holds whose next turn is j's; None unless every node is one or the other."""
        free, wait = [], []
        for n in self.phase_nodes[j][self.phase[j]]:
            if not self.busy[n] and self.cycle[n][self.turn[n]] == j:
                free.append(n)
            elif self.busy[n] and self.holder[n] != j and self.tailing[self.holder[n]] and \
                    self._next_turn(n) == j:
                wait.append(n)
            else:
                return None
        return (free, wait) if free else None

    def _next_turn(self, n: int) -> int:
        return self.cycle[n][(self.turn[n] + 1) % len(self.cycle[n])]

    def _tail_point(self, j: int) -> None:
        """The tail keeps its first nodes; the others pass to the next job's turn."""
        if self.owed[j]:
            return
        keep = set(self.phase_nodes[j][0][:self.members[j].tail_keep])
        freed = [n for n in self.held[j] if n not in keep]
        self.held[j], self.tailing[j] = [n for n in self.held[j] if n in keep], True
        self.after_tail.update(self._next_turn(n) for n in self.held[j])
        self._pass_turn(freed)

    def _pass_turn(self, nodes: Sequence[int]) -> None:
        """Free ``nodes`` and advance their turn; a partly started rollout waiting for one
        takes it (``PhaseQueues._pass_turn``); one whose time was up finishes then."""
        grown: list[int] = []
        for n in nodes:
            self.busy[n], self.holder[n] = False, -1
            self.turn[n] = (self.turn[n] + 1) % len(self.cycle[n])
            self.dirty.add(n)
            heir = self.cycle[n][self.turn[n]]
            if n in self.owed[heir]:
                self.busy[n], self.holder[n] = True, heir
                self.owed[heir].remove(n)
                self.held[heir].append(n)
                grown.append(heir)
        for j in dict.fromkeys(grown):
            if not self.owed[j] and self.ended[j]:
                self._finish(j)

    def _finish(self, j: int) -> None:
        nodes, self.held[j] = self.held[j], []
        self.ended[j] = self.tailing[j] = self.running[j] = False
        if self.phase[j]:
            self.done[j].append(self.now)
            self.unfinished -= len(self.done[j]) == self.iterations
        self.phase[j] ^= 1
        self.dirty.update(self.phase_nodes[j][self.phase[j]])
        self._pass_turn(nodes)


def co_execution_periods(members: Sequence[Member], iterations: int = DEFAULT_ITERATIONS
                         ) -> dict[str, float]:
    """T^co-exec of every member: the simulated round-robin period, never below the sound lower
    bound max(T_cycle, T_load). A finite replay can still be in its start-up transient (a short
    job drifting into step with a long one); the bound corrects that underestimate."""
    bound = max(t_cycle(members), t_load(members))
    if any(m.migrates() for m in members):
        # With long-tail migration a rollout node's turns overlap (the next rollout runs on the
        # freed nodes while the tail ends on the kept one), so its summed T_roll bounds nothing.
        bound = max(t_cycle(members), sum(m.t_train for m in members))
    return {j: max(p, bound) for j, p in fast_round_robin(members, iterations).items()}


def _steady_period(completions: Sequence[float]) -> float:
    half = len(completions) // 2
    return (completions[-1] - completions[half]) / (len(completions) - 1 - half)


def slo_violations(periods: Mapping[str, float], jobs: Mapping[str, Job],
                   tolerance: float = 1e-9) -> list[str]:
    """Members whose T^co-exec exceeds SLO × T^solo (the constraint of §4.2)."""
    return [j for j, period in periods.items()
            if period > jobs[j].slo_budget * (1 + tolerance) + tolerance]
