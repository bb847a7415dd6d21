"""Discrete-event cluster simulator for placement policies (WEAVE §6.4–§6.5 methodology).

Jobs arrive (Poisson or a trace), are placed by a policy, run their iterations at the pace of
their group's round-robin schedule, and leave when their work is done; their nodes go back to
the pools. Each time a group changes, every member's iteration time T^co-exec is re-derived
with the same round-robin model the scheduler uses (``round_robin.co_execution_periods``), the
members' finish times are moved accordingly, and any member slower than SLO × T_solo is counted
as an SLO miss. Jobs may run faster than the worst case the scheduler planned with
(``SimJob.actual``): periods, SLOs and finish times then follow the actual durations, while
placement still sees the estimates. Long-tail migration (``SimJob.tail_share``): once
tail-bound a rollout keeps a quarter of its units (nodes, or GPU slots with ``rollout_slots``)
and the next job's rollout starts on the others, in the same replay (``Member.tail_s``); at one
slot a node a single-node rollout cannot migrate.
Provisioning cost is integrated over time. Time is simulated, never read.

What the cost model charges: provisioned node-hours, nothing else. A job slowed past its SLO
costs only through living longer (its group's nodes stay provisioned); there is no penalty for
interference beyond round-robin queueing, no cold start (every policy keeps memory residency),
and an overloaded group keeps its bottleneck pool busy, so SLO-blind packing is cheap per hour
by construction. Compare policies on ``total_cost`` (the same trace is the same work): the
time-averaged ``mean_cost_per_hour`` divides by a span that slowed jobs stretch.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from rlharvest.services.placement_scheduler.inter_group import Strategy
from rlharvest.services.placement_scheduler.model import Group, Job, Pool
from rlharvest.services.placement_scheduler.round_robin import (
    Member, co_execution_periods, members_of, slo_violations)
from rlharvest.sim.baselines import Placer
from rlharvest.sim.workloads import SimJob


class Stretch(NamedTuple):
    """A stretch of simulated time in which nothing changed."""

    seconds: float
    job_ids: tuple[str, ...]  # the jobs alive, in arrival order
    cost_per_hour: float  # what the policy had provisioned


@dataclass
class SimResult:
    mean_cost_per_hour: float  # time-average over [first arrival, last departure]: a span
    # that slowed jobs stretch, so compare policies on total_cost
    peak_cost_per_hour: float
    total_cost: float  # $
    peak_gpus: int
    slo_attainment: float  # share of jobs never slower than SLO × T_solo
    mean_slowdown: float  # Σ actual runtime / Σ solo runtime
    strategies: dict[str, int] = field(default_factory=dict)
    timeline: list[Stretch] = field(default_factory=list)  # every stretch with a job alive
    moves: int = 0  # running jobs the policy moved to another group (each a cold start)


@dataclass(frozen=True)
class StaticResult:
    """A batch of concurrent jobs as one policy placed them."""

    cost_per_hour: float
    slo_attainment: float
    work_rate: float  # Σ_j T_solo / T_co-exec: jobs' worth of solo-speed progress per hour

    @property
    def cost_per_work(self) -> float:
        """$ per job-hour of solo-speed progress: what packing past SLOs saves per hour it gives
        back in slower jobs."""
        return self.cost_per_hour / self.work_rate


@dataclass
class _Running:
    sim_job: SimJob
    remaining: float  # iterations left
    period: float  # current seconds per iteration
    since: float  # when ``remaining`` was last brought up to date
    version: int = 0  # finish events carry it; a stale one is ignored


def simulate(jobs: Sequence[SimJob], make_placer: Callable[[], Placer],
             rollout_slots: int = 1) -> SimResult:
    """Replay ``jobs`` against a fresh placer; deterministic for a given job list.
    ``rollout_slots``: the GPU slots per rollout node long-tail migration works at (the
    placement scheduler's ``--rollout-slots``); 1 = whole nodes."""
    placer = make_placer()
    sched = placer.scheduler
    gpu_per_node = {Pool.ROLLOUT: sched.rollout_pool.gpus_per_node,
                    Pool.TRAIN: sched.train_pool.gpus_per_node}
    events: list[tuple[float, int, str, str, int]] = []  # (time, seq, kind, job_id, version)
    for seq, s in enumerate(jobs):
        heapq.heappush(events, (s.arrival_s, seq, "arrive", s.job.job_id, 0))
    by_id = {s.job.job_id: s for s in jobs}
    running: dict[str, _Running] = {}
    missed: set[str] = set()
    strategies: dict[str, int] = {s.value: 0 for s in Strategy}
    timeline: list[Stretch] = []
    seq, start, now = len(jobs), min((s.arrival_s for s in jobs), default=0.0), 0.0
    cost_integral, peak_cost, peak_gpus, solo_time, actual_time = 0.0, 0.0, 0, 0.0, 0.0

    seen: dict[str, tuple[int, int]] = {}  # group id -> (object, version) last refreshed

    def refresh_changed() -> None:
        """Re-derive the periods of every group the last event changed (a policy may re-place
        many jobs at once: the optimum)."""
        for group_id, group in sched.groups.items():
            if seen.get(group_id) != (id(group), group.version):
                seen[group_id] = (id(group), group.version)
                refresh(group)

    def refresh(group: Group) -> None:
        nonlocal seq
        # The scheduler planned with worst-case durations; the jobs run at their actual ones,
        # and each SLO holds against the job's actual solo time.
        actual = {j: by_id[j].running_job for j in group.jobs}
        periods = co_execution_periods([_as_run(m, by_id[m.job_id], group, rollout_slots)
                                        for m in members_of(group)])
        missed.update(slo_violations(periods, actual))
        for job_id, period in periods.items():
            run = running[job_id]
            run.remaining -= (now - run.since) / run.period
            run.since, run.period, run.version = now, period, run.version + 1
            seq += 1
            heapq.heappush(events, (now + run.remaining * period, seq, "finish", job_id,
                                    run.version))

    while events:
        time, _, kind, job_id, version = heapq.heappop(events)
        if kind == "finish" and (job_id not in running or running[job_id].version != version):
            continue
        cost_integral += sched.cost_per_hour() * (time - now) / 3600
        if running and time > now:
            timeline.append(Stretch(time - now, tuple(running), sched.cost_per_hour()))
        now = time
        if kind == "arrive":
            s = by_id[job_id]
            running[job_id] = _Running(s, s.iterations, s.running_job.t_solo, now)
            strategies[placer.submit(s.job).strategy.value] += 1
            refresh_changed()
        else:
            run = running.pop(job_id)
            solo_time += run.sim_job.iterations * run.sim_job.running_job.t_solo
            actual_time += now - run.sim_job.arrival_s
            placer.leave(job_id)
            refresh_changed()
        peak_cost = max(peak_cost, sched.cost_per_hour())
        peak_gpus = max(peak_gpus, sum(sched.nodes_in_use(p) * gpu_per_node[p] for p in Pool))
    span_h = max(now - start, 1e-9) / 3600
    return SimResult(cost_integral / span_h, peak_cost, cost_integral, peak_gpus,
                     1 - len(missed) / max(len(jobs), 1), actual_time / max(solo_time, 1e-9),
                     strategies, timeline, getattr(placer, "moves", 0))


TAIL_KEEP_SHARE = 0.25  # of a rollout's units its tail keeps (2 of 8 GPUs, 1 of 2 nodes)


def _as_run(member: Member, job: SimJob, group: Group, slots: int) -> Member:
    """The member at its actual durations, with its long-tail migration if it has one: the
    tail keeps a quarter of its rollout's units (slots, or nodes at one slot a node)."""
    actual = job.running_job
    run = replace(member, t_roll=actual.t_roll, t_train=group.train_s(actual))
    if job.tail_share is None:
        return run
    units = member.rollout_node_ids if slots == 1 else tuple(
        f"{n}.gpu{k}" for n in member.rollout_node_ids for k in range(slots))
    return replace(run, rollout_node_ids=units, tail_s=job.tail_share * actual.t_roll,
                   tail_keep=max(1, math.ceil(len(units) * TAIL_KEEP_SHARE)))


def static_cost(jobs: Sequence[Job], make_placer: Callable[[], Placer]) -> StaticResult:
    """Place a batch of concurrent jobs in order and measure the result."""
    placer = make_placer()
    for job in jobs:
        placer.submit(job)
    missed, work_rate = set(), 0.0
    for group in placer.scheduler.groups.values():
        periods = co_execution_periods(members_of(group))
        missed.update(slo_violations(periods, group.jobs))
        work_rate += sum(group.jobs[j].t_solo / period for j, period in periods.items())
    return StaticResult(placer.scheduler.cost_per_hour(), 1 - len(missed) / max(len(jobs), 1),
                        work_rate)
