"""The placement scheduler's async shell: RPCs in, ``PlacementControl`` (pure, control.py) decides,
``PlacementStore`` persists every change to etcd before the reply goes out. No policy lives here.

Only the leader (etcd election) holds a ``PlacementControl``; a standby answers UNAVAILABLE with
the leader's address. Calls that change state run one at a time under a lock, and the reply is
sent only after the change is in etcd: a scheduler killed at any point leaves etcd holding
either the state before the call or after it, and the client's retry (same job, phase and
iteration) gets the same answer from whichever scheduler leads next.

etcd away (etcd_outage.py): a call that changes state waits for etcd a few seconds,
then is answered UNAVAILABLE with nothing changed, which the client retries through its failover
timeout; the background work (a lost job, the fence check) waits until etcd answers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

import grpc

from rlharvest.common import errors, keys, registry
from rlharvest.common.aio import wait_event
from rlharvest.common.etcd_outage import etcd_answered, etcd_away, etcd_failed, with_etcd
from rlharvest.common.pb import placement_scheduler_pb2 as pb, placement_scheduler_pb2_grpc
from rlharvest.services.placement_scheduler import metrics
from rlharvest.services.placement_scheduler.config import PlacementConfig
from rlharvest.services.placement_scheduler.control import (
    Admission, PlacementControl, Refusal, Submission)
from rlharvest.services.placement_scheduler.model import Pool
from rlharvest.services.placement_scheduler.store import DeposedError, PlacementStore
from rlharvest.common.retry import Backoff, retry

log = logging.getLogger(__name__)
T = TypeVar("T")

_PHASES = {pb.PHASE_ROLLOUT: Pool.ROLLOUT, pb.PHASE_TRAIN: Pool.TRAIN}
_TO_PB = {Pool.ROLLOUT: pb.PHASE_ROLLOUT, Pool.TRAIN: pb.PHASE_TRAIN}
_WRITE_ATTEMPTS = 3
_WRITE_BACKOFF = Backoff(first_s=0.1, max_s=0.4)
# How long a call that needs etcd waits for it to come back before it is answered UNAVAILABLE,
# nothing changed (the client retries that for its failover timeout, 60 s by default). Short:
# calls that change state queue behind the state lock, and each must be answered well within
# the client's 30 s call timeout (a timed-out call is not retried).
_CALL_ETCD_WAIT_S = 5.0


def new_control(cfg: PlacementConfig, clock: Callable[[], float] = time.time) -> PlacementControl:
    return PlacementControl({pool: cfg.node_names(pool) for pool in Pool},
                            cfg.pool_spec(Pool.ROLLOUT), cfg.pool_spec(Pool.TRAIN),
                            iterations=cfg.iterations, objective=cfg.objective,
                            tail_threshold=cfg.tail_threshold,
                            requests_per_node=cfg.requests_per_node,
                            min_keep_nodes=cfg.min_keep_nodes,
                            drift_tolerance=cfg.drift_tolerance,
                            rollout_slots=cfg.rollout_slots, consolidate=cfg.consolidate,
                            clock=clock)


# proto field -> Job field, for the fields whose absence means "use the default" (proto3 optional).
_OPTIONAL = {"t_roll_s": "t_roll", "t_train_s": "t_train", "slo": "slo",
             "rollout_nodes": "rollout_nodes", "train_nodes": "train_nodes",
             "train_state_sharded": "train_state_sharded"}


def submitted_spec(job: pb.PlacementJobSpec) -> dict[str, Any]:
    """A submission as ``PlacementControl.submit`` takes it. A field the client left unset is
    absent (the model's default applies); one it set, even to 0, is passed on and validated, so a
    0 SLO or node count is refused rather than silently replaced."""
    spec: dict[str, Any] = {"job_id": job.job_id, "rollout_mem_gb": job.rollout_mem_gb,
                            "train_mem_gb": job.train_mem_gb}
    spec.update({name: getattr(job, field) for field, name in _OPTIONAL.items()
                 if job.HasField(field)})
    if job.HasField("profile"):
        profile = job.profile
        spec["profile"] = {f.name: getattr(profile, f.name) for f in profile.DESCRIPTOR.fields
                           if f.name != "turns" or profile.HasField("turns")}
    return spec


class PlacementService(placement_scheduler_pb2_grpc.PlacementSchedulerServicer):
    def __init__(self, cfg: PlacementConfig, etcd: Any, endpoint: str) -> None:
        self._cfg = cfg
        self._etcd = etcd
        self.endpoint = endpoint
        self.control: PlacementControl | None = None  # None while standing by
        self._store: PlacementStore | None = None
        self._lock = asyncio.Lock()
        self._changed = asyncio.Event()  # replaced after every change; long-polls wait on it
        self.deposed = asyncio.Event()
        self.accepting = True
        # --admission-window-s: the submissions waiting for their window to close.
        self._window: list[tuple[Submission, asyncio.Future[Admission | Refusal]]] = []
        self._window_tasks: set[asyncio.Task] = set()
        self._window_timer: asyncio.TimerHandle | None = None

    # ---- leadership ----------------------------------------------------------------------------

    async def lead(self, fence_key: str) -> None:
        """Take over: rebuild the state from etcd, fail jobs whose client lease ran out while no
        scheduler watched, and start answering."""
        store = PlacementStore(self._etcd, fence_key)
        snapshot = await with_etcd(store.load, "reading the placement state to take over")
        control = new_control(self._cfg)
        control.restore(snapshot.records)
        self._store, self.control = store, control
        async with self._lock:
            for job_id in control.fail_expired(snapshot.alive):
                log.warning("job %s: client lease expired while no scheduler led; it left its "
                            "group", job_id)
                metrics.DEPARTURES.labels("failed").inc()
            # Until etcd answers: just elected, this scheduler has nothing else to do first.
            await self._persist(etcd_wait_s=None)
        metrics.LEADER.set(1)
        self._update_gauges()
        log.info("leading with %d groups and %d jobs restored from etcd",
                 len(control.scheduler.groups), len(control.jobs))

    def stop_accepting(self) -> None:
        """Shutting down: calls that change state are refused from now on (UNAVAILABLE)."""
        self.accepting = False

    async def watch_liveness(self) -> None:
        """A job whose client lease expires has failed: it leaves its group. A liveness key
        deleted, or missing from a listing (taking over, or after the watch broke), is one."""
        prefix = keys.placement_alive_prefix()
        async for item in registry.list_and_watch(self._etcd, prefix):
            if isinstance(item, registry.Listing):
                alive = {key.removeprefix(prefix) for key in item.values}
                for job_id in self.control.expired(alive) if self.control else []:
                    await self._job_lost(job_id)
            elif item.value is None:
                await self._job_lost(item.key.removeprefix(prefix))

    async def check_fence(self, fence_key: str) -> None:
        """Stop at once if our election key is gone even while no write would notice."""
        while True:
            await asyncio.sleep(max(self._cfg.lease_ttl / 2, 0.5))
            try:
                found = await self._etcd.get(fence_key.encode())
            except Exception as exc:
                if not etcd_away(exc):
                    raise
                # Checked again next period: a key that lapsed meanwhile is gone then.
                etcd_failed(exc, "checking the scheduler's election key")
                continue
            etcd_answered()
            if found is None:
                self._fatal(DeposedError(f"election key {fence_key} is gone"))
                return

    async def _job_lost(self, job_id: str) -> None:
        """Fail the job; etcd away is waited out, tried again with the state lock let go
        between tries, so calls meanwhile are answered (UNAVAILABLE while etcd is away), not
        held until they time out."""
        await with_etcd(partial(self._fail_lost_job, job_id),
                        f"failing job {job_id}, whose client lease expired")

    async def _fail_lost_job(self, job_id: str) -> None:
        async with self._lock:
            control = self.control
            if control is None or job_id not in control.jobs or not control.jobs[job_id].lease_id:
                return
            if await self._etcd.get(keys.placement_alive_key(job_id).encode()) is not None:
                return  # a resubmission already put a fresh liveness key
            group_id = control.jobs[job_id].group_id
            control.cancel(job_id, "failed")
            await self._persist()  # rolled back and raised when it fails: tried again whole
            log.warning("job %s failed (client lease expired); it left group %s", job_id,
                        group_id)
            metrics.DEPARTURES.labels("failed").inc()
        self._notify()

    # ---- the one path that changes state -------------------------------------------------------

    async def _mutate(self, context: grpc.aio.ServicerContext,
                      change: Callable[[PlacementControl], T]) -> T:
        # Shielded: a client hanging up mid-write must not leave memory ahead of etcd.
        return await asyncio.shield(self._apply(context, change))

    async def _apply(self, context: grpc.aio.ServicerContext,
                     change: Callable[[PlacementControl], T]) -> T:
        async with self._lock:
            control = await self._leader(context)
            try:
                result = change(control)
            except Refusal as exc:  # refused before anything changed
                await errors.abort(context, exc)
            except Exception:
                # A failure halfway through a change (a bug): the next change must not persist
                # the half. Memory goes back to what etcd holds; the call fails (INTERNAL).
                log.exception("a change failed halfway; the state is put back as etcd holds it")
                self._restore_persisted()
                raise
            changed = await self._persist(context)
        # Only a change wakes the long-polls: a permit asked for and not granted changes
        # nothing, and waking its own poll (and every other) for it had each spin until its
        # deadline, thousands of acquires a second.
        if changed:
            self._notify()
        return result

    async def _persist(self, context: grpc.aio.ServicerContext | None = None, *,
                       etcd_wait_s: float | None = _CALL_ETCD_WAIT_S) -> bool:
        """Write the changed records (False: none had changed); on failure put the state back
        as etcd holds it. etcd away is waited out for ``etcd_wait_s`` (None: until it answers);
        past that the call is answered UNAVAILABLE, or without a call the outage's error is
        raised as it is, for a caller that tries again."""
        control, store = self.control, self._store
        assert control is not None and store is not None
        records = control.records()
        leases = {j: r.lease_id for j, r in control.jobs.items()}
        started = time.perf_counter()

        async def write() -> bool:  # a transaction sent again is harmless (store.py)
            return await with_etcd(partial(store.save, records, leases),
                                   "writing the placement state", deadline_s=etcd_wait_s)

        try:
            written = await retry(write, retry_if=_may_retry_write, attempts=_WRITE_ATTEMPTS,
                                  backoff=_WRITE_BACKOFF, what="etcd write of the placement state")
        except DeposedError as exc:
            self._fatal(exc)
            error: Exception = exc
        except Exception as exc:
            if not etcd_away(exc):  # an outage is logged once, by with_etcd
                log.warning("etcd write failed: %r", exc)
            error = exc
        else:
            metrics.ETCD_WRITE_SECONDS.observe(time.perf_counter() - started)
            self._update_gauges()
            return written
        self._restore_persisted()  # memory never runs ahead of etcd
        if context is not None:
            if self.deposed.is_set():
                await errors.abort(context, errors.Unavailable(
                    "this scheduler lost leadership; ask the new leader"))
            await errors.abort(context, errors.Unavailable(
                f"could not persist the change to etcd ({error!r}); nothing changed, retry the "
                "call"))
        if etcd_away(error):
            raise error
        raise RuntimeError(f"could not persist placement state: {error!r}")

    def _restore_persisted(self) -> None:
        """The state as etcd holds it (the last write that succeeded)."""
        assert self._store is not None
        rebuilt = new_control(self._cfg)
        rebuilt.restore(self._store.persisted)
        self.control = rebuilt

    def _fatal(self, exc: Exception) -> None:
        log.error("%s; stopping", exc)
        self.accepting = False
        self.deposed.set()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _leader(self, context: grpc.aio.ServicerContext) -> PlacementControl:
        if not self.accepting:
            await errors.abort(context, errors.Unavailable(
                "scheduler is shutting down; retry against the next leader"))
        if self.control is None:
            await errors.abort(context, errors.Unavailable(
                f"scheduler at {self.endpoint} is a standby; find the leader under the etcd "
                f"election {keys.election_prefix(keys.PLACEMENT_ELECTION)}"))
        return self.control

    # ---- RPCs ----------------------------------------------------------------------------------

    async def SubmitJob(self, request: pb.SubmitJobRequest, context) -> pb.JobPlacement:
        job = request.job
        spec = submitted_spec(job)
        await self._leader(context)
        if request.lease_id > 0 and not await self._lease_alive(context, request.lease_id):
            metrics.SUBMISSIONS.labels("lease_expired").inc()
            await errors.abort(context, errors.FailedPrecondition(
                f"job {job.job_id!r}: etcd lease {request.lease_id:x} does not exist or "
                "expired; submit with a live lease of the job's client"))

        submission = Submission(spec, request.lease_id, request.start_iteration)
        if self._cfg.admission_window_s > 0:
            admission = await self._in_window(context, submission)
        else:
            def submit(control: PlacementControl) -> Admission:
                try:
                    return control.submit(spec, request.lease_id, request.start_iteration)
                except Refusal as exc:
                    metrics.SUBMISSIONS.labels(exc.kind).inc()
                    raise

            admission = await self._mutate(context, submit)
        metrics.SUBMISSIONS.labels(admission.decision.strategy.value).inc()
        metrics.DECISION_SECONDS.observe(admission.decision_s)
        placement = self._placement(job.job_id)
        log.info("job %s placed (%s) in group %s on rollout %s, train %s", job.job_id,
                 admission.decision.strategy.value, placement.group_id,
                 admission.rollout_node_ids, admission.train_node_ids)
        return placement

    async def _lease_alive(self, context: grpc.aio.ServicerContext, lease_id: int) -> bool:
        """Whether a submitting client's lease lives; etcd away is waited out briefly, then the
        call is answered UNAVAILABLE for the client to retry."""
        store = self._store
        assert store is not None  # a leader has its store
        try:
            return await with_etcd(partial(store.lease_alive, lease_id),
                                   "checking a submitted job's client lease",
                                   deadline_s=_CALL_ETCD_WAIT_S)
        except Exception as exc:
            if not etcd_away(exc):
                raise
            await errors.abort(context, errors.Unavailable(
                f"etcd unreachable ({type(exc).__name__}); nothing changed, retry the call"))

    async def _in_window(self, context: grpc.aio.ServicerContext,
                         submission: Submission) -> Admission:
        """``--admission-window-s``: the first submission opens a window; every job submitted
        before it closes is admitted with it, in the order ``batch_order`` finds cheapest
        (largest first, as first-fit decreasing packs bins). Each call gets its own answer;
        ``--admission-window-jobs`` closes the window as soon as that many wait in it."""
        await self._leader(context)
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[Admission | Refusal] = loop.create_future()
        self._window.append((submission, answer))
        if len(self._window) == 1:
            self._window_timer = loop.call_later(self._cfg.admission_window_s,
                                                 self._close_window)
        if 0 < self._cfg.admission_window_jobs <= len(self._window):
            self._close_window()
        try:
            outcome = await asyncio.shield(answer)  # a client hanging up is admitted anyway
        except errors.ServiceError as exc:
            await errors.abort(context, exc)
        if isinstance(outcome, Refusal):
            metrics.SUBMISSIONS.labels(outcome.kind).inc()
            await errors.abort(context, outcome)
        return outcome

    def _close_window(self) -> None:
        if self._window_timer is not None:
            self._window_timer.cancel()
            self._window_timer = None
        task = asyncio.get_running_loop().create_task(self._admit_window())
        self._window_tasks.add(task)
        task.add_done_callback(self._window_tasks.discard)

    async def _admit_window(self) -> None:
        batch, self._window = self._window, []
        metrics.ADMISSION_BATCH.observe(len(batch))
        try:
            async with self._lock:
                control = self.control
                if control is None or not self.accepting:
                    raise errors.Unavailable("the scheduler stopped leading while the job waited "
                                             "in its admission window; retry against the leader")
                outcomes = control.submit_batch([submission for submission, _ in batch])
                try:
                    await self._persist()
                except Exception as exc:  # rolled back to what etcd holds: nothing changed
                    raise errors.Unavailable(f"{exc}; nothing changed, retry the call") from None
        except errors.ServiceError as exc:
            for _, answer in batch:
                answer.set_exception(exc)
            return
        self._notify()
        for (_, answer), outcome in zip(batch, outcomes):
            answer.set_result(outcome)

    async def CancelJob(self, request: pb.CancelJobRequest, context) -> pb.CancelJobReply:
        cause = "cancelled"
        released = await self._mutate(context, lambda c: c.cancel(request.job_id, cause))
        metrics.DEPARTURES.labels(cause).inc()
        log.info("job %s cancelled (%s); released %s", request.job_id,
                 request.reason or "no reason given", released)
        return pb.CancelJobReply(released_node_ids=released)

    async def GetPlacement(self, request: pb.GetPlacementRequest, context) -> pb.JobPlacement:
        control = await self._leader(context)
        try:
            control.record(request.job_id)
        except Refusal as exc:
            await errors.abort(context, exc)
        return self._placement(request.job_id)

    def _placement(self, job_id: str) -> pb.JobPlacement:
        control = self.control
        assert control is not None  # called right after a leader's change or check
        record = control.record(job_id)
        rollout, train = control.placement(job_id)
        job = control.scheduler.groups[record.group_id].jobs[job_id]
        return pb.JobPlacement(job_id=job_id, group_id=record.group_id, strategy=record.strategy,
                               rollout_node_ids=rollout, train_node_ids=train,
                               marginal_cost_per_hour=record.marginal_cost_per_hour,
                               predicted_iteration_s=record.predicted_iteration_s,
                               t_roll_s=job.t_roll, t_train_s=job.t_train)

    async def AcquirePermit(self, request: pb.AcquirePermitRequest, context) -> pb.PermitReply:
        phase, wait_s = await self._permit_args(request, context)
        deadline = asyncio.get_running_loop().time() + wait_s
        while True:
            changed = self._changed
            permit = await self._mutate(
                context, lambda c: c.acquire(request.job_id, phase, request.iteration))
            if permit is not None:
                metrics.PERMITS.labels(phase.value, "granted").inc()
                return pb.PermitReply(granted=True, permit=pb.PhasePermit(
                    job_id=permit.job_id, phase=_TO_PB[permit.phase], iteration=permit.iteration,
                    node_ids=permit.node_ids, pending_node_ids=permit.pending_node_ids,
                    granted_at_unix=permit.granted_at))
            if not await self._wait(changed, deadline):
                assert self.control is not None  # a leader stays one until the process ends
                return pb.PermitReply(granted=False,
                                      waiting_for=self.control.waiting_for(request.job_id))

    async def ReleasePermit(self, request: pb.ReleasePermitRequest,
                            context) -> pb.ReleasePermitReply:
        phase, wait_s = await self._permit_args(request, context)
        deadline = asyncio.get_running_loop().time() + wait_s
        while True:
            changed = self._changed
            outcome = await self._mutate(
                context, lambda c: c.release(request.job_id, phase, request.iteration))
            if outcome.released or outcome.already_released:
                if outcome.released:
                    metrics.PERMITS.labels(phase.value, "released").inc()
                if outcome.evicted:
                    metrics.DEPARTURES.labels("drift").inc()
                    log.warning(outcome.message)
                return pb.ReleasePermitReply(released=outcome.released,
                                             already_released=outcome.already_released,
                                             evicted=outcome.evicted, message=outcome.message)
            if not await self._wait(changed, deadline):
                return pb.ReleasePermitReply(released=False, message=outcome.message)

    async def _permit_args(self, request, context) -> tuple[Pool, float]:
        if request.phase not in _PHASES:
            await errors.abort(context, errors.InvalidArgument(
                f"phase must be PHASE_ROLLOUT or PHASE_TRAIN, got {request.phase}"))
        if request.iteration < 0:
            await errors.abort(context, errors.InvalidArgument(
                f"iteration must be >= 0, got {request.iteration}"))
        if not request.wait_s >= 0:  # also refuses NaN
            await errors.abort(context, errors.InvalidArgument(
                f"wait_s must be >= 0, got {request.wait_s}"))
        return _PHASES[request.phase], min(request.wait_s or self._cfg.max_wait_s,
                                           self._cfg.max_wait_s)

    async def _wait(self, changed: asyncio.Event, deadline: float) -> bool:
        """Wait for the next state change; False once the deadline passed."""
        left = deadline - asyncio.get_running_loop().time()
        if left <= 0:
            return False
        return await wait_event(changed, left)

    async def ReportProgress(self, request: pb.RolloutProgressReport,
                             context) -> pb.RolloutProgressReply:
        by_node: dict[str, int] = {}
        for row in request.unfinished_by_node:
            if row.node_id in by_node:
                await errors.abort(context, errors.InvalidArgument(
                    f"node {row.node_id!r} is reported twice"))
            by_node[row.node_id] = row.unfinished
        plan = await self._mutate(context, lambda c: c.progress(
            request.job_id, request.iteration, request.total_responses,
            request.finished_responses, by_node, request.requests_per_node))
        if plan is None:
            return pb.RolloutProgressReply(migrate=False)
        log.info("job %s rollout #%d is tail-bound: keeps %s, frees %s for the next rollout",
                 request.job_id, request.iteration, plan.keep_node_ids, plan.freed_node_ids)
        return pb.RolloutProgressReply(migrate=True, migration=pb.TailMigration(
            keep_node_ids=plan.keep_node_ids, freed_node_ids=plan.freed_node_ids,
            moves=[pb.TailRequestMove(from_node_id=a, to_node_id=b, requests=n)
                   for a, b, n in plan.moves]))

    async def ListState(self, request: pb.ListPlacementStateRequest,
                        context) -> pb.PlacementState:
        control = await self._leader(context)
        scheduler = control.scheduler
        state = pb.PlacementState(cost_per_hour=scheduler.cost_per_hour(),
                                  tail_migrations=control.stats.tail_migrations,
                                  consolidation_moves=control.stats.consolidation_moves,
                                  bubble_node_seconds_reclaimed=control.stats.bubble_node_seconds,
                                  slo_attainment=control.stats.slo_attainment,
                                  leader=self.endpoint)
        node_group: dict[str, str] = {}
        for group in scheduler.groups.values():
            node_group.update({n: group.group_id for n in (*group.rollout_nodes,
                                                           *group.train_nodes)})
            state.groups.append(pb.CoExecGroup(
                group_id=group.group_id, job_ids=list(group.jobs),
                rollout_node_ids=list(group.rollout_nodes), train_node_ids=list(group.train_nodes),
                t_cycle_s=group.t_cycle, t_load_s=group.t_load, saturated=group.saturated,
                cost_per_hour=group.cost_per_hour))
        for job_id, record in control.jobs.items():
            queues = control.queues[record.group_id]
            phase, iteration, status = queues.next_phase(job_id)
            held = [n for n, h in queues.holders().items() if h == job_id]
            rollout, train = control.placement(job_id)
            measured = record.slo_met + record.slo_missed
            state.jobs.append(pb.PlacedJob(
                job_id=job_id, group_id=record.group_id, rollout_node_ids=rollout,
                train_node_ids=train, next_phase=_TO_PB[phase], iteration=iteration,
                status=status, held_node_ids=held, iterations_done=record.iterations_done,
                slo_attainment=record.slo_met / measured if measured else 1.0))
        for pool in Pool:
            for node_id in control.units(pool):  # a rollout node's slots, when it has several
                group_id = node_group.get(control.node_of(node_id), "")
                queue = pb.NodePhaseQueue(node_id=node_id, pool=pool.value, group_id=group_id)
                if group_id:
                    queues = control.queues[group_id]
                    queue.job_ids.extend(queues.to_dict()["cycle"].get(node_id, []))
                    queue.turn = queues.turn(node_id) or ""
                    queue.holder = queues.holders().get(node_id) or ""
                state.queues.append(queue)
        for pool, (nodes, allocated, busy) in control.pool_usage().items():
            spec = scheduler.rollout_pool if pool is Pool.ROLLOUT else scheduler.train_pool
            state.pools.append(pb.PoolUtilisation(pool=pool.value, gpu=spec.gpu, nodes=nodes,
                                                  allocated=allocated, busy=busy))
        return state

    # ---- observability -------------------------------------------------------------------------

    def _update_gauges(self) -> None:
        control = self.control
        if control is None:
            return
        metrics.GROUPS.set(len(control.scheduler.groups))
        metrics.JOBS.set(len(control.jobs))
        metrics.COST.set(control.scheduler.cost_per_hour())
        for pool, (nodes, allocated, busy) in control.pool_usage().items():
            metrics.POOL_NODES.labels(pool.value, "free").set(nodes - allocated)
            metrics.POOL_NODES.labels(pool.value, "allocated").set(allocated)
            metrics.POOL_NODES.labels(pool.value, "busy").set(busy)
            metrics.POOL_UTILISATION.labels(pool.value).set(busy / allocated if allocated else 0)
        metrics.TAIL_MIGRATIONS.set(control.stats.tail_migrations)
        metrics.CONSOLIDATION_MOVES.set(control.stats.consolidation_moves)
        metrics.BUBBLES_RECLAIMED.set(control.stats.bubble_node_seconds)
        metrics.SLO_ATTAINMENT.set(control.stats.slo_attainment)

    def health(self) -> dict:
        control = self.control
        return {"status": "ok" if not self.deposed.is_set() else "deposed",
                "role": "leader" if control is not None else "standby",
                "groups": len(control.scheduler.groups) if control else 0,
                "jobs": len(control.jobs) if control else 0}


def _may_retry_write(exc: Exception) -> bool:
    """A failed etcd write is worth another try unless this scheduler was deposed or a client
    lease expired meanwhile (etcd answers NOT_FOUND for it: the same write fails again), or etcd
    was away for as long as the write may wait (``with_etcd`` waited for it already)."""
    return not isinstance(exc, DeposedError) and not registry.lease_not_found(exc) \
        and not etcd_away(exc)
