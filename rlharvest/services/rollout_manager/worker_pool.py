"""The manager's view of its rollout workers (RLBoost §5, "Rollout manager").

Only what the policies need: which version a worker holds, how many requests it can execute at
once and how it admits them, what it last reported executing and queueing (and its KV capacity),
whether it is healthy, draining, lent to training or lost, and when it last made progress. Which requests sit on a worker is the tracker's
business, not duplicated here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import Literal, get_args

# How a worker admits requests into its running batch: "slots", a fixed number at a time (its
# capacity; the torch engine); "kv_memory", as many as its KV cache holds (vLLM, a paged cache),
# at most its capacity. Workers publish it in their etcd membership info.
Admission = Literal["slots", "kv_memory"]
ADMISSIONS: tuple[str, ...] = get_args(Admission)


class WorkerState(str, Enum):
    HEALTHY = "healthy"
    DRAINING = "draining"  # SIGTERM or spot notice: takes no new work, its requests move away
    LOST = "lost"  # stream broke, lease vanished, stalled, or drain deadline passed
    # Lent to training by RollPacker's stream-trainer scaling (--stream-scaling) until the step
    # that lent it ends: takes no new work and holds none (its requests moved away with their
    # tokens); alive and connected, no deadline. Back to healthy when that step ends.
    TRAINING = "training"


@dataclass
class WorkerView:
    worker_id: str
    weight_version: int
    capacity: int  # requests it executes concurrently (its batch slots; kv_memory: at most)
    kind: str  # hardware/provisioning class; each kind keeps its own throughput profile
    joined_at: float
    last_progress_at: float  # last accepted token, or when it last went from idle to busy
    admission: Admission = "slots"
    # Its own counts in its last load report, queued (not running yet) and running, and how many
    # requests the manager had on it then. Algorithm 2 reads them for kv_memory workers.
    reported_pending: int = 0
    reported_executing: int = 0
    assigned_at_report: int = 0
    kv_capacity_tokens: int = 0  # Load.kv_capacity_tokens of its last report; 0: none yet
    kv_used_tokens: int = 0  # Load.kv_used_tokens of the same report
    # KV tokens of the requests sent to it since that report (a co-executor takes their pages
    # at the add, so the next report counts them in its use).
    kv_sent_tokens: int = 0
    # When it last refused a request for memory or because it still held it, or (a
    # co-executor) gave one up for memory: ControlConfig.refusal_hold_s counts from here.
    refused_at: float | None = None
    state: WorkerState = WorkerState.HEALTHY
    drain_deadline: float | None = None
    lost_reason: str = ""
    lost_at: float | None = None  # when it was marked lost: the manager forgets it a while after
    # Requests it still runs from a session that broke (a dead manager's, or this manager's
    # before a link break), which a waiting request of the same id goes back to: adopted there
    # with every token it produced meanwhile (session_hub.py on the worker).
    kept: set[str] = field(default_factory=set)
    # Those of them dispatched back to it whose first rows have not come yet: the adoption's
    # first rows carry what it made while no manager held them, so they stay until then.
    adopted: set[str] = field(default_factory=set)
    start_weights: str = ""  # the fingerprint of its version-0 weights (rlharvest/common/start_weights.py)

    @property
    def rollout_room_tokens(self) -> int | None:
        """A co-executor's KV room for rollout: what its budget left at its last load report,
        less the requests sent to it since; None for any other worker, or before a report."""
        if self.kind != SERVING_KIND or self.kv_capacity_tokens <= 0:
            return None
        return self.kv_capacity_tokens - self.kv_used_tokens - self.kv_sent_tokens

    def refusing(self, now: float, hold_s: float) -> bool:
        """It refused within the last ``hold_s``: no room for a new request, whatever its
        counts say."""
        return self.refused_at is not None and now - self.refused_at < hold_s

    def holds(self, weight_version: int, job_start: str) -> bool:
        """Holds the job's ``weight_version`` (the pool holds only the job's workers): the exact
        version, and at version 0 the job's start weights (``job_start``, their fingerprint; ""
        when the job declared none)."""
        return self.weight_version == weight_version and (
            weight_version != 0 or not job_start or self.start_weights == job_start)

    def eligible_for(self, weight_version: int, job_start: str = "") -> bool:
        """May take requests of ``weight_version`` (on-policy: only the exact version)."""
        return self.state is WorkerState.HEALTHY and self.holds(weight_version, job_start)


# Kinds the instance cap counts: the preemptible remote instances RLBoost's N_prem bounds. Dedicated
# workers are paid for whether used or not, and the seed role is the trainer itself.
CAPPED_KINDS = frozenset({"spot"})
# A serving GPU's co-executor lent to the job (ROSE §4.1): the turn router ranks it last.
SERVING_KIND = "serving"
# The trainer's own engine during a step's seeding window (seed_window.py).
SEED_KIND = "seed"
# Kinds whose requests the manager hands over at a set moment (a seed worker's at its window's
# close, a co-executor's when serving takes it back): the cost-aware migration rule leaves them
# alone until then (balancer.InstanceLoad.handed_over).
HANDED_OVER_KINDS = frozenset({SERVING_KIND, SEED_KIND})


class WorkerPool:
    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._workers: dict[str, WorkerView] = {}
        # N_prem (RLBoost Algorithm 1, §4.1): at most this many healthy spot workers take work,
        # the first to have joined; the rest stand by and replace a lost one at once.
        self.instance_cap: int | None = None
        # The job's start weights by fingerprint (its trainer's record; "" for none declared):
        # a worker at version 0 with other start weights holds another policy.
        self.start_weights = ""

    def join(self, worker_id: str, weight_version: int, capacity: int, kind: str,
             admission: str = "slots", start_weights: str = "") -> WorkerView:
        """Register a worker; a lost worker coming back under the same id starts a fresh record."""
        if capacity <= 0:
            raise ValueError(f"worker {worker_id!r} reports capacity {capacity}; a worker must "
                             "execute at least one request at a time")
        if admission not in ADMISSIONS:
            raise ValueError(f"worker {worker_id!r} reports admission {admission!r}; the manager "
                             f"knows {' and '.join(ADMISSIONS)}")
        current = self._workers.get(worker_id)
        if current is not None and current.state is not WorkerState.LOST:
            raise ValueError(f"worker {worker_id!r} is already registered ({current.state.value});"
                             " a worker id must be unique while it is alive")
        now = self._clock()
        view = WorkerView(worker_id, weight_version, capacity, kind, now, now,
                          admission="kv_memory" if admission == "kv_memory" else "slots",
                          start_weights=start_weights)
        self._workers[worker_id] = view
        return view

    def get(self, worker_id: str) -> WorkerView:
        try:
            return self._workers[worker_id]
        except KeyError:
            raise KeyError(f"worker {worker_id!r} is not registered with this manager") from None

    def __contains__(self, worker_id: str) -> bool:
        return worker_id in self._workers

    def all(self) -> Iterable[WorkerView]:
        return self._workers.values()

    def eligible(self, weight_version: int) -> list[WorkerView]:
        standby = self.standby() if self.instance_cap is not None else set()
        return [w for w in self._workers.values()
                if w.eligible_for(weight_version, self.start_weights)
                and w.worker_id not in standby]

    def held_versions(self) -> set[int]:
        """The versions of the job some worker holds."""
        return {w.weight_version for w in self._workers.values()
                if w.holds(w.weight_version, self.start_weights)}

    def standby(self) -> set[str]:
        """Healthy capped workers beyond the instance cap, latest joined first to stand by.
        Recomputed on each call, so a lost active worker's place goes to the next at once."""
        if self.instance_cap is None:
            return set()
        # A worker lent to training keeps its place under the cap: it comes back to rollout
        # when its step ends, and lending it must not wake a standby worker meanwhile.
        capped = sorted((w for w in self._workers.values() if w.kind in CAPPED_KINDS
                         and w.state in (WorkerState.HEALTHY, WorkerState.TRAINING)),
                        key=lambda w: w.joined_at)
        return {w.worker_id for w in capped[self.instance_cap:]
                if w.state is WorkerState.HEALTHY}

    def set_instance_cap(self, cap: int | None) -> None:
        """None lifts the cap. Requests already on a worker that now stands by stay there; it
        only takes no new ones."""
        if cap is not None and cap < 0:
            raise ValueError(f"instance cap must be >= 0 (or None for no cap), got {cap}")
        self.instance_cap = cap

    def set_version(self, worker_id: str, weight_version: int,
                    start_weights: str | None = None) -> None:
        view = self.get(worker_id)
        view.weight_version = weight_version
        if start_weights is not None:
            view.start_weights = start_weights

    def report_load(self, worker_id: str, pending: int, executing: int, assigned: int,
                    kv_capacity_tokens: int | None = None,
                    kv_used_tokens: int | None = None) -> None:
        """The worker's own counts as of its latest load report, and the manager's then."""
        view = self._workers.get(worker_id)
        if view is not None:
            view.reported_pending, view.reported_executing = pending, executing
            view.assigned_at_report = assigned
            if kv_capacity_tokens is not None:
                view.kv_capacity_tokens = max(kv_capacity_tokens, 0)
            if kv_used_tokens is not None:
                view.kv_used_tokens = max(kv_used_tokens, 0)
                view.kv_sent_tokens = 0

    def note_progress(self, worker_id: str) -> None:
        self.get(worker_id).last_progress_at = self._clock()

    def note_sent(self, worker_id: str, kv_tokens: int) -> None:
        """A request of ``kv_tokens`` went to the worker: its room until the next load report."""
        self.get(worker_id).kv_sent_tokens += kv_tokens

    def note_refusal(self, worker_id: str) -> None:
        self.get(worker_id).refused_at = self._clock()

    def mark_draining(self, worker_id: str, deadline: float) -> None:
        """A drain notice (SIGTERM, spot notice) wins over a loan to training."""
        w = self.get(worker_id)
        if w.state in (WorkerState.HEALTHY, WorkerState.TRAINING):
            w.state = WorkerState.DRAINING
            w.drain_deadline = deadline

    def lend_to_training(self, worker_id: str) -> bool:
        """Healthy -> training; False (unchanged) for a worker in any other state."""
        w = self.get(worker_id)
        if w.state is not WorkerState.HEALTHY:
            return False
        w.state = WorkerState.TRAINING
        return True

    def return_from_training(self, worker_id: str) -> bool:
        """Training -> healthy; False (unchanged) for an unknown worker or one that is not lent
        any more (it was lost, drained, or came back as a new process meanwhile)."""
        w = self._workers.get(worker_id)
        if w is None or w.state is not WorkerState.TRAINING:
            return False
        w.state = WorkerState.HEALTHY
        return True

    def lent_to_training(self) -> list[str]:
        return [w.worker_id for w in self._workers.values() if w.state is WorkerState.TRAINING]

    def mark_lost(self, worker_id: str, reason: str) -> bool:
        """Returns False when the worker was already lost (events can repeat: stream + lease)."""
        w = self.get(worker_id)
        if w.state is WorkerState.LOST:
            return False
        w.state = WorkerState.LOST
        w.lost_reason = reason
        w.lost_at = self._clock()
        w.kept.clear()
        w.adopted.clear()
        return True

    def forget(self, worker_id: str) -> None:
        """Drop a lost worker's record once nothing refers to it; the same id joining later is
        a new worker."""
        if self.get(worker_id).state is not WorkerState.LOST:
            raise ValueError(f"worker {worker_id!r} is not lost; mark it lost before forgetting it")
        del self._workers[worker_id]
