"""The manager's decision loop: tracker + worker pool + Algorithm 2 + failure policy, no I/O.

The async service (and the policy simulator, which drives this very class) feeds it events —
a step, worker joins/losses/drains/version changes, batched step outputs, throughput samples —
and calls ``tick`` whenever something may have changed (a completion, a timer). Every command
it returns has already been applied to the tracker; the caller only carries it out.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from rlharvest.services.rollout_manager.balancer import (
    InstanceLoad,
    SelectFn,
    dispatch_waiting,
    rebalance,
    select_instance,
)
from rlharvest.services.rollout_manager.batching_profile import ThroughputProfile
from rlharvest.services.rollout_manager.commands import (
    Command,
    Dispatch,
    Fail,
    MigrationCause,
    Migrate,
    Release,
)
from rlharvest.services.rollout_manager.failure import FailureConfig, FailurePolicy
from rlharvest.services.rollout_manager.tracker import (
    ApplyReport,
    DeltaLike,
    NewRequest,
    RequestState,
    RequestTracker,
    StepLimits,
)
from rlharvest.services.rollout_manager.worker_pool import WorkerPool, WorkerState


@dataclass(frozen=True)
class ControlConfig:
    theta: int = 2  # Θ: most pending requests per worker before dispatch is delayed
    continuous_lb: bool = True  # False only for the "no migration" baselines
    max_moves_per_tick: int = 64  # bounds one tick's work; the next tick continues
    profile_epsilon: float = 0.1  # B reaches (1 - ε) of the best throughput
    # The recompute baseline of RLBoost §6.4.3 (Fig. 14) only: a request released by a lost
    # worker restarts from its prompt instead of resuming from its last token.
    recompute_on_loss: bool = False
    failure: FailureConfig = field(default_factory=FailureConfig)
    limits: StepLimits = field(default_factory=StepLimits)


class RolloutControl:
    def __init__(self, config: ControlConfig, clock: Callable[[], float],
                 select: SelectFn = select_instance) -> None:
        self.config = config
        self.tracker = RequestTracker(config.limits, clock)
        self.pool = WorkerPool(clock)
        self.failure = FailurePolicy(config.failure, clock)
        self.profiles: dict[str, ThroughputProfile] = {}  # worker kind -> P
        self._select = select
        self._outbox: list[Command] = []  # decided outside tick (protocol errors), sent by tick

    # ---- events -------------------------------------------------------------------------------

    def add_step(self, requests: Sequence[NewRequest]) -> list[str]:
        return self.tracker.add_step(requests)

    def worker_joined(self, worker_id: str, weight_version: int, capacity: int,
                      kind: str) -> None:
        self.pool.join(worker_id, weight_version, capacity, kind)
        self.profiles.setdefault(kind, ThroughputProfile(self.config.profile_epsilon))

    def worker_lost(self, worker_id: str, reason: str) -> list[Command]:
        """Stream broke, lease vanished, or the worker left: its requests wait, tokens kept
        (discarded instead under ``recompute_on_loss``, the baseline)."""
        if not self.pool.mark_lost(worker_id, reason):
            return []
        ids = [r.request_id for r in self.tracker.on_worker(worker_id)]
        released = self._apply(self.failure.release_all(worker_id, ids, "lost"))
        if self.config.recompute_on_loss:
            for request_id in ids:
                self.tracker.restart_from_prompt(request_id)
        return released

    def worker_draining(self, worker_id: str, deadline: float) -> list[Command]:
        self.pool.mark_draining(worker_id, deadline)
        return self._evacuate(worker_id, "drain", keep_without_room=True)

    def worker_version_changed(self, worker_id: str, weight_version: int) -> list[Command]:
        """A worker now holds another version: none of its requests may decode there any more."""
        self.pool.set_version(worker_id, weight_version)
        stale = [r for r in self.tracker.on_worker(worker_id) if r.weight_version != weight_version]
        out: list[Command] = []
        for version in sorted({r.weight_version for r in stale}):
            ids = [r.request_id for r in stale if r.weight_version == version]
            out += self._apply(self.failure.evacuate(
                worker_id, ids, self._loads(version), self.config.theta, "version",
                keep_without_room=False, select=self._select))
        return out

    def step_outputs(self, worker_id: str, deltas: Sequence[DeltaLike]) -> ApplyReport:
        report = self.tracker.apply_outputs(worker_id, deltas)
        if report.accepted:
            self.pool.note_progress(worker_id)
        for dropped in report.dropped:
            if dropped.reason in ("position", "version"):
                # The assignee and the manager disagree about this request: take it off that
                # worker (tokens kept) rather than risk a gap or an off-policy token.
                self.tracker.release(dropped.request_id)
                self._outbox.append(Release(dropped.request_id, worker_id, "protocol"))
        return report

    def record_throughput(self, worker_id: str, batch_size: int, tokens_per_s: float) -> None:
        """A decode throughput sample for P, at the mean context of the worker's requests."""
        requests = self.tracker.on_worker(worker_id)
        if not requests or worker_id not in self.pool:
            return
        context = sum(r.context_length for r in requests) / len(requests)
        self.profiles[self.pool.get(worker_id).kind].record(batch_size, tokens_per_s, context)

    def finish_step(self) -> None:
        """Freeze this step's throughput samples as P for the next step (§4.2.1)."""
        for profile in self.profiles.values():
            profile.finish_step()

    # ---- the loop -----------------------------------------------------------------------------

    def tick(self) -> list[Command]:
        out, self._outbox = self._outbox, []
        for loss in self.failure.detect_losses(self.pool.all(), self._busy):
            out += self.worker_lost(loss.worker_id, loss.reason)
        for w in list(self.pool.all()):
            if w.state is WorkerState.DRAINING and self._busy(w.worker_id):
                out += self._evacuate(w.worker_id, "drain", keep_without_room=True)
        waiting = self._waiting_by_version()
        for version, ids in waiting.items():
            out += self._apply(dispatch_waiting(ids, self._loads(version), self.config.theta,
                                                self._select))
        if self.config.continuous_lb:
            for version in self._busy_versions():
                out += self._apply(rebalance(self._loads(version), self.config.max_moves_per_tick))
        starved = self.failure.starved(self._waiting_by_version(),
                                       lambda v: bool(self.pool.eligible(v)), self._wait_limit)
        return out + self._apply(starved)

    def _wait_limit(self, request_id: str) -> tuple[float, float | None]:
        req = self.tracker.get(request_id)
        return req.created_at, req.no_worker_timeout_s

    def _evacuate(self, worker_id: str, cause: MigrationCause,
                  keep_without_room: bool) -> list[Command]:
        out: list[Command] = []
        on_worker = self.tracker.on_worker(worker_id)
        for version in sorted({r.weight_version for r in on_worker}):
            ids = [r.request_id for r in on_worker if r.weight_version == version]
            out += self._apply(self.failure.evacuate(
                worker_id, ids, self._loads(version), self.config.theta, cause,
                keep_without_room, select=self._select))
        return out

    def _apply(self, commands: Sequence[Command]) -> list[Command]:
        for c in commands:
            if isinstance(c, Dispatch):
                self._note_busy(c.worker_id)
                self.tracker.assign(c.request_id, c.worker_id)
            elif isinstance(c, Migrate):
                self._note_busy(c.dst)
                self.tracker.move(c.request_id, c.dst)
            elif isinstance(c, Release):
                self.tracker.release(c.request_id)
            elif isinstance(c, Fail):
                self.tracker.fail(c.request_id, c.reason)
        return list(commands)

    def _note_busy(self, worker_id: str) -> None:
        # The stall clock of a worker that was idle starts when it gets work, not when it last
        # produced a token (which may be long ago).
        if not self._busy(worker_id):
            self.pool.note_progress(worker_id)

    def _busy(self, worker_id: str) -> bool:
        return self.tracker.assigned_count(worker_id) > 0

    def _waiting_by_version(self) -> dict[int, list[str]]:
        by_version: dict[int, list[str]] = {}
        for r in self.tracker.waiting():
            by_version.setdefault(r.weight_version, []).append(r.request_id)
        return by_version

    def _busy_versions(self) -> set[int]:
        return {w.weight_version for w in self.pool.all()
                if w.state is WorkerState.HEALTHY and self._busy(w.worker_id)}

    def _loads(self, weight_version: int) -> list[InstanceLoad]:
        """Algorithm 2's view of the workers eligible for ``weight_version``."""
        loads = []
        for w in self.pool.eligible(weight_version):
            requests = self.tracker.on_worker(w.worker_id)
            queued = tuple(r.request_id for r in requests if r.state is RequestState.PENDING)
            # Executing requests leave longest-so-far first: with heavy-tailed lengths those are
            # the likeliest to run longest, and they gain most from the idle worker's small batch.
            running = sorted((r for r in requests if r.state is RequestState.EXECUTING),
                             key=lambda r: -len(r.token_ids))
            plateau = None
            if requests:
                context = sum(r.context_length for r in requests) / len(requests)
                plateau = self.profiles[w.kind].plateau(context)
            loads.append(InstanceLoad(w.worker_id, w.capacity, queued,
                                      tuple(r.request_id for r in running), plateau))
        return loads
