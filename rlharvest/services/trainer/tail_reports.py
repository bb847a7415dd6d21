"""``--placement-scheduler``: the rollout reports its progress so WEAVE's long-tail migration
fires (§4.3, the §5.1 runtime hook).

While the step's rollout holds its permit, every ``--placement-progress-s`` the trainer tells
the scheduler how many of the step's responses are done and how many are still open on each of
the permit's nodes. Once the phase is tail-bound the scheduler shrinks the permit onto the nodes
holding most open requests and passes the others' turn to the next job. Nothing else is needed
here: the placed workers on the freed nodes follow their node's turn (placement_follower.py),
so they leave this job, and its manager moves their open requests, with every token generated,
to the job's workers on the kept nodes (footnote 4: only requests move, so the step's tokens do
not change). One migration per phase: the permit then holds the tail only.

Where the requests are comes from the job's manager (requests assigned per worker) and etcd
(each placed worker's node). The two are read a moment apart from the trainer's own count of
finished responses, so ``open_by_node`` reconciles them: the scheduler needs counts that add up.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from functools import partial

import aetcd
import grpc
from prometheus_client import Counter

from rlharvest.common import registry
from rlharvest.common.etcd_outage import etcd_away, with_etcd
from rlharvest.common.pb import placement_scheduler_pb2 as pb
from rlharvest.services.placement_scheduler.client import PhaseRun
from rlharvest.services.placement_scheduler.model import Pool
from rlharvest.services.rollout_manager.client import manager_status

log = logging.getLogger(__name__)

TAIL_MIGRATIONS = Counter("rlh_trainer_tail_migrations_total", "Rollout phases the placement "
                          "scheduler shrank onto their tail (long-tail migration)")


def open_by_node(open_requests: int, assigned: Mapping[str, int],
                 nodes: Sequence[str]) -> dict[str, int]:
    """Open requests per node of the permit, adding up to ``open_requests``: the manager's
    assignments in proportion (largest remainders first). Requests no worker holds (queued in
    the manager, or between a worker and its successor) count where most already are; with no
    assignment at all they count on the first node."""
    counts = {node: max(assigned.get(node, 0), 0) for node in nodes}
    total = sum(counts.values())
    if not nodes or open_requests <= 0:
        return {node: 0 for node in nodes}
    if total == 0:
        return {node: open_requests if i == 0 else 0 for i, node in enumerate(nodes)}
    shares = {node: counts[node] * open_requests / total for node in nodes}
    out = {node: int(share) for node, share in shares.items()}
    by_remainder = sorted(nodes, key=lambda n: (-(shares[n] - out[n]), -counts[n], n))
    for node in by_remainder[:open_requests - sum(out.values())]:
        out[node] += 1
    return out


async def assigned_by_node(etcd: aetcd.Client, manager: str, job: str) -> dict[str, int]:
    """The job's requests its manager has assigned, summed per placed worker's node."""
    status = await manager_status(manager, timeout=2.0)
    if status is None:
        return {}
    # One look (the reporter tries again next interval); an outage is logged once.
    members = await with_etcd(partial(registry.list_members, etcd, "rollout_worker"),
                              "reading the placed workers' nodes", deadline_s=0)
    node_of = {info.get("worker_id", key.rsplit("/", 1)[-1]): info.get("placement_node")
               for key, info in members.items() if info.get("job") == job}
    out: dict[str, int] = {}
    for worker in status.workers:
        node = node_of.get(worker.worker_id)
        if node:
            out[node] = out.get(node, 0) + worker.assigned
    return out


async def report_until_migrated(run: PhaseRun, etcd: aetcd.Client, manager: Callable[[], str],
                                total: int, finished: Callable[[], int],
                                interval_s: float) -> None:
    """Report the rollout's progress every ``interval_s`` until the scheduler migrates its
    tail (or the caller cancels this at the rollout's end). A report that fails is logged and
    tried again next time: the rollout never waits on it. A cancel that lands while a report
    is on its way lets that report finish on its own: the scheduler may migrate the tail in
    it, and the migration is counted and logged whoever awaits it."""
    job = run.job.spec.job_id
    while True:
        await asyncio.sleep(interval_s)
        done = min(finished(), total)
        report = asyncio.ensure_future(_report_once(run, etcd, manager(), total, done))
        _IN_FLIGHT.add(report)
        report.add_done_callback(partial(_reported, run=run, done=done, total=total))
        try:
            migration = await asyncio.shield(report)
        except (OSError, aetcd.ClientError, grpc.RpcError, TimeoutError) as exc:
            if not etcd_away(exc):  # an outage is logged once, by with_etcd
                log.warning("placement: progress report of job %s failed (%r); next in %.1f s",
                            job, exc, interval_s)
            continue
        if migration is not None:
            return


# Reports a cancelled reporter left running: referenced until they end (the loop keeps only
# weak references to tasks).
_IN_FLIGHT: set[asyncio.Future] = set()


async def _report_once(run: PhaseRun, etcd: aetcd.Client, manager: str, total: int,
                       done: int) -> pb.TailMigration | None:
    job = run.job.spec.job_id
    # The permit as it is now: a rollout started on a tail's freed nodes has since been handed
    # the rest (asking again for a running phase returns its permit).
    permit = await run.job.client.acquire(job, Pool.ROLLOUT, run.iteration, wait_s=0.0)
    run.node_ids = [*permit.node_ids, *permit.pending_node_ids]
    by_node = open_by_node(total - done, await assigned_by_node(etcd, manager, job),
                           run.node_ids)
    return await run.report_progress(total, done, by_node)


def _reported(task: asyncio.Future, run: PhaseRun, done: int, total: int) -> None:
    _IN_FLIGHT.discard(task)
    if task.cancelled() or task.exception() is not None:  # the awaiting reporter logs it
        return
    migration = task.result()
    if migration is not None:
        TAIL_MIGRATIONS.inc()
        log.info("placement: rollout #%d of job %s is tail-bound at %d/%d; its tail keeps "
                 "%s, %s go to the next job", run.iteration, run.job.spec.job_id, done, total,
                 ",".join(migration.keep_node_ids), ",".join(migration.freed_node_ids))
