"""Offline brute-force optimum for small job sets (WEAVE §6.5 "Offline Optimal", Table 5).

Searches every partition of the jobs into groups and, inside each group, every assignment of
jobs to rollout nodes, for the cheapest arrangement meeting memory residency and every SLO under
the same round-robin model. Exponential: meant for <= ~10 jobs. Jobs keep their given
round-robin order inside a group (the paper's optimum may also reorder; with single-node jobs
the order does not change the period, Theorem 1).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from itertools import combinations

from rlharvest.services.placement_scheduler.inter_group import (
    Decision, InterGroupScheduler, Strategy)
from rlharvest.services.placement_scheduler.model import (
    Group, Job, Node, Placement, PlacementError, Pool, PoolSpec, fits_in_memory)
from rlharvest.services.placement_scheduler.round_robin import (
    Member, co_execution_periods, t_cycle)


@dataclass(frozen=True)
class OptimalGroup:
    """One group of the optimum: its jobs in round-robin order, each job's rollout nodes (indices
    into the group's ``rollout_nodes`` new nodes), and its training pool."""

    jobs: tuple[Job, ...]
    node_sets: tuple[tuple[int, ...], ...]
    rollout_nodes: int
    train_nodes: int
    cost_per_hour: float


def offline_optimum(jobs: Sequence[Job], rollout_pool: PoolSpec, train_pool: PoolSpec,
                    max_jobs: int = 12) -> float:
    """Minimum total cost $/h of hosting all ``jobs`` at once."""
    return sum(g.cost_per_hour for g in optimal_groups(jobs, rollout_pool, train_pool, max_jobs))


def optimal_groups(jobs: Sequence[Job], rollout_pool: PoolSpec, train_pool: PoolSpec,
                   max_jobs: int = 12) -> list[OptimalGroup]:
    """The cheapest partition of ``jobs`` into groups, each with its node assignment."""
    if len(jobs) > max_jobs:
        raise PlacementError(f"brute force over {len(jobs)} jobs is intractable; use <= {max_jobs}")
    n = len(jobs)

    @lru_cache(maxsize=None)
    def group(mask: int) -> OptimalGroup | None:
        return _cheapest_group(tuple(jobs[i] for i in range(n) if mask >> i & 1), rollout_pool,
                               train_pool)

    top = max((j.train_nodes for j in jobs), default=1)
    floor = [j.at_dp(top) for j in jobs]  # a job's smallest training time and memory anywhere

    def open_subsets(low: int, rest: int) -> list[int]:
        """Subsets of ``rest`` that might form a feasible group with job ``low``: bounds that
        only grow as members join (training memory and Σ T_train at the largest DP degree any
        group could have, the longest solo time, the tightest SLO budget), so a subset failing
        them fails with any superset too. Enumerating all 2^|rest| subsets was the cost."""
        found: list[int] = []
        order = [i for i in range(n) if rest >> i & 1]
        cap = train_pool.host_mem_gb

        def grow(k: int, sub: int, mem: float, train: float, cycle: float, budget: float) -> None:
            found.append(sub)
            for t in range(k, len(order)):
                j = floor[order[t]]
                state = (mem + j.train_mem_gb, train + j.t_train, max(cycle, j.t_solo),
                         min(budget, jobs[order[t]].slo_budget))
                if fits_in_memory(0.0, state[0], cap) and \
                        max(state[1], state[2]) <= state[3] * (1 + 1e-9):
                    grow(t + 1, sub | 1 << order[t], *state)

        j = floor[low]
        grow(0, 0, j.train_mem_gb, j.t_train, j.t_solo, jobs[low].slo_budget)
        return found

    @lru_cache(maxsize=None)
    def best(mask: int) -> tuple[float, tuple[int, ...]]:
        if mask == 0:
            return 0.0, ()
        low = mask & -mask
        rest = mask ^ low
        result: tuple[float, tuple[int, ...]] = (math.inf, ())
        for sub in open_subsets(low.bit_length() - 1, rest):  # groups with the lowest job
            found = group(sub | low)
            if found is not None and found.cost_per_hour < result[0]:
                cost, masks = best(rest ^ sub)
                if found.cost_per_hour + cost < result[0]:
                    result = (found.cost_per_hour + cost, (sub | low, *masks))
        return result

    cost, masks = best((1 << n) - 1)
    if math.isinf(cost):
        raise PlacementError("no partition meets every SLO: a job's own group always should; "
                             "check the jobs' SLOs (>= 1) and memory")
    return [g for m in masks if (g := group(m)) is not None]


def regrouping_optimum(job_sets: Iterable[Sequence[str]], jobs: Mapping[str, Job],
                       rollout_pool: PoolSpec, train_pool: PoolSpec,
                       max_jobs: int = 16) -> dict[frozenset[str], float]:
    """The optimum $/h of every set of concurrently alive jobs (e.g. ``SimResult.timeline``),
    each regrouped from scratch with migrations free: the §6.5 "Offline Optimal", which may
    re-order and re-group at every arrival and departure. Jobs keep the order of ``jobs``
    (arrival order) inside a group."""
    order = {job_id: i for i, job_id in enumerate(jobs)}
    cost: dict[frozenset[str], float] = {}
    for job_ids in job_sets:
        key = frozenset(job_ids)
        if key not in cost:
            members = [jobs[j] for j in sorted(key, key=order.__getitem__)]
            cost[key] = offline_optimum(members, rollout_pool, train_pool, max_jobs)
    return cost


