"""The job side of the placement scheduler: WEAVE's phase shim and runtime hook (§5.1).

    async with PlacementJob(JobSpec("job-a", t_roll_s=120, t_train_s=60, slo=1.5),
                            etcd_endpoint="127.0.0.1:2379") as job:

        @job.rollout
        async def rollout(run: PhaseRun, prompts):
            ...                                   # runs only on run.node_ids, while permitted
            migration = await run.report_progress(total, finished, open_by_node)
            ...                                   # if not None: consolidate onto migration.keep

        @job.train
        async def train(run: PhaseRun, batch): ...

        for step in range(steps):
            await train(await rollout(prompts))

Instead of durations a job may submit its profiler output, ``JobSpec("job-a",
profile=JobProfile(...), slo=1.5)``; the scheduler plans with the worst-case durations it
estimates from it (every response at the token limit) and returns them in the placement.

Each decorated call blocks until the scheduler grants the job's permit for exactly that phase
and iteration, runs the function, and releases the permit (``async with job.permit(phase)`` does
the same without a decorator). A phase function that raises keeps its permit: the call may be
retried (asking again returns the same permit), or the job leaves when its context exits.

The job is alive as long as its etcd lease is renewed by this process; if the process dies the
lease expires and the scheduler takes the job out of its group (the others go on). Calls follow
the scheduler's leader through failovers: the leader's endpoint is read from the etcd election,
and every call names (job, phase, iteration), so a call repeated against a new leader cannot
make a phase run twice.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, AsyncIterator, TypeVar

import aetcd
import grpc

from rlharvest.common import keys, registry, rpc
from rlharvest.common.etcd_outage import etcd_away, with_etcd
from rlharvest.common.retry import Backoff, retry
from rlharvest.common.pb import placement_scheduler_pb2 as pb, placement_scheduler_pb2_grpc
from rlharvest.services.placement_scheduler.model import JobProfile, Pool

log = logging.getLogger(__name__)
T = TypeVar("T")
_TO_PB = {Pool.ROLLOUT: pb.PHASE_ROLLOUT, Pool.TRAIN: pb.PHASE_TRAIN}


class JobLeftError(RuntimeError):
    """The job is no longer placed (cancelled, failed, or evicted after drift): resubmit it."""


@dataclass(frozen=True)
class JobSpec:
    """What admission needs: the worst-case phase durations, or the profile the scheduler
    estimates them from (give one of the two), the SLO and node needs. ``None`` leaves a field
    unset so the scheduler's default applies; any value given is validated as given."""

    job_id: str
    t_roll_s: float | None = None
    t_train_s: float | None = None
    slo: float | None = None  # the scheduler's default: 1.0 (no slowdown tolerated)
    rollout_nodes: int | None = None  # default 1
    train_nodes: int | None = None  # default 1
    rollout_mem_gb: float = 0.0
    train_mem_gb: float = 0.0
    profile: JobProfile | None = None
    train_state_sharded: bool | None = None  # default True: ZeRO / FSDP (Job.at_dp)

    def to_proto(self) -> pb.PlacementJobSpec:
        fields = {k: v for k, v in asdict(self).items() if v is not None and k != "profile"}
        if self.profile is not None:
            fields["profile"] = pb.PlacementJobProfile(**asdict(self.profile))
        return pb.PlacementJobSpec(**fields)


class _NoLeader(TimeoutError):
    """No scheduler holds the election: retried until the failover timeout, then raised."""


_FAILOVER_BACKOFF = Backoff(first_s=0.1, max_s=1.0)
_EXIT_CANCEL_S = 5.0  # a leaving job waits this long for a leader to cancel it
_unavailable = rpc.status_in(grpc.StatusCode.UNAVAILABLE)


def _failing_over(exc: Exception) -> bool:
    """No scheduler leads yet, the one called is a standby or going away, or etcd (where the
    leader is looked up) is away: all waited out, for as long as the call may."""
    return isinstance(exc, _NoLeader) or _unavailable(exc) or etcd_away(exc)


