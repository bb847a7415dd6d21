"""Worker loss, draining and starvation (RLBoost §4.2 and §5: preempted requests are re-routed
through SELECTINSTANCE and continue from their last token).

* A worker is **lost** when its stream broke or its etcd lease vanished (events the service reports)
  or when it has requests but produced no token for ``stall_timeout_s`` (detected here, on the
  injected clock), or when a drain deadline passed. Its requests go back to the manager with every
  token kept and are re-dispatched like new ones (§4.2.1: SELECTINSTANCE re-routes on preemption).
* A **draining** worker (SIGTERM, spot notice) takes nothing new; its requests move to eligible
  workers as fast as SELECTINSTANCE finds room for them (Θ respected). Until then they keep
  decoding where they are: the worker is alive until its deadline, so holding them there loses
  nothing and keeps them progressing.
* A request that waits while **no** worker holds its weight version fails once that has lasted
  ``no_worker_timeout_s``; the reason tells the operator what to check. Waiting because every
  eligible worker is at Θ is normal delayed dispatch, never a failure.
* A request a worker **refuses** goes elsewhere when the refusal is about that worker (wrong
  version, full, draining, a duplicate add) and fails when it is about the request itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import grpc

from rlharvest.services.rollout_manager.balancer import (
    InstanceLoad,
    SelectFn,
    queue_on,
    select_instance,
)
from rlharvest.services.rollout_manager.commands import Fail, MigrationCause, Migrate, Release
from rlharvest.services.rollout_manager.worker_pool import WorkerState, WorkerView

# Worker refusal codes (the worker's CommandError) after which the request may simply go to
# another worker: this one holds another version, is draining, is full, or already had it.
RETRYABLE_REFUSALS = frozenset(code.value[0] for code in (
    grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.RESOURCE_EXHAUSTED))

# Refusals after which the worker gets no new request for ControlConfig.refusal_hold_s: it had
# no memory for the request (a co-executor's KV budget), or it still holds the request (a
# migration's abort there has not run yet: sent straight back, the request bounced off it every
# tick until its engine step ended).
HOLD_AFTER = frozenset(code.value[0] for code in (
    grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ALREADY_EXISTS))

# The worker's answer to an abort of a request it does not hold: the request had already left
# it (finished, or aborted before). It refuses no add, so it says nothing about the request the
# manager tracks under that id now (a client that retries a step reuses its request ids, and an
# abort of the abandoned attempt can be answered after the retry's add went to the same worker).
NOTHING_TO_ABORT = grpc.StatusCode.NOT_FOUND.value[0]

@dataclass(frozen=True)
class FailureConfig:
    stall_timeout_s: float = 60.0
    no_worker_timeout_s: float = 600.0
    # A lost worker that holds nothing is forgotten this long after its loss. Spot workers come
    # back under new ids (hostname-pid), so without it the lost ones pile up in the manager and
    # its status. Minutes, not seconds: GetStatus and rlh_manager_workers{state="lost"} show a
    # loss, and its reason, to whoever polls them every few seconds or looks after an incident.
    forget_lost_after_s: float = 300.0

    def __post_init__(self) -> None:
        if self.stall_timeout_s <= 0 or self.no_worker_timeout_s < 0 or \
                self.forget_lost_after_s < 0:
            raise ValueError(f"stall_timeout_s={self.stall_timeout_s} must be > 0, and "
                             f"no_worker_timeout_s={self.no_worker_timeout_s} and "
                             f"forget_lost_after_s={self.forget_lost_after_s} >= 0")


@dataclass(frozen=True)
class WorkerLoss:
    worker_id: str
    reason: str


class FailurePolicy:
    def __init__(self, config: FailureConfig, clock: Callable[[], float]) -> None:
        self._config = config
        self._clock = clock
        self._starved_since: dict[int, float] = {}  # weight version -> first seen without workers

    def detect_losses(self, workers: Iterable[WorkerView],
                      busy: Callable[[str], bool]) -> list[WorkerLoss]:
        """Workers to declare lost now: stalled while busy, or past their drain deadline."""
        now = self._clock()
        losses = []
        for w in workers:
            if w.state is WorkerState.LOST:
                continue
            if w.drain_deadline is not None and now >= w.drain_deadline:
                losses.append(WorkerLoss(w.worker_id, "drain deadline passed"))
            elif busy(w.worker_id) and now - w.last_progress_at >= self._config.stall_timeout_s:
                losses.append(WorkerLoss(
                    w.worker_id, f"no token for {now - w.last_progress_at:.1f}s while it had "
                    f"requests (stall_timeout_s={self._config.stall_timeout_s})"))
        return losses

    def to_forget(self, workers: Iterable[WorkerView],
                  busy: Callable[[str], bool]) -> list[str]:
        """Lost workers to forget now: lost for ``forget_lost_after_s`` and holding nothing."""
        now = self._clock()
        return [w.worker_id for w in workers
                if w.state is WorkerState.LOST and w.lost_at is not None
                and now - w.lost_at >= self._config.forget_lost_after_s
                and not busy(w.worker_id)]

    @staticmethod
    def release_all(worker_id: str, request_ids: Iterable[str],
                    cause: MigrationCause) -> list[Release]:
        return [Release(r, worker_id, cause) for r in request_ids]

    @staticmethod
    def refused(request_id: str, worker_id: str, code: int, message: str) -> Release | Fail | None:
        """A worker refused a command about the request (a gRPC status ``code``): wait for
        another worker, fail when any worker would refuse it too (e.g. longer than the context),
        or nothing when it only answers an abort of a request it no longer held."""
        if code == NOTHING_TO_ABORT:
            return None
        if code in RETRYABLE_REFUSALS:
            return Release(request_id, worker_id, "refused", abort=False)
        return Fail(request_id, f"worker {worker_id} refused the request: {message}")

    @staticmethod
    def evacuate(src: str, request_ids: Sequence[str], instances: Sequence[InstanceLoad],
                 theta: int, cause: MigrationCause, keep_without_room: bool,
                 select: SelectFn = select_instance) -> list[Migrate | Release]:
        """Move requests off ``src`` onto the eligible ``instances`` through SELECTINSTANCE.

        Requests for which no instance has room stay on ``src`` when ``keep_without_room`` (a
        draining worker still decodes correctly) and are released to wait otherwise (a worker
        that changed weight version must not produce one more token for them).
        """
        by_id = {i.worker_id: i for i in instances if i.worker_id != src}
        out: list[Migrate | Release] = []
        for request_id in request_ids:
            target = select(list(by_id.values()), theta)
            if target is None:
                if not keep_without_room:
                    out.append(Release(request_id, src, cause))
                continue
            by_id[target] = queue_on(by_id[target], request_id)
            out.append(Migrate(request_id, src, target, cause))
        return out

    def starved(self, waiting_by_version: Mapping[int, Sequence[str]],
                has_eligible: Callable[[int], bool],
                limit_of: Callable[[str], tuple[float, float | None]] | None = None) -> list[Fail]:
        """Fail waiting requests whose version has had no eligible worker for too long.

        ``limit_of(request_id)`` gives (when the request arrived, its own no-worker deadline or
        None for the configured one): a request's wait starts at the later of its arrival and
        the moment its version lost its last worker."""
        now = self._clock()
        fails: list[Fail] = []
        for version in list(self._starved_since):
            if not waiting_by_version.get(version) or has_eligible(version):
                del self._starved_since[version]
        for version, request_ids in waiting_by_version.items():
            if not request_ids or has_eligible(version):
                continue
            since = self._starved_since.setdefault(version, now)
            for request_id in request_ids:
                arrived, own = limit_of(request_id) if limit_of else (since, None)
                timeout = self._config.no_worker_timeout_s if own is None else own
                waited = now - max(since, arrived)
                if waited >= timeout:
                    fails.append(Fail(request_id, (
                        f"no healthy worker held weight version {version} for {waited:.0f}s "
                        f"(no-worker deadline {timeout:g}s); start rollout workers or check "
                        "that the transfer agents serve this version")))
        return fails
