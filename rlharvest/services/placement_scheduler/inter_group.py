"""Inter-group scheduling: WEAVE Algorithm 1 (§4.2, "Inter-Group Scheduling Algorithm").

For an arriving job j: skip saturated groups (T_load >= T_cycle, line 4); in each remaining group
generate direct-packing and rollout-scaling placements (line 6); drop those that break per-node
memory residency (line 8) or any member's SLO, judged by simulating the round-robin schedule
(line 10); keep the one with minimum marginal cost Δ (lines 12–14); fall back to an isolated group
(lines 15–17). Jobs leave (finish, fail, or drift past saturation) without disturbing the others;
a resubmitted job is a new arrival (§5.3).

How the search stays fast without changing Algorithm 1's answer:
- Δ only takes the values 0 (direct packing), m·c_R (rollout scaling with m new nodes) and the
  isolated cost, so we search Δ levels in increasing order and stop at the first feasible
  placement. Algorithm 1 keeps the first candidate (in group, then placement order) that reaches
  the minimum Δ, which is exactly the first feasible candidate of the lowest feasible level.
- Under round-robin every member iterates once per meta-iteration, and a meta-iteration can be
  no shorter than the longest member's solo time nor than the work queued on any one node:
  T^co-exec >= max(T_cycle, T_load) for every member. A group, or a rollout node, where that
  bound already exceeds the tightest SLO budget is skipped without simulating: a sound
  rejection, never a lost feasible placement. The same bound guards the simulation's estimate
  against start-up transients (we report max(simulated, bound)).
- A group whose members all share one rollout node set is Theorem 1's setting: when it is not
  overloaded its meta-iteration is exactly T_cycle, with no simulation needed.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from functools import partial
from typing import Any, TypeVar

from rlharvest.services.placement_scheduler.model import (
    H20, H800, Group, Job, Node, Placement, PlacementError, Pool, PoolSpec, fits_in_memory)
from rlharvest.services.placement_scheduler.round_robin import (
    DEFAULT_ITERATIONS, Member, co_execution_periods, members_of, slo_violations,
    theorem1_meta_iteration_s)

_EPS = 1e-9


T = TypeVar("T")


class Objective(str, Enum):
    """What admission minimises. ``marginal_cost`` is Algorithm 1 (line 12: Δ). ``cost_per_work``
    is ours: cluster $/h divided by the cluster's work rate (solo-speed iterations per unit
    time, Σ_j T_j^solo / T_j^co-exec), over every feasible placement. With loose SLOs Δ = 0
    packing wins even where it slows the job (and its partners) so much that the cluster pays
    more per unit of work than a group of its own would cost: the jobs hold their nodes longer.
    The option weighs the two; it evaluates every group instead of stopping at the first
    feasible Δ level, so decisions are slower."""

    MARGINAL_COST = "marginal_cost"
    COST_PER_WORK = "cost_per_work"


class Strategy(str, Enum):
    DIRECT_PACKING = "direct_packing"
    ROLLOUT_SCALING = "rollout_scaling"
    ISOLATED = "isolated"


@dataclass(frozen=True)
class Decision:
    """Algorithm 1's answer for one job: where it goes and what that costs."""

    job: Job
    strategy: Strategy
    group_id: str | None  # None: a new, isolated group
    group_version: int  # the group state the decision was computed on
    rollout_node_ids: tuple[str, ...]  # existing rollout nodes the job shares
    new_rollout_nodes: int
    new_train_nodes: int
    marginal_cost_per_hour: float  # Δ = Cost(G') - Cost(G)
    periods: Mapping[str, float] = field(default_factory=dict)  # predicted T^co-exec per member