class SchedulerClient:
    """Calls the leading scheduler; re-resolves the leader and retries while it is UNAVAILABLE
    (failover, restart), for up to ``failover_timeout_s``."""

    def __init__(self, etcd: aetcd.Client | None = None, endpoint: str | None = None,
                 failover_timeout_s: float = 60.0) -> None:
        if etcd is None and endpoint is None:
            raise ValueError("give an etcd client (to find the leader) or a scheduler endpoint")
        self._etcd, self._fixed = etcd, endpoint
        self._failover_timeout = failover_timeout_s
        self._channel: grpc.aio.Channel | None = None
        self._target: str | None = None

    async def leader(self) -> str | None:
        if self._fixed:
            return self._fixed
        assert self._etcd is not None  # one of the two is given
        # One look: etcd away is retried by the call (``_failing_over``), within its deadline.
        found = await with_etcd(functools.partial(
            self._etcd.get_prefix, keys.election_prefix(keys.PLACEMENT_ELECTION).encode(),
            sort_target="create", sort_order="ascend"),
            "finding the placement scheduler's leader", deadline_s=0)
        for kv in found:
            return kv.value.decode()
        return None

    async def _call(self, method: str, request: Any, timeout: float = 30.0,
                    failover_s: float | None = None) -> Any:
        async def once() -> Any:
            target = await self.leader()
            if target is None:
                raise _NoLeader(f"no placement scheduler leads (nothing under "
                                f"{keys.election_prefix(keys.PLACEMENT_ELECTION)}) after "
                                f"{self._failover_timeout}s")
            if target != self._target:
                await self.close()
                # Under TLS only a scheduler's certificate is taken (the leader key is etcd's).
                self._channel, self._target = rpc.channel(target, peer_role="scheduler"), target
            stub = placement_scheduler_pb2_grpc.PlacementSchedulerStub(self._channel)
            return await getattr(stub, method)(request, timeout=timeout)

        async def forget_leader(exc: Exception) -> None:
            if not isinstance(exc, _NoLeader):  # it may be a standby now: find the leader again
                await self.close()

        return await retry(once, retry_if=_failing_over, attempts=None,
                           deadline_s=self._failover_timeout if failover_s is None else failover_s,
                           backoff=_FAILOVER_BACKOFF,
                           what=f"{method} to the placement scheduler", on_retry=forget_leader)

    async def submit(self, spec: JobSpec, lease_id: int = 0,
                     start_iteration: int = 0) -> pb.JobPlacement:
        request = pb.SubmitJobRequest(job=spec.to_proto(), lease_id=lease_id,
                                      start_iteration=start_iteration)
        return await self._call("SubmitJob", request)

    async def cancel(self, job_id: str, reason: str = "",
                     failover_s: float | None = None) -> pb.CancelJobReply:
        """``failover_s``: how long to wait for a leader (default: the client's failover
        timeout)."""
        return await self._call("CancelJob", pb.CancelJobRequest(job_id=job_id, reason=reason),
                                failover_s=failover_s)

    async def placement(self, job_id: str) -> pb.JobPlacement:
        return await self._call("GetPlacement", pb.GetPlacementRequest(job_id=job_id))

    async def acquire(self, job_id: str, phase: Pool, iteration: int,
                      wait_s: float = 10.0) -> pb.PhasePermit:
        """Blocks (in long-polls of ``wait_s``) until the permit is granted."""
        request = pb.AcquirePermitRequest(job_id=job_id, phase=_TO_PB[phase],
                                          iteration=iteration, wait_s=wait_s)
        while True:
            reply = await self._call("AcquirePermit", request, timeout=wait_s + 30)
            if reply.granted:
                return reply.permit

    async def release(self, job_id: str, phase: Pool, iteration: int,
                      wait_s: float = 10.0) -> pb.ReleasePermitReply:
        request = pb.ReleasePermitRequest(job_id=job_id, phase=_TO_PB[phase],
                                          iteration=iteration, wait_s=wait_s)
        while True:
            reply = await self._call("ReleasePermit", request, timeout=wait_s + 30)
            if reply.released or reply.already_released:
                return reply

    async def report_progress(self, job_id: str, iteration: int, total: int, finished: int,
                              unfinished_by_node: Mapping[str, int],
                              requests_per_node: int = 0) -> pb.RolloutProgressReply:
        return await self._call("ReportProgress", pb.RolloutProgressReport(
            job_id=job_id, iteration=iteration, total_responses=total,
            finished_responses=finished, requests_per_node=requests_per_node,
            unfinished_by_node=[pb.NodeOpenRequests(node_id=n, unfinished=c)
                                for n, c in unfinished_by_node.items()]))

    async def state(self) -> pb.PlacementState:
        return await self._call("ListState", pb.ListPlacementStateRequest())

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
        self._channel, self._target = None, None


@dataclass
class PhaseRun:
    """One granted phase, as the phase function sees it."""

    job: PlacementJob
    phase: Pool
    iteration: int
    node_ids: list[str]
    pending_node_ids: list[str] = field(default_factory=list)

    async def report_progress(self, total: int, finished: int,
                              unfinished_by_node: Mapping[str, int],
                              requests_per_node: int = 0) -> pb.TailMigration | None:
        """Runtime hook: the rollout's progress. Returns the long-tail migration to carry out
        (move the open requests onto ``keep_node_ids``; the freed nodes are no longer ours)."""
        if self.phase is not Pool.ROLLOUT:
            raise ValueError("only a rollout phase reports progress")
        reply = await self.job.client.report_progress(
            self.job.spec.job_id, self.iteration, total, finished, unfinished_by_node,
            requests_per_node)
        if not reply.migrate:
            return None
        self.node_ids = list(reply.migration.keep_node_ids)
        return reply.migration


