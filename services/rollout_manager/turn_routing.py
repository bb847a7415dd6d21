"""Turn-wise routing of agentic trajectories with KV-cache affinity (ROSE §4.3, App. A).

A multi-turn trajectory comes back every turn with its whole history. The worker that served its
last turn still holds that history's KV pages in its prefix cache. Another worker would prefill
all of it again. So each turn is routed on its own (``turnwise+affinity``, the default): to the
last turn's worker while fewer than Θ turns wait there beyond its concurrency cap, otherwise to
the least loaded worker under its cap (Algorithm 2's ``select_instance`` among those), otherwise it waits in the
manager for a slot, as the paper says. Queueing it behind a full worker that lacks its history
would cost it a full prefill as well as the wait. The benchmark's baselines:

- ``pinned``: a trajectory stays on the worker of its first turn, however loaded (the agent
  frameworks' sticky sessions); its first turn waits in the manager for a worker under Θ, so
  the binding itself is load-aware;
- ``pinned-static``: the paper's baseline (Table 3: "we pin each trajectory to a fixed rollout
  worker for its entire lifetime"): the first turn binds at once to the worker with the fewest
  turns assigned, whatever its cap (it queues there), as a client that sends every first turn
  at launch does (veRL's least-requests sticky sessions);
- ``turnwise``: every turn is placed like any request, ignoring where the history is.

The cap is the batching profile's plateau B (App. A: past B a worker's throughput stops rising),
or the worker's capacity before a profile exists. An affinity entry is dropped after the
trajectory's last turn, or after ``ttl_s`` without a turn (a trajectory the client abandoned).

Deviation: ROSE also ranks dedicated workers before co-executors when the affinity worker is
full. Here a co-executor is one more eligible instance, and its admission refuses what its SLOs
cannot take (RESOURCE_EXHAUSTED); the manager then places the turn elsewhere.

Pure: no I/O, an injected clock.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum

from rlharvest.services.rollout_manager.balancer import InstanceLoad, SelectFn, queue_on
from rlharvest.services.rollout_manager.commands import Dispatch


class TurnRouting(str, Enum):
    PINNED = "pinned"
    PINNED_STATIC = "pinned-static"
    TURNWISE = "turnwise"
    AFFINITY = "turnwise+affinity"


@dataclass
class RoutingCounts:
    """Turns routed since start, by outcome (the manager's metrics)."""

    affinity: int = 0  # to the worker holding the history
    moved: int = 0  # its worker was full or gone: placed like any request
    first: int = 0  # a trajectory's first routed turn (or turnwise: every turn)


class TurnRouter:
    def __init__(self, mode: TurnRouting = TurnRouting.AFFINITY, ttl_s: float = 120.0,
                 clock: Callable[[], float] | None = None) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self.mode = mode
        self._pinned = mode in (TurnRouting.PINNED, TurnRouting.PINNED_STATIC)
        self.ttl_s = ttl_s
        self._clock = clock or (lambda: 0.0)
        self._home: dict[str, tuple[str, float]] = {}  # trajectory -> (worker, last seen)
        self.counts = RoutingCounts()

    def __len__(self) -> int:
        return len(self._home)

    def home(self, trajectory_id: str) -> str | None:
        """The worker holding the trajectory's history, if the entry is alive."""
        entry = self._home.get(trajectory_id)
        if entry is None:
            return None
        if self._clock() - entry[1] > self.ttl_s:
            del self._home[trajectory_id]
            return None
        return entry[0]

    def select(self, trajectory_id: str, instances: Sequence[InstanceLoad], theta: int,
               fallback: SelectFn) -> str | None:
        """Where to send the trajectory's next turn (None: hold it)."""
        home = self.home(trajectory_id) if self.mode is not TurnRouting.TURNWISE else None
        by_id = {i.worker_id: i for i in instances}
        if home is not None and home in by_id:
            if self._pinned or _home_has_room(by_id[home], theta):
                self.counts.affinity += 1
                return home
        if self.mode is TurnRouting.PINNED_STATIC and instances:
            if home is None:
                self.counts.first += 1
            else:  # its worker is gone
                self.counts.moved += 1
            return min(instances, key=lambda i: (i.assigned, i.worker_id)).worker_id
        if self.mode is TurnRouting.AFFINITY:
            # Only a worker under its cap takes it; with none, it waits for a slot (at home
            # then, most likely) instead of queueing behind a full worker without its history.
            instances = [i for i in instances if _under_cap(i, theta)]
            if not instances:
                return None
        target = fallback(instances, theta)
        if target is not None:
            if home is None:
                self.counts.first += 1
            else:
                self.counts.moved += 1
        return target

    def order(self, request_ids: Sequence[str], trajectory_of: Callable[[str], str],
              instances: Sequence[InstanceLoad], theta: int) -> list[str]:
        """The waiting requests in dispatch order: first the turns whose home worker has room
        (in their order), then the rest. A slot freed at a worker goes to a turn whose history
        is there before one that would prefill all of it (affinity mode; others keep FIFO)."""
        if self.mode is not TurnRouting.AFFINITY:
            return list(request_ids)
        room = {i.worker_id for i in instances if _home_has_room(i, theta)}
        first: list[str] = []
        rest: list[str] = []
        for request_id in request_ids:
            trajectory_id = trajectory_of(request_id)
            home = self.home(trajectory_id) if trajectory_id else None
            (first if home in room else rest).append(request_id)
        return first + rest

    def dispatch(self, request_ids: Sequence[str], trajectory_of: Callable[[str], str],
                 instances: Sequence[InstanceLoad], theta: int,
                 fallback: SelectFn) -> list[Dispatch]:
        """Places the waiting turns (``order``, then ``select`` each). Unlike Algorithm 2's
        FIFO hold, a turn held here does not hold the turns behind it: their homes differ."""
        by_id = {i.worker_id: i for i in instances}
        out: list[Dispatch] = []
        for request_id in self.order(request_ids, trajectory_of, instances, theta):
            trajectory_id = trajectory_of(request_id)
            target = self.select(trajectory_id, list(by_id.values()), theta, fallback)
            if target is not None:
                by_id[target] = queue_on(by_id[target], request_id)
                self.dispatched(trajectory_id, target)
                out.append(Dispatch(request_id, target))
        return out

    def dispatched(self, trajectory_id: str, worker_id: str) -> None:
        """A turn was sent to ``worker_id``. Pinned: the first dispatch fixes the worker (and a
        lost worker's successor becomes the new one)."""
        if self._pinned:
            self._home[trajectory_id] = (worker_id, self._clock())

    def finished(self, trajectory_id: str, worker_id: str | None, last_turn: bool) -> None:
        """A turn finished on ``worker_id``: its history's KV is there now. The last turn ends
        the trajectory's entry."""
        if last_turn:
            self._home.pop(trajectory_id, None)
        elif self.mode is TurnRouting.AFFINITY and worker_id is not None:
            self._home[trajectory_id] = (worker_id, self._clock())
        elif self._pinned and trajectory_id in self._home:
            self._home[trajectory_id] = (self._home[trajectory_id][0], self._clock())

    def expire(self) -> int:
        """Drops the entries older than ``ttl_s``; returns how many."""
        now = self._clock()
        old = [t for t, (_, seen) in self._home.items() if now - seen > self.ttl_s]
        for trajectory_id in old:
            del self._home[trajectory_id]
        return len(old)


def _cap(instance: InstanceLoad) -> int:
    """The plateau B (App. A), or the capacity before a profile exists."""
    return max(1, instance.plateau if instance.plateau is not None else instance.capacity)


def _home_has_room(instance: InstanceLoad, theta: int) -> bool:
    """The history's worker takes the turn while fewer than Θ wait beyond its cap: waiting
    there for a slot costs less than prefilling the whole history elsewhere, and a turn queued
    on the worker starts at its next engine step, not at the manager's next tick."""
    return instance.assigned < _cap(instance) + theta


def _under_cap(instance: InstanceLoad, theta: int) -> bool:
    """Room for one more turn: below its cap and the pending bound Θ."""
    return instance.assigned < _cap(instance) and instance.pending < theta
