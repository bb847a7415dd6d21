"""Turn-wise routing of agentic trajectories with KV-cache affinity (ROSE §4.3, App. A).

A multi-turn trajectory comes back every turn with its whole history. The worker that served its
last turn still holds that history's KV pages in its prefix cache. Another worker would prefill
all of it again. So each turn is routed on its own (``turnwise+affinity``, the default): to the
last turn's worker while fewer than Θ turns wait there beyond its concurrency cap, otherwise to
the least loaded worker under its cap (Algorithm 2's ``select_instance`` among those), otherwise it
waits in the manager for a slot, as the paper says. Queueing it behind a full worker that lacks
its history would cost it a full prefill as well as the wait. A turn with no history anywhere (a
first turn) has no prefill to lose, so Algorithm 2 places it like any request, queueing up to Θ
(where the paper is silent; held, first turns starved behind the started trajectories' turns).
The benchmark's baselines:

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

Co-executors (serving GPUs, ``InstanceLoad.serving``) come after every dedicated worker, as
ROSE ranks them: a turn goes home to one only while its admission holds (under its cap, which
is what its serving SLOs admit now), and is otherwise placed on the least loaded dedicated
worker under its cap, then the least loaded co-executor under its cap. A co-executor's own
admission still refuses what its SLOs cannot take (RESOURCE_EXHAUSTED); the manager then places
the turn elsewhere.

Pure: no I/O, an injected clock.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum

from rlharvest.services.rollout_manager.balancer import InstanceLoad, SelectFn, fits, queue_on
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
               fallback: SelectFn, need_tokens: int = 0) -> str | None:
        """Where to send the trajectory's next turn (None: hold it). ``need_tokens``: its KV
        (history and the next token), which a co-executor's reported room must hold."""
        home = self.home(trajectory_id) if self.mode is not TurnRouting.TURNWISE else None
        at_home = next((i for i in instances if i.worker_id == home), None) \
            if home is not None else None
        # A co-executor whose reported KV room cannot hold the turn would refuse it: it is no
        # candidate, and a turn at home there waits as it would for a full home.
        roomy = [i for i in instances if fits(i, need_tokens)]
        home_fits = at_home is not None and fits(at_home, need_tokens)
        if at_home is not None and self._pinned and (at_home.refusing or not home_fits):
            return None  # pinned: it waits for its worker, which refuses new requests now
        if at_home is not None and home_fits and (
                self._pinned or _home_first(at_home, roomy, theta)):
            self.counts.affinity += 1
            return home
        instances = roomy
        if self.mode is TurnRouting.PINNED_STATIC:
            open_ = [i for i in instances if not i.refusing]
            if not open_:
                return None
            if home is None:
                self.counts.first += 1
            else:  # its worker is gone
                self.counts.moved += 1
            return min(open_, key=lambda i: (i.assigned, i.worker_id)).worker_id
        # Only a worker under its cap takes a turn with a history in affinity mode; with none,
        # it waits for a slot (at home then, most likely) instead of queueing behind a full
        # worker without its history. A turn with no history anywhere (a first turn, or its
        # worker is gone) loses no prefill by queueing: Algorithm 2 places it like any request.
        # (Held in the manager, first turns waited while the started trajectories' later turns
        # took every freed slot; the last trajectories started late, and the step's makespan
        # is theirs: 0.84x of pinned on bench/agentic_routing.py with dedicated workers only.)
        target = _tiered(instances, theta, fallback,
                         hold=self.mode is TurnRouting.AFFINITY and at_home is not None)
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
                 instances: Sequence[InstanceLoad], theta: int, fallback: SelectFn,
                 need_of: Callable[[str], int] = lambda _: 0) -> list[Dispatch]:
        """Places the waiting turns (``order``, then ``select`` each). Unlike Algorithm 2's
        FIFO hold, a turn held here does not hold the turns behind it: their homes differ. A
        turn without a home that is held holds the other homeless ones at least its size,
        though: their choice depends only on the loads and the room, which placing turns only
        raises and lowers (thousands of first turns wait at a step's start; each would scan
        every worker again). ``need_of``: a turn's KV
        tokens (``select``'s ``need_tokens``)."""
        by_id = {i.worker_id: i for i in instances}
        out: list[Dispatch] = []
        held_need: int | None = None  # the smallest KV need of a homeless turn held so far
        for request_id in self.order(request_ids, trajectory_of, instances, theta):
            trajectory_id = trajectory_of(request_id)
            homeless = self.mode is TurnRouting.TURNWISE or self.home(trajectory_id) is None
            need = need_of(request_id)
            if homeless and held_need is not None and need >= held_need:
                continue  # fits wherever a smaller one fits, and that one found no place
            target = self.select(trajectory_id, list(by_id.values()), theta, fallback, need)
            if homeless and target is None:
                held_need = need if held_need is None else min(held_need, need)
            if target is not None:
                by_id[target] = queue_on(by_id[target], request_id, need)
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


def _home_first(home: InstanceLoad, instances: Sequence[InstanceLoad], theta: int) -> bool:
    """Affinity's first choice. A dedicated home while it has room (up to Θ beyond its cap). A
    co-executor home only while its admission holds and no dedicated worker is under its cap:
    §4.3 moves a trajectory's turns "back to rollout GPUs once capacity becomes available". A
    co-executor's rollout steps share its GPU with serving and a burst aborts them, so with a
    dedicated slot free, one full prefill there costs less than decoding the turn at the
    co-executor's pace (rlharvest/sim/agentic.py with serving GPUs: 1.30–1.40x of pinned this way, 1.09–1.23x
    going home to the co-executor first)."""
    if not home.serving:
        return _home_has_room(home, theta)
    return _under_cap(home, theta) and not any(
        not i.serving and _under_cap(i, theta) for i in instances)


def _tiered(instances: Sequence[InstanceLoad], theta: int, fallback: SelectFn,
            hold: bool) -> str | None:
    """ROSE §4.3's fallback: the least loaded dedicated worker under its cap, else the least
    loaded co-executor whose admission holds (under its cap: what its serving SLOs admit now).
    With neither, ``hold`` waits in the manager; otherwise Algorithm 2 may queue the turn on a
    dedicated worker (turnwise, pinned's first turn: a turn is placed like any request)."""
    for serving in (False, True):
        room = [i for i in instances if i.serving is serving and _under_cap(i, theta)]
        if room:
            return fallback(room, theta)
    if hold:
        return None
    return fallback([i for i in instances if not i.serving] or list(instances), theta)


def _home_has_room(instance: InstanceLoad, theta: int) -> bool:
    """The history's worker takes the turn while fewer than Θ wait beyond its cap: waiting
    there for a slot costs less than prefilling the whole history elsewhere, and a turn queued
    on the worker starts at its next engine step, not at the manager's next tick. A co-executor
    takes it only while its admission holds (ROSE §4.3: "would not violate serving SLOs")."""
    if instance.serving or instance.refusing:
        return _under_cap(instance, theta)
    return instance.assigned < _cap(instance) + theta


def _under_cap(instance: InstanceLoad, theta: int) -> bool:
    """Room for one more turn: below its cap and the pending bound Θ, and no refusal just
    now."""
    return instance.assigned < _cap(instance) and instance.pending < theta and not instance.refusing
