"""Placement policies the simulator compares (WEAVE §6.4–§6.5 baselines).

Every policy has the same two calls, ``submit(job)`` and ``leave(job_id)``, and exposes its
``scheduler`` (an ``InterGroupScheduler`` holding the groups, nodes and costs), so the simulator
measures all of them identically. WEAVE is Algorithm 1 itself; the baselines build their own
decisions and let the same scheduler apply them.
"""

from __future__ import annotations

import random
from typing import Protocol

from rlharvest.services.placement_scheduler.inter_group import (
    Decision, InterGroupScheduler, Objective, Strategy)
from rlharvest.services.placement_scheduler.model import Group, Job, PoolSpec, fits_in_memory
from rlharvest.services.placement_scheduler.round_robin import co_execution_periods, members_of


class Placer(Protocol):
    scheduler: InterGroupScheduler

    def submit(self, job: Job) -> Decision: ...

    def leave(self, job_id: str) -> None: ...


class Weave:
    """Algorithm 1 (inter_group.py), or our cost-per-work admission objective."""

    def __init__(self, rollout_pool: PoolSpec, train_pool: PoolSpec,
                 objective: Objective = Objective.MARGINAL_COST,
                 consolidate: bool = False) -> None:
        self.scheduler = InterGroupScheduler(rollout_pool, train_pool, objective=objective)
        self.consolidate = consolidate
        self.moves = 0  # jobs consolidation moved

    def submit(self, job: Job) -> Decision:
        return self.scheduler.submit(job)

    def leave(self, job_id: str) -> None:
        """A departure; with ``consolidate`` its group's members are then repacked when that
        is cheaper (``InterGroupScheduler.consolidate``; the scheduler's --consolidate)."""
        group_id = self.scheduler.group_of(job_id).group_id
        self.scheduler.leave(job_id)
        if self.consolidate and group_id in self.scheduler.groups:
            self.moves += len(self.scheduler.consolidate(group_id))


class SoloDisaggregation:
    """Solo-D: every job on its own rollout and training nodes, no time-multiplexing."""

    def __init__(self, rollout_pool: PoolSpec, train_pool: PoolSpec) -> None:
        self.scheduler = InterGroupScheduler(rollout_pool, train_pool)

    def submit(self, job: Job) -> Decision:
        decision = _isolated(self.scheduler, job)
        self.scheduler.admit(decision)
        return decision

    def leave(self, job_id: str) -> None:
        self.scheduler.leave(job_id)


class RandomPlacer:
    """Random: a uniformly random group that can hold the job in memory (or a new one), on
    random nodes with room. Blind to SLOs (§6.5)."""

    def __init__(self, rollout_pool: PoolSpec, train_pool: PoolSpec, seed: int) -> None:
        self.scheduler = InterGroupScheduler(rollout_pool, train_pool)
        self._rng = random.Random(seed)

    def submit(self, job: Job) -> Decision:
        options = _with_room(self.scheduler, job)
        pick = self._rng.randrange(len(options) + 1)
        if pick == len(options):
            decision = _isolated(self.scheduler, job)
        else:
            group, room = options[pick]
            nodes = tuple(self._rng.sample(room, job.rollout_nodes))
            decision = _packed(group, job, nodes)
        self.scheduler.admit(decision)
        return decision

    def leave(self, job_id: str) -> None:
        self.scheduler.leave(job_id)


class MostIdlePlacer:
    """Greedy (Most-Idle): the group with the highest idle-time share that can hold the job in
    memory, on its least-loaded rollout nodes; a new group when none can (§6.5)."""

    def __init__(self, rollout_pool: PoolSpec, train_pool: PoolSpec) -> None:
        self.scheduler = InterGroupScheduler(rollout_pool, train_pool)

    def submit(self, job: Job) -> Decision:
        options = _with_room(self.scheduler, job)
        if not options:
            decision = _isolated(self.scheduler, job)
        else:
            group, room = max(options, key=lambda option: _idle_share(option[0]))
            nodes = sorted(room, key=lambda n: group.roll_load_s[n])
            decision = _packed(group, job, tuple(nodes[:job.rollout_nodes]))
        self.scheduler.admit(decision)
        return decision

    def leave(self, job_id: str) -> None:
        self.scheduler.leave(job_id)


def _idle_share(group: Group) -> float:
    """Fraction of node-time the group's nodes sit idle over one meta-iteration."""
    members = members_of(group)
    meta = max(co_execution_periods(members).values())
    busy = sum(m.t_roll * len(m.rollout_node_ids) for m in members)
    busy += sum(m.t_train for m in members) * len(group.train_nodes)
    return 1.0 - busy / (meta * (len(group.rollout_nodes) + len(group.train_nodes)))


def _room(group: Group, job: Job) -> list[str] | None:
    """Rollout nodes with memory for the job, or None if the group cannot hold it at all."""
    if len(group.train_nodes) < job.train_nodes or \
            not fits_in_memory(group.train_mem_gb, group.running(job).train_mem_gb,
                               group.min_train_mem_gb):
        return None
    nodes = [n for n, node in group.rollout_nodes.items()
             if fits_in_memory(group.roll_mem_gb[n], job.rollout_mem_gb, node.host_mem_gb)]
    return nodes if len(nodes) >= job.rollout_nodes else None


def _with_room(scheduler: InterGroupScheduler, job: Job) -> list[tuple[Group, list[str]]]:
    """The groups that can hold ``job``, each with its rollout nodes that have memory for it."""
    return [(g, room) for g in scheduler.groups.values() if (room := _room(g, job)) is not None]


def _packed(group: Group, job: Job, nodes: tuple[str, ...]) -> Decision:
    return Decision(job, Strategy.DIRECT_PACKING, group.group_id, group.version, nodes, 0, 0, 0.0)


def _isolated(scheduler: InterGroupScheduler, job: Job) -> Decision:
    cost = (job.rollout_nodes * scheduler.rollout_pool.node_cost_per_hour
            + job.train_nodes * scheduler.train_pool.node_cost_per_hour)
    return Decision(job, Strategy.ISOLATED, None, 0, (), job.rollout_nodes, job.train_nodes, cost)