@lru_cache(maxsize=1 << 20)  # consecutive alive sets of a trace share most of their groups
def _cheapest_group(members: tuple[Job, ...], rollout_pool: PoolSpec,
                    train_pool: PoolSpec) -> OptimalGroup | None:
    train_nodes = max(j.train_nodes for j in members)
    running = [j.at_dp(train_nodes) for j in members]  # DP matched to the pool (§4.2 fn 3)
    if not fits_in_memory(0.0, sum(j.train_mem_gb for j in running), train_pool.host_mem_gb):
        return None
    budget = min(j.slo_budget for j in members)
    if max(t_cycle(running), sum(j.t_train for j in running)) > budget:
        return None  # no round-robin schedule is that fast (Theorem 1 lower bound)
    best: list[tuple[int, ...]] = []  # the cheapest node sets found
    fewest = [math.inf]

    def assign(i: int, node_sets: list[tuple[int, ...]], loads: list[float],
               mem: list[float]) -> None:
        if len(loads) >= fewest[0]:
            return
        if i == len(members):
            group = [Member(j.job_id, j.t_roll, j.t_train, tuple(map(str, nodes)))
                     for j, nodes in zip(running, node_sets)]
            periods = co_execution_periods(group)
            if all(periods[j.job_id] <= j.slo_budget * (1 + 1e-9) for j in members):
                fewest[0], best[:] = len(loads), node_sets
            return
        job = members[i]
        for fresh in range(job.rollout_nodes + 1):  # nodes opened for this job
            old = job.rollout_nodes - fresh
            for shared in combinations(range(len(loads)), old):
                nodes = (*shared, *range(len(loads), len(loads) + fresh))
                new_loads = loads + [0.0] * fresh
                new_mem = mem + [0.0] * fresh
                ok = True
                for k in nodes:
                    ok &= fits_in_memory(new_mem[k], job.rollout_mem_gb, rollout_pool.host_mem_gb)
                    new_loads[k] += job.t_roll
                    new_mem[k] += job.rollout_mem_gb
                    ok &= new_loads[k] <= budget
                if ok:
                    assign(i + 1, node_sets + [nodes], new_loads, new_mem)

    assign(0, [], [], [])
    if math.isinf(fewest[0]):
        return None
    rollout_nodes = int(fewest[0])
    return OptimalGroup(members, tuple(best), rollout_nodes, train_nodes,
                        rollout_nodes * rollout_pool.node_cost_per_hour
                        + train_nodes * train_pool.node_cost_per_hour)


class OptimumPlacer:
    """The optimum as a policy the simulator runs on its own timeline (§6.5 "Offline Optimal"):
    every arrival (and, with ``regroup_at_departures``, every departure) re-places all alive
    jobs from scratch into ``optimal_groups``, migrations free. Without regrouping at
    departures a departure only removes the job (idle rollout nodes released, the training pool
    shrunk), as WEAVE does: the reading the issue calls "assigned at arrivals only"."""

    def __init__(self, rollout_pool: PoolSpec, train_pool: PoolSpec,
                 regroup_at_departures: bool, max_jobs: int = 40) -> None:
        self.scheduler = InterGroupScheduler(rollout_pool, train_pool)
        self.regroup_at_departures, self.max_jobs = regroup_at_departures, max_jobs
        self._alive: dict[str, Job] = {}  # arrival order
        self._serial = 0

    def submit(self, job: Job) -> Decision:
        self._alive[job.job_id] = job
        self._regroup()
        group = self.scheduler.group_of(job.job_id)
        strategy = Strategy.ISOLATED if len(group.jobs) == 1 else Strategy.DIRECT_PACKING
        return Decision(job, strategy, group.group_id, group.version, (), 0, 0, 0.0)

    def leave(self, job_id: str) -> None:
        del self._alive[job_id]
        if self.regroup_at_departures:
            self._regroup()
        else:
            self.scheduler.leave(job_id)

    def _regroup(self) -> None:
        found = optimal_groups(list(self._alive.values()), self.scheduler.rollout_pool,
                               self.scheduler.train_pool, self.max_jobs)
        self.scheduler.replace_groups(self._group(g) for g in found)

    def _group(self, found: OptimalGroup) -> Group:
        self._serial += 1
        tag = self._serial
        rollout = [self._node(Pool.ROLLOUT, f"r{tag}-{i}") for i in range(found.rollout_nodes)]
        train = [self._node(Pool.TRAIN, f"t{tag}-{i}") for i in range(found.train_nodes)]
        placements = {j.job_id: Placement(j.job_id, tuple(rollout[k].node_id for k in nodes),
                                          tuple(n.node_id for n in train))
                      for j, nodes in zip(found.jobs, found.node_sets)}
        return Group(f"opt-{tag}", {n.node_id: n for n in rollout},
                     {n.node_id: n for n in train}, {j.job_id: j for j in found.jobs}, placements)

    def _node(self, pool: Pool, node_id: str) -> Node:
        spec = self.scheduler.rollout_pool if pool is Pool.ROLLOUT else self.scheduler.train_pool
        return Node(node_id, pool, spec.node_cost_per_hour, spec.host_mem_gb)