class PlacementJob:
    """Submit a job for its lifetime (async context manager) and run its phases under permits."""

    def __init__(self, spec: JobSpec, etcd_endpoint: str, *, lease_ttl: int = 5,
                 start_iteration: int = 0, endpoint: str | None = None, wait_s: float = 10.0,
                 failover_timeout_s: float = 60.0) -> None:
        self.spec = spec
        self._etcd_endpoint, self._lease_ttl = etcd_endpoint, lease_ttl
        self._endpoint, self._wait_s = endpoint, wait_s
        self._failover_timeout = failover_timeout_s
        self.next_phase: tuple[Pool, int] = (Pool.ROLLOUT, start_iteration)
        self.placement: pb.JobPlacement | None = None
        self.left_reason = ""
        self._etcd: aetcd.Client | None = None
        self._lease: aetcd.Lease | None = None
        self._keepalive: asyncio.Task | None = None
        self.client: SchedulerClient

    async def __aenter__(self) -> PlacementJob:
        self._etcd = await registry.connect(self._etcd_endpoint)
        self._lease = await self._etcd.lease(self._lease_ttl)
        self._keepalive = asyncio.create_task(self._renew(self._lease),
                                              name=f"lease {self.spec.job_id}")
        self.client = SchedulerClient(self._etcd, self._endpoint, self._failover_timeout)
        try:
            self.placement = await self.client.submit(self.spec, self._lease.id,
                                                      self.next_phase[1])
        except BaseException:
            await self._close()
            raise
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        try:
            if not self.left_reason:
                # Not a failover's wait: the lease revoked below takes the job out as well (a
                # scheduler stopping with the whole stack would hold the exit for a minute).
                await self.client.cancel(self.spec.job_id, "job finished"
                                         if exc_info[0] is None else f"job raised {exc_info[1]!r}",
                                         failover_s=_EXIT_CANCEL_S)
        except grpc.aio.AioRpcError as exc:
            if exc.code() is not grpc.StatusCode.NOT_FOUND:
                log.warning("could not cancel job %s (%s); its lease will expire",
                            self.spec.job_id, exc.details())
        except Exception as exc:
            if not etcd_away(exc):  # no leader (_NoLeader), or etcd away, for _EXIT_CANCEL_S
                raise
            log.warning("could not cancel job %s (%s); its lease is revoked now",
                        self.spec.job_id, exc or type(exc).__name__)
        finally:
            await self._close()

    async def _close(self) -> None:
        if self._keepalive is not None:
            self._keepalive.cancel()
        if self._lease is not None:
            try:
                await self._lease.revoke()
            except Exception as exc:
                log.warning("could not revoke the lease of job %s: %r", self.spec.job_id, exc)
        if hasattr(self, "client"):
            await self.client.close()
        if self._etcd is not None:
            await self._etcd.close()

    async def _renew(self, lease: aetcd.Lease) -> None:
        await registry.keep_lease(lease, self._lease_ttl, f"job {self.spec.job_id}")
        # Not put back: the lease is the job's liveness, and the scheduler has taken its lapse
        # for the job's failure (it left its group: its next call is refused as not placed).
        log.error("the lease of job %s lapsed (not renewed within %d s: etcd unreachable, or "
                  "this process stalled): the scheduler counts the job as failed and it will "
                  "have to be submitted again", self.spec.job_id, self._lease_ttl)

    @asynccontextmanager
    async def permit(self, phase: Pool) -> AsyncIterator[PhaseRun]:
        """Hold the permit for the job's next phase, which must be ``phase``."""
        run = await self.acquire(phase)
        yield run
        await self.release(run)

    async def acquire(self, phase: Pool) -> PhaseRun:
        """Block until the scheduler grants the job's next phase, which must be ``phase``
        (asking again before ``release`` returns the same permit)."""
        want, iteration = self.next_phase
        if Pool(phase) is not want:
            raise RuntimeError(f"job {self.spec.job_id!r} must run {want.value} #{iteration} "
                               f"next, not {Pool(phase).value}")
        try:
            granted = await self.client.acquire(self.spec.job_id, want, iteration, self._wait_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() is grpc.StatusCode.NOT_FOUND:
                self.left_reason = exc.details()
                raise JobLeftError(exc.details()) from None
            raise
        return PhaseRun(self, want, iteration, list(granted.node_ids),
                        list(granted.pending_node_ids))

    async def release(self, run: PhaseRun) -> None:
        """The phase ended: its nodes pass to the next job whose turn it is."""
        reply = await self.client.release(self.spec.job_id, run.phase, run.iteration,
                                          self._wait_s)
        self.next_phase = (Pool.TRAIN, run.iteration) if run.phase is Pool.ROLLOUT else \
            (Pool.ROLLOUT, run.iteration + 1)
        if reply.evicted:
            self.left_reason = reply.message
            log.warning("%s", reply.message)

    def phase(self, phase: Pool) -> Callable[[Callable[..., Awaitable[T]]],
                                              Callable[..., Awaitable[T]]]:
        """Decorator: each call of the function runs as one permitted phase."""
        def wrap(fn: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
            @functools.wraps(fn)
            async def run(*args: Any, **kwargs: Any) -> T:
                async with self.permit(phase) as current:
                    return await fn(current, *args, **kwargs)
            return run
        return wrap

    def rollout(self, fn: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
        return self.phase(Pool.ROLLOUT)(fn)

    def train(self, fn: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
        return self.phase(Pool.TRAIN)(fn)
