"""The placement scheduler's whole decision state, pure: Algorithm 1 on the configured inventory
(inter_group.py), one permit state machine per group (permits.py), the long-tail trigger
(long_tail.py), and per-job bookkeeping (SLO attainment, drift, reclaimed bubbles).

Synchronous, no I/O, time from an injected clock. The service shell serialises calls, persists
``records()`` to etcd after every change, and answers RPCs from the return values; a restarted
or standby scheduler rebuilds the same object with ``restore(records)``.

Every permit call names the exact (phase, iteration) it is about. Phases are totally ordered per
job (rollout i < train i < rollout i+1), so a repeated call is recognised: asking again for the
running phase returns its permit, releasing an already released phase is a no-op, and asking for
a phase that already ran is refused — a phase never runs twice, whatever the client retries.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import grpc

from rlharvest.common.errors import ServiceError
from rlharvest.services.placement_scheduler.inter_group import (
    Decision, InterGroupScheduler, Objective)
from rlharvest.services.placement_scheduler.long_tail import (
    RolloutProgress, TailMigration, plan_tail_migration)
from rlharvest.services.placement_scheduler.model import (
    Group, Job, JobProfile, Node, PlacementError, Pool, PoolSpec)
from rlharvest.services.placement_scheduler.permits import RUNNING, Permit, PhaseQueues

_JOB_ID = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")


class Refusal(ServiceError):
    """A request the scheduler refuses. ``kind`` (the metrics label) names its status:
    invalid, precondition, exists, not_found or exhausted."""

    _STATUS = {"invalid": grpc.StatusCode.INVALID_ARGUMENT,
               "precondition": grpc.StatusCode.FAILED_PRECONDITION,
               "exists": grpc.StatusCode.ALREADY_EXISTS,
               "not_found": grpc.StatusCode.NOT_FOUND,
               "exhausted": grpc.StatusCode.RESOURCE_EXHAUSTED}

    def __init__(self, kind: str, message: str):
        super().__init__(message, code=self._STATUS[kind])
        self.kind = kind


class InventoryScheduler(InterGroupScheduler):
    """Algorithm 1 over a fixed set of named hosts: a node Algorithm 1 provisions is the first
    configured host of its pool that no group uses, and a released node becomes free again."""

    def __init__(self, names: Mapping[Pool, Sequence[str]], rollout_pool: PoolSpec,
                 train_pool: PoolSpec, iterations: int,
                 objective: Objective = Objective.MARGINAL_COST) -> None:
        super().__init__(rollout_pool, train_pool, iterations, objective)
        self.names = {pool: list(names[pool]) for pool in Pool}
        self.taken: set[str] = set()

    def _new_node(self, pool: Pool) -> Node:
        spec = self.rollout_pool if pool is Pool.ROLLOUT else self.train_pool
        free = next((n for n in self.names[pool] if n not in self.taken), None)
        if free is None:  # Algorithm 1 checks capacity first; reaching this is a bug, say so
            raise PlacementError(f"no free {pool.value} node left of {self.names[pool]}")
        self.taken.add(free)
        self._nodes_in_use[pool] += 1
        return Node(free, pool, spec.node_cost_per_hour, spec.host_mem_gb)

    def _release_unused(self, group: Group) -> list[str]:
        released = super()._release_unused(group)
        self.taken.difference_update(released)
        return released

    def _save_extra(self) -> Any:
        return set(self.taken)

    def _restore_extra(self, saved: Any) -> None:
        self.taken = saved

    def shrink_train_pool(self, group_id: str) -> list[str]:
        dropped = super().shrink_train_pool(group_id)
        self.taken.difference_update(dropped)
        return dropped

    def restore(self, data: Mapping[str, Any]) -> None:
        super().restore(data)
        for group in self.groups.values():
            for pool, nodes in ((Pool.ROLLOUT, group.rollout_nodes), (Pool.TRAIN,
                                                                       group.train_nodes)):
                unknown = sorted(set(nodes) - set(self.names[pool]))
                if unknown:
                    raise PlacementError(
                        f"persisted group {group.group_id} runs on {pool.value} nodes {unknown} "
                        f"that the configured inventory {self.names[pool]} lacks; add them back "
                        "to the config (or cancel the group's jobs) before starting")
                self.taken.update(nodes)


@dataclass
class JobRecord:
    """What the scheduler remembers about a placed job beyond its group membership."""

    job_id: str
    group_id: str
    lease_id: int
    strategy: str
    marginal_cost_per_hour: float
    predicted_iteration_s: float
    submitted_at: float
    iterations_done: int = 0
    last_iteration_end: float | None = None
    slo_met: int = 0
    slo_missed: int = 0
    tail_freed: list[str] = field(default_factory=list)  # nodes its running rollout gave away
    tail_at: float = 0.0
    # When its running phase got the last node another job's migrated tail held (0: granted
    # whole): its phase time is measured from there, not from the grant.
    whole_at: float = 0.0


@dataclass
class Stats:
    admissions: dict[str, int] = field(default_factory=dict)  # per strategy
    departures: dict[str, int] = field(default_factory=dict)  # per cause
    tail_migrations: int = 0
    consolidation_moves: int = 0  # jobs moved to another group after a departure
    bubble_node_seconds: float = 0.0  # node time freed by migrations before the tail ended
    slo_met: int = 0
    slo_missed: int = 0

    @property
    def slo_attainment(self) -> float:
        measured = self.slo_met + self.slo_missed
        return self.slo_met / measured if measured else 1.0


@dataclass(frozen=True)
class Submission:
    """One SubmitJob: the job's spec (``job_from_spec``), its client's lease, where it resumes."""

    spec: Mapping[str, Any]
    lease_id: int = 0
    start_iteration: int = 0


@dataclass(frozen=True)
class Admission:
    decision: Decision
    rollout_node_ids: tuple[str, ...]
    train_node_ids: tuple[str, ...]
    decision_s: float  # Algorithm 1's running time


@dataclass(frozen=True)
class ReleaseOutcome:
    released: bool
    already_released: bool = False
    evicted: bool = False
    message: str = ""


def _order(phase: Pool, iteration: int) -> int:
    return 2 * iteration + (phase is Pool.TRAIN)


def _describe(phase: Pool, iteration: int) -> str:
    return f"{phase.value} #{iteration}"


def job_from_spec(job_id: str, spec: Mapping[str, Any]) -> Job:
    """The Job a submission describes: ``Job`` fields, with the worst-case durations either given
    (``t_roll``, ``t_train``) or estimated from ``profile`` (a mapping of ``JobProfile`` fields),
    never both. A field absent from ``spec`` takes Job's default; raises PlacementError naming
    whatever is wrong."""
    fields = {k: v for k, v in spec.items() if k != "profile"}
    durations = [k for k in ("t_roll", "t_train") if k in fields]
    if spec.get("profile") is not None:
        if durations:
            raise PlacementError(f"job {job_id!r}: give either a profile or the durations, not "
                                 f"both (got a profile and {durations}); the scheduler estimates "
                                 "the durations from the profile")
        needs = {k: v for k, v in fields.items() if k != "job_id"}
        return Job.from_profile(job_id, JobProfile(**spec["profile"]), **needs)
    if len(durations) < 2:
        missing = sorted({"t_roll", "t_train"} - set(durations))
        raise PlacementError(f"job {job_id!r} gives no {' or '.join(missing)}: submit the "
                             "profiler's worst-case durations (seconds) or a profile to "
                             "estimate them from")
    return Job(**fields)


def slot_units(nodes: Sequence[str], slots: int) -> tuple[str, ...]:
    """Rollout permit units: the nodes themselves, or with ``slots`` > 1 their GPU slots
    ``<node>.gpu<k>`` (where a placed worker says it runs: ``--placement-node``)."""
    if slots == 1:
        return tuple(nodes)
    return tuple(f"{n}.gpu{k}" for n in nodes for k in range(slots))


class PlacementControl:
    def __init__(self, names: Mapping[Pool, Sequence[str]], rollout_pool: PoolSpec,
                 train_pool: PoolSpec, *, iterations: int = 8,
                 objective: Objective = Objective.MARGINAL_COST, tail_threshold: float = 0.8,
                 requests_per_node: int = 64, min_keep_nodes: int = 1,
                 drift_tolerance: float = 1.25, rollout_slots: int = 1,
                 consolidate: bool = False, clock: Callable[[], float] = time.time) -> None:
        if rollout_slots < 1:
            raise PlacementError(f"rollout_slots must be >= 1 GPU per node, got {rollout_slots}")
        self.scheduler = InventoryScheduler(names, rollout_pool, train_pool, iterations,
                                            objective)
        # Permits, node records and long-tail migration work on rollout *slots* (a GPU each,
        # a placed worker each) when a node has several: a single-node rollout can then hand
        # the slots its tail no longer needs to the next job (§4.3 at GPU granularity).
        # Admission (Algorithm 1) stays at whole nodes. One slot: the slot is the node.
        self.rollout_slots = rollout_slots
        self.queues: dict[str, PhaseQueues] = {}  # group id -> its permit state machine
        self.jobs: dict[str, JobRecord] = {}
        self.stats = Stats()
        self.tail_threshold, self.requests_per_node = tail_threshold, requests_per_node
        self.min_keep_nodes, self.drift_tolerance = min_keep_nodes, drift_tolerance
        # Consolidation at departures (beyond the paper): groups thinned by a departure, to be
        # repacked once none of their members holds a permit. Not persisted: a new leader only
        # misses that saving until the next departure.
        self.consolidate = consolidate
        self._thinned: set[str] = set()
        self.clock = clock

    # --- slots ---------------------------------------------------------------------------------
    def units(self, pool: Pool, node_ids: Sequence[str] | None = None) -> tuple[str, ...]:
        """The permit units of ``node_ids`` (default: the whole pool): rollout nodes expand to
        their slots ``<node>.gpu<k>``; training nodes are whole."""
        nodes = self.scheduler.names[pool] if node_ids is None else node_ids
        return tuple(nodes) if pool is Pool.TRAIN else slot_units(nodes, self.rollout_slots)

    def node_of(self, unit: str) -> str:
        """The node a permit unit belongs to."""
        if self.rollout_slots == 1:
            return unit
        node, _, slot = unit.rpartition(".gpu")
        return node if node and slot.isdigit() else unit

    # --- admission -----------------------------------------------------------------------------
    def submit(self, spec: Mapping[str, Any], lease_id: int = 0,
               start_iteration: int = 0) -> Admission:
        """Algorithm 1 for one arriving job; Refusal says why it cannot be placed."""
        return self._admit(self._job(spec, lease_id, start_iteration), lease_id, start_iteration)

    def submit_batch(self, submissions: Sequence[Submission]) -> list[Admission | Refusal]:
        """Jobs that arrived together (the service's admission window), admitted in the order
        ``batch_order`` finds cheapest; each one's Admission or Refusal, in the given order."""
        outcomes: list[Admission | Refusal | None] = [None] * len(submissions)
        jobs: dict[str, tuple[int, Job]] = {}
        for i, sub in enumerate(submissions):
            try:
                job = self._job(sub.spec, sub.lease_id, sub.start_iteration)
                if job.job_id in jobs:
                    raise Refusal("exists", f"job {job.job_id!r} was submitted twice at once")
            except Refusal as exc:
                outcomes[i] = exc
                continue
            jobs[job.job_id] = (i, job)
        arrived = [job for _, job in jobs.values()]
        for job in self.scheduler.batch_order(arrived) if len(arrived) > 1 else arrived:
            i = jobs[job.job_id][0]
            try:
                outcomes[i] = self._admit(job, submissions[i].lease_id,
                                          submissions[i].start_iteration)
            except Refusal as exc:
                outcomes[i] = exc
        return [out for out in outcomes if out is not None]

    def _job(self, spec: Mapping[str, Any], lease_id: int, start_iteration: int) -> Job:
        """The submitted job, checked: a Refusal says what is wrong with it."""
        job_id = str(spec.get("job_id", ""))
        if not _JOB_ID.match(job_id):
            raise Refusal("invalid", f"job_id {job_id!r} must be 1-128 characters of "
                                     "[A-Za-z0-9_.-] (it names etcd keys)")
        if start_iteration < 0 or lease_id < 0:
            raise Refusal("invalid", f"job {job_id!r}: start_iteration ({start_iteration}) and "
                                     f"lease_id ({lease_id}) must be >= 0")
        try:
            job = job_from_spec(job_id, spec)
        except PlacementError as exc:
            raise Refusal("invalid", str(exc)) from None
        if job_id in self.jobs:
            raise Refusal("exists", f"job {job_id!r} is already placed in group "
                                    f"{self.jobs[job_id].group_id}; cancel it before resubmitting")
        try:
            self.scheduler.validate(job)
        except PlacementError as exc:
            raise Refusal("precondition", str(exc)) from None
        return job

    def _admit(self, job: Job, lease_id: int, start_iteration: int) -> Admission:
        job_id = job.job_id
        started = time.perf_counter()
        try:
            decision = self.scheduler.schedule(job)
        except PlacementError as exc:  # valid, but no room in the pools right now
            raise Refusal("exhausted", str(exc)) from None
        decision_s = time.perf_counter() - started
        placement = self.scheduler.admit(decision)
        group_id = self.scheduler.group_of(job_id).group_id
        queues = self.queues.setdefault(group_id, PhaseQueues())
        queues.add_job(job_id, self.units(Pool.ROLLOUT, placement.rollout_node_ids),
                       placement.train_node_ids, start_iteration)
        self.jobs[job_id] = JobRecord(
            job_id, group_id, lease_id, decision.strategy.value, decision.marginal_cost_per_hour,
            max(decision.periods.values(), default=job.t_solo), self.clock())
        self.stats.admissions[decision.strategy.value] = \
            self.stats.admissions.get(decision.strategy.value, 0) + 1
        return Admission(decision, placement.rollout_node_ids, placement.train_node_ids,
                         decision_s)

    def cancel(self, job_id: str, cause: str = "cancelled") -> list[str]:
        """The job leaves its group (cancel, failure, drift); the rest of the group goes on.
        Returns the nodes released back to the pools."""
        record = self._record(job_id)
        queues = self.queues[record.group_id]
        self._now_whole(queues.remove_job(job_id), self.clock())
        released = self.scheduler.leave(job_id, shrink=False)
        if record.group_id not in self.scheduler.groups:
            del self.queues[record.group_id]
        else:
            released += self._shrink_train_pool(record.group_id)
        del self.jobs[job_id]
        self.stats.departures[cause] = self.stats.departures.get(cause, 0) + 1
        if self.consolidate and record.group_id in self.scheduler.groups:
            self._thinned.add(record.group_id)
            self._consolidate(record.group_id)
        return released

    def _consolidate(self, group_id: str) -> list[str]:
        """Repack a group thinned by a departure when that is cheaper (``InterGroupScheduler.
        consolidate``), once no member holds a permit: a job moves between two of its phases,
        and its next phase runs on its new group's nodes (its placed workers there load its
        weights). Tried again after every release in the group. Returns the jobs moved."""
        queues = self.queues.get(group_id)
        if queues is None or group_id not in self.scheduler.groups:
            self._thinned.discard(group_id)
            return []
        if queues.running():
            return []
        self._thinned.discard(group_id)
        resume = {job_id: queues.next_phase(job_id)[:2] for job_id in queues.job_ids()}
        moved = self.scheduler.consolidate(group_id)
        if not moved:
            return []
        del self.queues[group_id]  # every member left it: the group is gone
        for job_id, placement in moved.items():
            new_group = self.scheduler.group_of(job_id).group_id
            phase, iteration = resume[job_id]
            self.queues.setdefault(new_group, PhaseQueues()).add_job(
                job_id, self.units(Pool.ROLLOUT, placement.rollout_node_ids),
                placement.train_node_ids, iteration, phase)
            self.jobs[job_id].group_id = new_group
        self.stats.consolidation_moves += len(moved)
        return list(moved)

    def expired(self, alive_job_ids: Iterable[str]) -> list[str]:
        """Jobs tracked by a client lease whose liveness key is gone."""
        alive = set(alive_job_ids)
        return [j for j, r in self.jobs.items() if r.lease_id and j not in alive]

    def fail_expired(self, alive_job_ids: Iterable[str]) -> list[str]:
        """On taking over: jobs whose client lease expired while no scheduler led have failed;
        they leave their groups (their held permits pass on) and the others go on. Returns them."""
        failed = self.expired(alive_job_ids)
        for job_id in failed:
            self.cancel(job_id, "failed")
        return failed

    # --- permits -------------------------------------------------------------------------------
    def acquire(self, job_id: str, phase: Pool, iteration: int) -> Permit | None:
        """The permit for exactly this phase, or None while it is not the job's turn."""
        queues = self.queues[self._record(job_id).group_id]
        nxt_phase, nxt_iteration, status = queues.next_phase(job_id)
        asked, nxt = _order(phase, iteration), _order(nxt_phase, nxt_iteration)
        if asked < nxt:
            raise Refusal("precondition", f"job {job_id!r}: {_describe(phase, iteration)} already "
                          f"ran; its next phase is {_describe(nxt_phase, nxt_iteration)}")
        if asked > nxt:
            raise Refusal("precondition", f"job {job_id!r} asked for "
                          f"{_describe(phase, iteration)} but must first run "
                          f"{_describe(nxt_phase, nxt_iteration)}")
        if status == RUNNING:  # asked again (lost reply, failover): the same permit
            return next(p for p in queues.running() if p.job_id == job_id)
        return queues.acquire(job_id, phase, self.clock())

    def waiting_for(self, job_id: str) -> str:
        """Who the job's next phase waits on, for a human reading a not-granted reply."""
        record = self._record(job_id)
        queues = self.queues[record.group_id]
        phase, _, _ = queues.next_phase(job_id)
        placement = self.scheduler.groups[record.group_id].placements[job_id]
        nodes = self.units(Pool.ROLLOUT, placement.rollout_node_ids) if phase is Pool.ROLLOUT \
            else placement.train_node_ids
        holders = queues.holders()
        parts = [f"{n}: turn {queues.turn(n)}, held by {holders.get(n) or 'nobody'}"
                 for n in nodes]
        return "; ".join(parts)

    def release(self, job_id: str, phase: Pool, iteration: int) -> ReleaseOutcome:
        record = self._record(job_id)
        queues = self.queues[record.group_id]
        nxt_phase, nxt_iteration, status = queues.next_phase(job_id)
        asked, nxt = _order(phase, iteration), _order(nxt_phase, nxt_iteration)
        if asked < nxt:
            return ReleaseOutcome(False, already_released=True,
                                  message=f"{_describe(phase, iteration)} was released before")
        if asked > nxt or status != RUNNING:
            raise Refusal("precondition", f"job {job_id!r} released {_describe(phase, iteration)} "
                          f"but its current phase is {_describe(nxt_phase, nxt_iteration)} "
                          f"({status}); acquire a permit before releasing it")
        permit = next(p for p in queues.running() if p.job_id == job_id)
        if permit.pending_node_ids:
            return ReleaseOutcome(False, message=f"nodes {list(permit.pending_node_ids)} are "
                                  "still held by a migrated tail; release again once they are "
                                  "handed over")
        now = self.clock()
        self._now_whole(queues.release(job_id, phase, now), now)
        if record.tail_freed:
            self.stats.bubble_node_seconds += max(now - record.tail_at, 0.0) * \
                len(record.tail_freed) / self.rollout_slots
            record.tail_freed, record.tail_at = [], 0.0
        job = self.scheduler.groups[record.group_id].jobs[job_id]
        if phase is Pool.TRAIN:
            self._iteration_done(record, job, now)
        # Waiting for nodes a migrated tail still held is not phase time (no false drift).
        started, record.whole_at = max(permit.granted_at, record.whole_at), 0.0
        # Judged at the DP degree the phase ran at: before any shrink of the pool.
        outcome = self._check_drift(job, phase, now - started)
        if phase is Pool.TRAIN and record.group_id in self.scheduler.groups:
            self._shrink_train_pool(record.group_id)
        if record.group_id in self._thinned:
            self._consolidate(record.group_id)
        return outcome

    def _shrink_train_pool(self, group_id: str) -> list[str]:
        """Drop the training nodes the group no longer needs (``shrink_train_pool``), between
        training phases only: a running one keeps its DP degree. Tried again after each
        training phase ends. Returns the dropped nodes."""
        queues = self.queues[group_id]
        if any(p.phase is Pool.TRAIN for p in queues.running()):
            return []
        dropped = self.scheduler.shrink_train_pool(group_id)
        queues.drop_train_nodes(dropped)
        return dropped

    def _now_whole(self, grown: Iterable[Permit], now: float) -> None:
        """Permits that just got the last node a migrated tail held are whole from ``now``."""
        for permit in grown:
            if not permit.pending_node_ids and permit.job_id in self.jobs:
                self.jobs[permit.job_id].whole_at = now

    def _iteration_done(self, record: JobRecord, job: Job, now: float) -> None:
        if record.last_iteration_end is not None:
            within = now - record.last_iteration_end <= job.slo_budget * (1 + 1e-9)
            record.slo_met += within
            record.slo_missed += not within
            self.stats.slo_met += within
            self.stats.slo_missed += not within
        record.iterations_done += 1
        record.last_iteration_end = now

    def _check_drift(self, job: Job, phase: Pool, measured_s: float) -> ReleaseOutcome:
        """§5.3: a phase slower than its worst-case estimate means the profile drifted. The new
        estimate is recorded; if the group no longer holds (saturated past T_cycle or an SLO
        broken) the job leaves so the others keep their SLOs; resubmitted it is a new arrival."""
        running = self.scheduler.group_of(job.job_id).running(job)  # at the group's DP degree
        estimate = running.t_roll if phase is Pool.ROLLOUT else running.t_train
        if not math.isfinite(measured_s) or measured_s <= estimate * self.drift_tolerance:
            return ReleaseOutcome(True)
        t_roll = measured_s if phase is Pool.ROLLOUT else running.t_roll
        t_train = measured_s if phase is Pool.TRAIN else running.t_train
        if not self.scheduler.observe_drift(job.job_id, t_roll, t_train):
            return ReleaseOutcome(True, message=f"{phase.value} took {measured_s:.3g}s against an "
                                  f"estimate of {estimate:.3g}s; estimate updated")
        self.cancel(job.job_id, "drift")
        return ReleaseOutcome(True, evicted=True, message=(
            f"job {job.job_id!r} left its group: its {phase.value} phase took {measured_s:.3g}s "
            f"against an estimate of {estimate:.3g}s, which saturates the group or breaks a "
            "member's SLO; re-profile and resubmit it (it will be placed as a new arrival)"))

    # --- runtime hook: long-tail migration ------------------------------------------------------
    def progress(self, job_id: str, iteration: int, total: int, finished: int,
                 unfinished_by_node: Mapping[str, int],
                 requests_per_node: int = 0) -> TailMigration | None:
        """A running rollout's progress; returns the migration to carry out once it is
        tail-bound (the freed nodes are no longer the job's from this moment)."""
        record = self._record(job_id)
        queues = self.queues[record.group_id]
        nxt_phase, nxt_iteration, status = queues.next_phase(job_id)
        if (nxt_phase, nxt_iteration, status) != (Pool.ROLLOUT, iteration, RUNNING):
            raise Refusal("precondition", f"job {job_id!r} reported progress of rollout "
                          f"#{iteration} but its current phase is "
                          f"{_describe(nxt_phase, nxt_iteration)} ({status})")
        known = set(self.units(Pool.ROLLOUT)) | set(self.units(Pool.TRAIN))
        unknown = sorted(set(unfinished_by_node) - known)
        if unknown:
            raise Refusal("invalid", f"job {job_id!r} reported unknown nodes {unknown}; the "
                          f"cluster's nodes are {sorted(known)}")
        permit = next(p for p in queues.running() if p.job_id == job_id)
        if permit.pending_node_ids:  # it waits for a tail's nodes itself: no migration yet
            return None
        if set(unfinished_by_node) != set(permit.node_ids):
            raise Refusal("precondition", f"job {job_id!r} reported nodes "
                          f"{sorted(unfinished_by_node)} but its rollout holds "
                          f"{sorted(permit.node_ids)}; report every held node")
        if requests_per_node < 0:
            raise Refusal("invalid", f"requests_per_node must be >= 0, got {requests_per_node}")
        try:
            report = RolloutProgress(job_id, total, finished, dict(unfinished_by_node))
            per_unit = -(-(requests_per_node or self.requests_per_node) // self.rollout_slots)
            plan = plan_tail_migration(report, per_unit, self.tail_threshold,
                                       self.min_keep_nodes)
        except PlacementError as exc:
            raise Refusal("invalid", str(exc)) from None
        if plan is None:
            return None
        now = self.clock()
        self._now_whole(queues.shrink(job_id, plan.keep_node_ids), now)
        record.tail_freed += list(plan.freed_node_ids)
        record.tail_at = now
        self.stats.tail_migrations += 1
        return plan

    # --- views ---------------------------------------------------------------------------------
    def record(self, job_id: str) -> JobRecord:
        return self._record(job_id)

    def _record(self, job_id: str) -> JobRecord:
        record = self.jobs.get(job_id)
        if record is None:
            raise Refusal("not_found", f"job {job_id!r} is not placed (never submitted, "
                                       "cancelled, failed or evicted); submit it again")
        return record

    def placement(self, job_id: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
        record = self._record(job_id)
        p = self.scheduler.groups[record.group_id].placements[job_id]
        return p.rollout_node_ids, p.train_node_ids

    def pool_usage(self) -> dict[Pool, tuple[int, int, int]]:
        """(nodes, allocated to a group, held by a permit now) per pool."""
        busy = {self.node_of(n) for q in self.queues.values() for n, h in q.holders().items()
                if h}
        out = {}
        for pool in Pool:
            names = self.scheduler.names[pool]
            out[pool] = (len(names), sum(n in self.scheduler.taken for n in names),
                         sum(n in busy for n in names))
        return out

    # --- persistence ---------------------------------------------------------------------------
    def records(self) -> dict[str, dict[str, Any]]:
        """The whole state as etcd records, keyed relative to the placement prefix. One record
        per group (its members, nodes and permit queues), per job and per placed node (derived
        from the queues, for the node's workers), so a change rewrites only the records it
        touched."""
        data = self.scheduler.to_dict()
        out: dict[str, dict[str, Any]] = {"meta": {"serial": data["serial"],
                                                   "stats": asdict(self.stats)}}
        for row in data["groups"]:
            queues = self.queues[row["group_id"]]
            out[f"groups/{row['group_id']}"] = {"group": row, "queues": queues.to_dict()}
            # Derived, not restored: what the placed workers of each node follow.
            for node_id, view in queues.nodes().items():
                out[f"nodes/{node_id}"] = {**view, "group": row["group_id"]}
        for job_id, record in self.jobs.items():
            out[f"jobs/{job_id}"] = asdict(record)
        return out

    def restore(self, records: Mapping[str, Mapping[str, Any]]) -> None:
        """Resume from ``records()`` read back from etcd; raises PlacementError if they do not
        describe one consistent state."""
        if self.jobs or self.scheduler.groups:
            raise PlacementError("restore() needs a fresh PlacementControl")
        groups = {k.removeprefix("groups/"): v for k, v in records.items()
                  if k.startswith("groups/")}
        meta = records.get("meta", {"serial": {"group": 0, "rollout": 0, "train": 0},
                                    "stats": {}})
        self.scheduler.restore({"groups": [g["group"] for g in groups.values()],
                                "serial": meta["serial"]})
        self.stats = Stats(**meta["stats"])
        for group_id, row in groups.items():
            self.queues[group_id] = PhaseQueues.from_dict(row["queues"])
        for key, row in records.items():
            if key.startswith("jobs/"):
                self.jobs[row["job_id"]] = JobRecord(**row)
        units = set(self.units(Pool.ROLLOUT)) | set(self.units(Pool.TRAIN))
        for group_id, queues in self.queues.items():
            stray = sorted(set(queues.nodes()) - units)
            if stray:
                raise PlacementError(f"persisted group {group_id} runs permits on {stray}, which "
                                     f"this scheduler's nodes and --rollout-slots "
                                     f"{self.rollout_slots} do not have; restart it with the "
                                     "slots it ran with")
        members = {j for g in self.scheduler.groups.values() for j in g.jobs}
        if members != set(self.jobs):
            raise PlacementError(f"persisted state is inconsistent: group members "
                                 f"{sorted(members)} but job records {sorted(self.jobs)}")
