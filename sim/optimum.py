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
from functools import lru_cache
from itertools import combinations

from rlharvest.services.placement_scheduler.model import (
    Job, PlacementError, PoolSpec, fits_in_memory)
from rlharvest.services.placement_scheduler.round_robin import (
    Member, co_execution_periods, t_cycle)


def offline_optimum(jobs: Sequence[Job], rollout_pool: PoolSpec, train_pool: PoolSpec,
                    max_jobs: int = 12) -> float:
    """Minimum total cost $/h of hosting all ``jobs`` at once."""
    if len(jobs) > max_jobs:
        raise PlacementError(f"brute force over {len(jobs)} jobs is intractable; use <= {max_jobs}")
    n = len(jobs)

    @lru_cache(maxsize=None)
    def group_cost(mask: int) -> float:
        members = [jobs[i] for i in range(n) if mask >> i & 1]
        return _cheapest_group(members, rollout_pool, train_pool)

    @lru_cache(maxsize=None)
    def best(mask: int) -> float:
        if mask == 0:
            return 0.0
        low = mask & -mask
        rest = mask ^ low
        result, sub = math.inf, rest
        while True:  # every subset of ``rest``, joined with the lowest job
            cost = group_cost(sub | low)
            if cost < result:
                result = min(result, cost + best(rest ^ sub))
            if sub == 0:
                break
            sub = (sub - 1) & rest
        return result

    return best((1 << n) - 1)


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


def _cheapest_group(members: list[Job], rollout_pool: PoolSpec, train_pool: PoolSpec) -> float:
    train_nodes = max(j.train_nodes for j in members)
    running = [j.at_dp(train_nodes) for j in members]  # DP matched to the pool (§4.2 fn 3)
    if not fits_in_memory(0.0, sum(j.train_mem_gb for j in running), train_pool.host_mem_gb):
        return math.inf
    budget = min(j.slo_budget for j in members)
    if max(t_cycle(running), sum(j.t_train for j in running)) > budget:
        return math.inf  # no round-robin schedule is that fast (Theorem 1 lower bound)
    best = [math.inf]

    def assign(i: int, node_sets: list[tuple[int, ...]], loads: list[float],
               mem: list[float]) -> None:
        if len(loads) >= best[0]:
            return
        if i == len(members):
            group = [Member(j.job_id, j.t_roll, j.t_train, tuple(map(str, nodes)))
                     for j, nodes in zip(running, node_sets)]
            periods = co_execution_periods(group)
            if all(periods[j.job_id] <= j.slo_budget * (1 + 1e-9) for j in members):
                best[0] = len(loads)
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
    if math.isinf(best[0]):
        return math.inf
    return best[0] * rollout_pool.node_cost_per_hour + train_nodes * train_pool.node_cost_per_hour