class InterGroupScheduler:
    """Owns the cluster's co-execution groups; every method is synchronous and I/O free."""

    def __init__(self, rollout_pool: PoolSpec = H20, train_pool: PoolSpec = H800,
                 iterations: int = DEFAULT_ITERATIONS,
                 objective: Objective = Objective.MARGINAL_COST) -> None:
        if rollout_pool.pool is not Pool.ROLLOUT or train_pool.pool is not Pool.TRAIN:
            raise PlacementError("rollout_pool must be a ROLLOUT PoolSpec and train_pool a TRAIN "
                                 f"one; got {rollout_pool.pool.value} and {train_pool.pool.value}")
        self.rollout_pool, self.train_pool, self.iterations = rollout_pool, train_pool, iterations
        self.objective = Objective(objective)
        self._work: dict[str, tuple[int, float]] = {}  # per-group work rate by version
        self._kept_pool: dict[str, int] = {}  # group -> version whose pool could not shrink
        self.groups: dict[str, Group] = {}
        self._job_group: dict[str, str] = {}
        self._members: dict[str, tuple[int, list[Member]]] = {}  # per-group cache by version
        self._serial = {"group": 0, Pool.ROLLOUT: 0, Pool.TRAIN: 0}
        self._nodes_in_use = {Pool.ROLLOUT: 0, Pool.TRAIN: 0}

    # --- queries -------------------------------------------------------------------------------
    def cost_per_hour(self) -> float:
        return sum(g.cost_per_hour for g in self.groups.values())

    def group_of(self, job_id: str) -> Group:
        if job_id not in self._job_group:
            raise PlacementError(f"job {job_id!r} is not placed; submit it first")
        return self.groups[self._job_group[job_id]]

    def nodes_in_use(self, pool: Pool) -> int:
        return self._nodes_in_use[pool]

    # --- Algorithm 1 ---------------------------------------------------------------------------
    def validate(self, job: Job) -> None:
        """Refuse submissions no placement could ever satisfy, saying which limit they break."""
        if job.job_id in self._job_group:
            raise PlacementError(f"job {job.job_id!r} is already placed in group "
                                 f"{self._job_group[job.job_id]}; call leave() before resubmitting")
        for pool, spec, nodes, mem in ((Pool.ROLLOUT, self.rollout_pool, job.rollout_nodes,
                                        job.rollout_mem_gb),
                                       (Pool.TRAIN, self.train_pool, job.train_nodes,
                                        job.train_mem_gb)):
            if spec.max_nodes is not None and nodes > spec.max_nodes:
                raise PlacementError(f"job {job.job_id!r} needs {nodes} {pool.value} nodes but "
                                     f"the {spec.gpu} pool has only {spec.max_nodes}; lower its "
                                     "parallelism or grow the pool")
            if mem > spec.host_mem_gb:
                raise PlacementError(f"job {job.job_id!r} caches {mem} GB per {pool.value} node "
                                     f"but {spec.gpu} nodes have {spec.host_mem_gb} GB host "
                                     "memory; it can never be resident there")

    def schedule(self, job: Job) -> Decision:
        """Algorithm 1: the minimum-marginal-cost placement meeting memory residency and every
        affected SLO. Does not change any state; pass the result to ``admit``."""
        self.validate(job)
        open_groups = [g for g in self.groups.values() if self._may_take(g, job)]
        candidates = []
        for new_nodes in range(job.rollout_nodes + 1):  # Δ levels: 0, c_R, 2c_R, ...
            if not self._capacity_for(new_nodes, 0):
                break
            for group in open_groups:
                if not self._has_slack(group, scaling=new_nodes > 0):
                    continue
                decision = self._first_feasible(group, job, new_nodes)
                if decision is not None and self.objective is Objective.MARGINAL_COST:
                    return decision
                if decision is not None:
                    candidates.append(decision)
        if not self._capacity_for(job.rollout_nodes, job.train_nodes):
            if candidates:  # cost per work, and no room for a group of its own
                return min(candidates, key=self._cost_per_work)
            raise PlacementError(f"job {job.job_id!r} fits no existing group and the pools have no "
                                 f"room for {job.rollout_nodes}+{job.train_nodes} new nodes; wait "
                                 "for jobs to leave or grow the pools")
        cost = (job.rollout_nodes * self.rollout_pool.node_cost_per_hour
                + job.train_nodes * self.train_pool.node_cost_per_hour)
        isolated = Decision(job, Strategy.ISOLATED, None, 0, (), job.rollout_nodes,
                            job.train_nodes, cost, {job.job_id: job.t_solo})
        return min([*candidates, isolated], key=self._cost_per_work) if candidates else isolated

    def _cost_per_work(self, decision: Decision) -> float:
        """Cluster $/h per unit of work rate once ``decision`` is applied (``Objective``)."""
        group = self.groups.get(decision.group_id or "")
        members = {**group.jobs, decision.job.job_id: decision.job} if group else \
            {decision.job.job_id: decision.job}
        rate = self.work_rate() - (self._work_rate(group) if group else 0.0) + sum(
            members[j].t_solo / period for j, period in decision.periods.items())
        return (self.cost_per_hour() + decision.marginal_cost_per_hour) / rate

    def work_rate(self) -> float:
        """Solo-speed iterations the cluster completes per unit time, Σ_j T^solo_j / T^co-exec_j."""
        return sum(self._work_rate(g) for g in self.groups.values())

    def _work_rate(self, group: Group) -> float:
        cached = self._work.get(group.group_id)
        if cached is None or cached[0] != group.version:
            periods = co_execution_periods(self._members_of(group), self.iterations)
            cached = (group.version, sum(group.jobs[j].t_solo / p for j, p in periods.items()))
            self._work[group.group_id] = cached
        return cached[1]

    @staticmethod
    def _has_slack(group: Group, scaling: bool) -> bool:
        """Algorithm 1 line 4, per strategy. Direct packing needs slack on the group's
        bottleneck (T_load < T_cycle). Rollout scaling brings rollout nodes of its own, so only
        a saturated training pool rules it out; a rollout node the group already filled does not
        (the SLO replay of line 10 decides the rest). Pruning every saturated group, as line 4
        reads, sent such arrivals to a new group at the price of its training nodes."""
        if scaling:
            return not group.jobs or group.train_load_s < group.t_cycle
        return not group.saturated

    def _may_take(self, group: Group, job: Job) -> bool:
        """Group-level filters that hold for every placement in the group."""
        if len(group.train_nodes) < job.train_nodes:  # training pools are not scaled (§4.2 fn 2)
            return False
        t_train, mem = job.train_at(len(group.train_nodes))  # DP matched to the pool (fn 3)
        if not fits_in_memory(group.train_mem_gb, mem, group.min_train_mem_gb):
            return False  # line 8, for the training nodes every placement in the group shares
        bound = max(group.t_cycle, job.t_roll + t_train, group.train_load_s + t_train)
        return bound <= min(group.min_slo_budget, job.slo_budget) * (1 + _EPS)

    def _first_feasible(self, group: Group, job: Job, new_nodes: int) -> Decision | None:
        for shared in self._placements(group, job, new_nodes):  # line 6: GENERATEPLACEMENTS
            fresh = tuple(f"new-rollout-{i}" for i in range(new_nodes))
            periods = self._periods(group, job, shared + fresh)
            if not slo_violations(periods, {**group.jobs, job.job_id: job}):  # line 10
                strategy = Strategy.ROLLOUT_SCALING if new_nodes else Strategy.DIRECT_PACKING
                return Decision(job, strategy, group.group_id, group.version, shared, new_nodes,
                                0, new_nodes * self.rollout_pool.node_cost_per_hour, periods)
        return None

    def _placements(self, group: Group, job: Job, new_nodes: int) -> list[tuple[str, ...]]:
        """Existing rollout nodes to share, O(|R_G|) candidates. Nodes lacking host memory for
        the job (line 8) or too loaded to meet the tightest SLO budget are never offered."""
        budget = min(group.min_slo_budget, job.slo_budget) * (1 + _EPS)
        room = [n for n, node in group.rollout_nodes.items()
                if fits_in_memory(group.roll_mem_gb[n], job.rollout_mem_gb, node.host_mem_gb)
                and group.roll_load_s[n] + job.t_roll <= budget]
        need = job.rollout_nodes - new_nodes
        if len(room) < need:
            return []
        if new_nodes:  # rollout scaling: the least-loaded existing nodes plus just enough new ones
            return [tuple(sorted(room, key=lambda n: group.roll_load_s[n])[:need])]
        # Direct packing, best fit first: the busiest nodes that still meet every SLO, so emptier
        # nodes stay free for later arrivals (Algorithm 1 leaves the order open).
        room.sort(key=lambda n: -group.roll_load_s[n])
        windows = [tuple(room[i:i + need]) for i in range(len(room) - need + 1)]
        shared = [p.rollout_node_ids for p in group.placements.values()
                  if len(p.rollout_node_ids) == need and set(p.rollout_node_ids) <= set(room)]
        return list(dict.fromkeys(windows + shared))

    def _periods(self, group: Group, job: Job, rollout_node_ids: tuple[str, ...]
                 ) -> dict[str, float]:
        members = [*self._members_of(group),
                   Member(job.job_id, job.t_roll, group.train_s(job), rollout_node_ids)]
        if len({frozenset(m.rollout_node_ids) for m in members}) == 1:
            cycle = theorem1_meta_iteration_s(members)  # one shared node set: Theorem 1 applies
            if cycle is not None:
                return {m.job_id: cycle for m in members}
        return co_execution_periods(members, self.iterations)

    def _members_of(self, group: Group) -> list[Member]:
        cached = self._members.get(group.group_id)
        if cached is None or cached[0] != group.version:
            cached = (group.version, members_of(group))
            self._members[group.group_id] = cached
        return cached[1]

    def _capacity_for(self, rollout_nodes: int, train_nodes: int) -> bool:
        return all(spec.max_nodes is None or self._nodes_in_use[spec.pool] + n <= spec.max_nodes
                   for spec, n in ((self.rollout_pool, rollout_nodes),
                                   (self.train_pool, train_nodes)))

    # --- state changes -------------------------------------------------------------------------
    def admit(self, decision: Decision) -> Placement:
        """Apply a decision from ``schedule``; refuses a stale one (the group changed since)."""
        job = decision.job
        self.validate(job)
        if decision.group_id is None:
            group = self._new_group(decision.new_train_nodes)
        else:
            existing = self.groups.get(decision.group_id)
            if existing is None or existing.version != decision.group_version:
                raise PlacementError(f"decision for job {job.job_id!r} is stale: group "
                                     f"{decision.group_id} changed since it was computed; call "
                                     "schedule() again")
            group = existing
        fresh = [self._new_node(Pool.ROLLOUT) for _ in range(decision.new_rollout_nodes)]
        for node in fresh:
            group.add_rollout_node(node)
        rollout_node_ids = decision.rollout_node_ids + tuple(n.node_id for n in fresh)
        placement = Placement(job.job_id, rollout_node_ids, tuple(group.train_nodes))
        try:
            group.add(job, placement)
        except PlacementError:  # e.g. a hand-built decision breaking residency: undo the nodes
            self._release_unused(group)
            raise
        self._job_group[job.job_id] = group.group_id
        return placement

    def submit(self, job: Job) -> Decision:
        """Schedule and admit in one step."""
        decision = self.schedule(job)
        self.admit(decision)
        return decision

    def batch_order(self, jobs: Sequence[Job]) -> list[Job]:
        """The order to admit jobs that arrived together in (beyond the paper). Algorithm 1 is
        greedy, so the order matters: a small job admitted first opens a group a larger one
        then cannot join. As first-fit decreasing does for bin packing, the candidates put the
        largest first (by solo period, rollout, training, nodes), beside the arrival order; each
        is admitted tentatively, and the order that places the most jobs at the lowest $/h wins
        (ties: the earlier candidate). The scheduler is left as it was."""
        candidates: list[list[Job]] = [
            sorted(jobs, key=lambda j: -j.t_solo),
            sorted(jobs, key=lambda j: -j.t_roll),
            sorted(jobs, key=lambda j: -j.t_train),
            sorted(jobs, key=lambda j: -(j.rollout_nodes + j.train_nodes)),
            list(jobs)]
        best: tuple[int, float] | None = None
        chosen = candidates[-1]
        for order in candidates:
            outcome, _ = self._tentatively(partial(self._admit_all, order), keep=lambda _: False)
            assert outcome is not None  # _admit_all skips what does not fit: it never raises
            score = (-outcome[0], outcome[1])
            if best is None or score < best:
                best, chosen = score, order
        return chosen

    def _admit_all(self, order: Sequence[Job], touch: Callable[[str | None], None]
                   ) -> tuple[int, float]:
        """Admits what fits of ``order``; how many, and the $/h after."""
        placed = 0
        for job in order:
            try:
                decision = self.schedule(job)
                touch(decision.group_id)
                self.admit(decision)
                placed += 1
            except PlacementError:
                continue
        return placed, self.cost_per_hour()

    def consolidate(self, group_id: str) -> dict[str, Placement]:
        """Beyond the paper: after a departure, dissolve ``group_id`` and admit its members
        again, largest first, if that lowers the cluster's $/h (Algorithm 1 never moves a job,
        so groups thinned by departures stay open while the optimum would repack them). Tried
        tentatively: undone unless cheaper. Returns the members' new placements, or {} when
        nothing moved."""
        members = list(self.groups[group_id].jobs.values())
        before = self.cost_per_hour()

        def repack(touch: Callable[[str | None], None]) -> dict[str, Placement]:
            touch(group_id)
            for job in members:
                self.leave(job.job_id)
            placements = {}
            for job in sorted(members, key=lambda j: -j.t_solo):
                decision = self.schedule(job)
                touch(decision.group_id)
                placements[job.job_id] = self.admit(decision)
            return placements

        moved, kept = self._tentatively(repack,
                                        keep=lambda _: self.cost_per_hour() < before - 1e-9)
        return moved if kept and moved is not None else {}

    def _tentatively(self, change: Callable[[Callable[[str | None], None]], T],
                     keep: Callable[[T], bool]) -> tuple[T | None, bool]:
        """Runs ``change`` on this scheduler and keeps it if ``keep`` says so, else (or when it
        raises PlacementError) puts everything back. Returns what ``change`` returned (None when
        it raised) and whether it was kept. ``change`` calls ``touch(group_id)`` before
        it changes a group; only those groups are copied, so a trial at thousands of jobs costs
        what it touches, not a copy of the whole scheduler."""
        saved = (dict(self.groups), dict(self._job_group), dict(self._members), dict(self._work),
                 dict(self._kept_pool), dict(self._serial), dict(self._nodes_in_use),
                 self._save_extra())
        originals: dict[str, Group] = {}

        def touch(group_id: str | None) -> None:
            if group_id is not None and group_id not in originals and group_id in saved[0]:
                originals[group_id] = copy.deepcopy(saved[0][group_id])

        result: T | None = None
        try:
            result = change(touch)
            if keep(result):
                return result, True
        except PlacementError:
            result = None
        (groups, self._job_group, self._members, self._work, self._kept_pool, self._serial,
         self._nodes_in_use, extra) = saved
        self.groups = {gid: originals.get(gid, group) for gid, group in groups.items()}
        self._restore_extra(extra)
        return result, False

    def _save_extra(self) -> Any:
        """A subclass's own state for ``_tentatively`` to put back (none here)."""
        return None

    def _restore_extra(self, saved: Any) -> None:
        pass

    def leave(self, job_id: str, shrink: bool = True) -> list[str]:
        """Remove a finished or failed job; the rest of its group keeps running. Returns the node
        ids released back to the pools: rollout nodes nobody uses, all nodes of an empty group,
        and (``shrink``) training nodes the remaining members can do without."""
        group = self.group_of(job_id)
        group.remove(job_id)
        del self._job_group[job_id]
        released = self._release_unused(group)
        if shrink and group.jobs:
            released += self.shrink_train_pool(group.group_id)
        return released

    def shrink_train_pool(self, group_id: str) -> list[str]:
        """A group's training pool was sized by the member that needed the most nodes; once no
        member needs them all, shrink it to the fewest nodes (>= every member's minimum) at
        which training memory and every SLO still hold: the others' DP degrees fall and their
        training phases grow (``Job.at_dp``). §4.2 fn 2 defers training-pool *scaling* (growing
        means reconfiguring DP groups of running jobs); a shrink is the same reconfiguration,
        done at a phase boundary, and without it a group keeps paying for training nodes that
        only a departed job needed. Returns the dropped node ids."""
        group = self.groups[group_id]
        if self._kept_pool.get(group_id) == group.version:
            return []  # nothing changed since the last try (the control asks every phase)
        need = max((j.train_nodes for j in group.jobs.values()), default=len(group.train_nodes))
        for keep in range(need, len(group.train_nodes)):
            if self._pool_holds(group, keep):
                dropped = group.shrink_train_pool(keep)
                self._nodes_in_use[Pool.TRAIN] -= len(dropped)
                return dropped
        self._kept_pool[group_id] = group.version
        return []

    def _pool_holds(self, group: Group, keep: int) -> bool:
        if not group.train_state_fits(keep):
            return False
        members = [Member(j.job_id, j.t_roll, j.train_at(keep)[0],
                          group.placements[j.job_id].rollout_node_ids)
                   for j in group.jobs.values()]
        return not slo_violations(co_execution_periods(members, self.iterations), group.jobs)

    def _release_unused(self, group: Group) -> list[str]:
        released = group.drop_idle_rollout_nodes()
        self._nodes_in_use[Pool.ROLLOUT] -= len(released)
        if not group.jobs:
            released += list(group.train_nodes)
            self._nodes_in_use[Pool.TRAIN] -= len(group.train_nodes)
            del self.groups[group.group_id]
            self._members.pop(group.group_id, None)
            self._work.pop(group.group_id, None)
            self._kept_pool.pop(group.group_id, None)
        return released

    def observe_drift(self, job_id: str, t_roll: float, t_train: float) -> bool:
        """Record a job's drifted profile (§5.3): phase times measured in its group, so
        ``t_train`` is at the group's DP degree. True means the job must be stopped and
        resubmitted: the drift made its group overloaded (T_load <= T_cycle before, > after) or
        broke a member's SLO that held before. A group admitted with T_load > T_cycle (rollout
        scaling onto a full node, within every SLO) is not evicted for drift that changes
        neither. The other members are never moved."""
        group = self.group_of(job_id)
        overloaded = group.t_load > group.t_cycle + _EPS
        broken = set(self._violations(group))
        old = group.jobs[job_id]
        at_minimum = t_train * len(group.train_nodes) / old.train_nodes  # undo Job.at_dp
        group.update_job(Job(**{**old.to_dict(), "t_roll": t_roll, "t_train": at_minimum}))
        if not overloaded and group.t_load > group.t_cycle + _EPS:
            return True
        return bool(set(self._violations(group)) - broken)

    def _violations(self, group: Group) -> list[str]:
        periods = co_execution_periods(self._members_of(group), self.iterations)
        return slo_violations(periods, group.jobs)

    def _new_group(self, train_nodes: int) -> Group:
        self._serial["group"] += 1
        group = Group(f"group-{self._serial['group']}")
        for _ in range(train_nodes):
            node = self._new_node(Pool.TRAIN)
            group.train_nodes[node.node_id] = node
        self.groups[group.group_id] = group
        return group

    def _new_node(self, pool: Pool) -> Node:
        spec = self.rollout_pool if pool is Pool.ROLLOUT else self.train_pool
        self._serial[pool] += 1
        self._nodes_in_use[pool] += 1
        return Node(f"{pool.value}-{self._serial[pool]}", pool, spec.node_cost_per_hour,
                    spec.host_mem_gb)

    # --- persistence ---------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"groups": [g.to_dict() for g in self.groups.values()],
                "serial": {"group": self._serial["group"], "rollout": self._serial[Pool.ROLLOUT],
                           "train": self._serial[Pool.TRAIN]}}

    def replace_groups(self, groups: Iterable[Group]) -> None:
        """Forget every group and hold ``groups`` instead: a restart, or a policy that re-places
        every job at once (the simulator's optimum, migrations free)."""
        self.groups, self._job_group, self._members, self._work = {}, {}, {}, {}
        self._kept_pool = {}
        self._nodes_in_use = {Pool.ROLLOUT: 0, Pool.TRAIN: 0}
        for group in groups:
            self.groups[group.group_id] = group
            self._job_group.update({j: group.group_id for j in group.jobs})
            self._nodes_in_use[Pool.ROLLOUT] += len(group.rollout_nodes)
            self._nodes_in_use[Pool.TRAIN] += len(group.train_nodes)

    def restore(self, data: Mapping[str, Any]) -> None:
        """Resume from ``to_dict`` output (e.g. read back from etcd after a restart)."""
        if self.groups:
            raise PlacementError("restore() needs an empty scheduler; create a new one")
        self.replace_groups(Group.from_dict(row) for row in data["groups"])
        serial = data["serial"]
        self._serial = {"group": serial["group"], Pool.ROLLOUT: serial["rollout"],
                        Pool.TRAIN: serial["train"]}


def placement_mix(decisions: Sequence[Decision]) -> dict[Strategy, float]:
    """Fraction of admissions per strategy (the §6.4 breakdown: packing / scaling / new group)."""
    total = max(len(decisions), 1)
    return {s: sum(d.strategy is s for d in decisions) / total for s in Strategy}
