"""RLBoost's load balancer: Algorithm 2, SELECTINSTANCE and CONTINUOUSLB (§4.2.1).

Pure functions over a snapshot of the eligible instances (same weight version as the requests,
healthy, not draining; the caller filters). The paper's loops ("while true", "wait any
completion") become calls the service repeats: ``select_instance`` returns None where the paper
waits, and ``continuous_lb`` is one iteration of the monitor loop.

m_pending and m_exec (line 5, lines 16-17) depend on how a worker admits requests:

* ``slots`` (a fixed number of batch slots, FIFO): derived from what the manager already tracks
  instead of being queried. Of the requests assigned to the worker, ``min(assigned, capacity)``
  execute and the rest pend. Counting the manager's own in-flight dispatches this way keeps JSQ
  exact during a dispatch burst, when a queried count would lag behind.
* ``kv_memory`` (as many as its KV cache holds, e.g. vLLM): only the worker knows, so they come
  from its last load report (``kv_memory_load``), still counting in-flight dispatches.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from rlharvest.services.rollout_manager.batching_profile import ThroughputProfile
from rlharvest.services.rollout_manager.commands import Dispatch, Migrate

__all__ = ["InstanceLoad", "SelectFn", "ThroughputProfile", "select_instance",
           "RoundRobinSelect", "dispatch_waiting", "continuous_lb", "rebalance"]


@dataclass(frozen=True)
class InstanceLoad:
    """One eligible instance as Algorithm 2 sees it."""

    worker_id: str
    capacity: int
    # Assigned requests that have produced no token on this worker yet, oldest first. The newest
    # ones are the tail of its FIFO queue: the ones to move when it is overloaded.
    queued: tuple[str, ...] = ()
    # Requests producing tokens, in the order to move them when it runs above the plateau.
    running: tuple[str, ...] = ()
    plateau: int | None = None  # B for this instance's kind at the current context; None: no P
    # Requests on the instance that this manager did not send (another manager's, serving
    # traffic): only a kv_memory worker's load report shows them (kv_memory_load).
    unmanaged: int = 0
    # A serving GPU's co-executor (kind "serving"): its capacity is what its serving SLOs admit
    # now, and ROSE's turn router ranks it after every dedicated worker (§4.3).
    serving: bool = False
    # It refused a request (for memory, or because it still held it) or gave one up for memory
    # within ControlConfig.refusal_hold_s: no room for now, whatever its counts say (a
    # co-executor's KV budget shrinks with serving bursts, which the manager does not see).
    refusing: bool = False
    # A co-executor's KV room for rollout, in tokens (its last load report's capacity less use,
    # less the context of the requests sent to it since); None: not known or not limited.
    room_tokens: int | None = None

    @property
    def holds_ours(self) -> bool:
        """It holds requests of this manager (a kv_memory worker's load may be all others'):
        only such an instance is a migration source, there being nothing else to move."""
        return bool(self.queued or self.running)

    @property
    def assigned(self) -> int:
        """Every request on the instance, running or queued."""
        return len(self.queued) + len(self.running) + self.unmanaged

    @property
    def pending(self) -> int:
        return max(0, self.assigned - self.capacity)

    @property
    def executing(self) -> int:
        return min(self.assigned, self.capacity)

    @property
    def free_slots(self) -> int:
        return 0 if self.pending or self.refusing else max(0, self.capacity - self.executing)


def kv_memory_load(slots: int, reported_pending: int, reported_executing: int,
                   assigned_at_report: int) -> tuple[int, int]:
    """(capacity, unmanaged) of InstanceLoad for a worker that admits by KV memory, from its
    last load report; ``slots`` is the most it ever runs at once, ``assigned_at_report`` how many
    requests the manager had on it when it reported.

    A worker that queues requests is full at what it runs now; one that queues none may take
    more, up to ``slots``. The requests it reported beyond the manager's are someone else's.
    With both, InstanceLoad's pending and executing are the worker's own counts as reported,
    and every request the manager sends or takes away since then moves them as it will on the
    worker, so a dispatch burst does not pile onto a full worker. A worker sent more than its
    memory holds queues the excess, reports it, and CONTINUOUSLB moves it on.
    """
    capacity = reported_executing if reported_pending > 0 else slots
    return capacity, max(0, reported_pending + reported_executing - assigned_at_report)


# (instances, Θ) -> the instance to dispatch to, or None to hold. select_instance is Algorithm 2's;
# the benchmark injects round-robin here to compare against.
SelectFn = Callable[[Sequence["InstanceLoad"], int], "str | None"]


def select_instance(instances: Sequence[InstanceLoad], theta: int) -> str | None:
    """SELECTINSTANCE (lines 1-12): join the shortest queue among instances with fewer than Θ
    pending requests; None means hold the request until a completion (delayed dispatch). An
    instance that just refused a request (``refusing``) has no room either.

    Ties on m_pending (the paper leaves them open) go to the instance with the most free batch
    slots, so that an empty step spreads over workers instead of filling one, then to the id.
    """
    if theta < 1:
        raise ValueError(f"theta={theta}: at least one pending request per instance must be "
                         "allowed, or nothing is ever dispatched")
    candidates = [i for i in instances if i.pending < theta and not i.refusing]
    if not candidates:
        return None
    return min(candidates, key=lambda i: (i.pending, -i.free_slots, i.worker_id)).worker_id


class RoundRobinSelect:
    """Baseline dispatcher: the next eligible instance in turn, never holding a request."""

    def __init__(self) -> None:
        self._turn = 0

    def __call__(self, instances: Sequence[InstanceLoad], theta: int) -> str | None:
        if not instances:
            return None
        ordered = sorted(instances, key=lambda i: i.worker_id)
        self._turn += 1
        return ordered[(self._turn - 1) % len(ordered)].worker_id


def fits(instance: InstanceLoad, need_tokens: int) -> bool:
    """Room for a request of ``need_tokens`` of KV in what the instance reported it has (a
    co-executor's rollout budget, ``room_tokens``); an instance that reports none fits any."""
    return instance.room_tokens is None or need_tokens <= instance.room_tokens


def dispatch_waiting(request_ids: Sequence[str], instances: Sequence[InstanceLoad],
                     theta: int, select: SelectFn = select_instance,
                     need_of: Callable[[str], int] | None = None) -> list[Dispatch]:
    """SELECTINSTANCE for each waiting request in order, until one has to be held. With
    ``need_of`` (a request's KV tokens), an instance whose reported room cannot hold a request
    is no candidate for it: it would only refuse it."""
    by_id = {i.worker_id: i for i in instances}
    # Sizes matter only where some instance reports its room (need 0 fits everywhere).
    if not any(i.room_tokens is not None for i in instances):
        need_of = None
    out: list[Dispatch] = []
    for request_id in request_ids:
        need = need_of(request_id) if need_of is not None else 0
        target = select(list(by_id.values()) if need_of is None else
                        [i for i in by_id.values() if fits(i, need)], theta)
        if target is None:
            break  # every instance has Θ pending: the rest wait for a completion (line 12)
        by_id[target] = queue_on(by_id[target], request_id, need)
        out.append(Dispatch(request_id, target))
    return out


def queue_on(load: InstanceLoad, request_id: str, tokens: int = 0) -> InstanceLoad:
    """``load`` once ``request_id`` (of ``tokens`` of KV) is dispatched to it (the tail of its
    queue)."""
    room = None if load.room_tokens is None else load.room_tokens - tokens
    return replace(load, queued=load.queued + (request_id,), room_tokens=room)


def continuous_lb(instances: Sequence[InstanceLoad]) -> list[Migrate]:
    """One iteration of CONTINUOUSLB (lines 14-27).

    Pending case: move one request from the instance with the most pending to one with none.
    Deviation: the destination must also have a free batch slot. Moving a request into a queue
    gains nothing, and when the source has one pending request it would bounce back and forth.
    In both cases an instance holding none of this manager's requests (only ``unmanaged``
    ones) is no source: there is nothing on it the manager can move.

    Executing case (nothing pending anywhere, some instance idle): move max(m_exec_j - B, 0)
    requests from the busiest instance j, where B is j's batching plateau, capped by the idle
    instance's capacity. Without a profile (first step) B is unknown and nothing moves.
    """
    if len(instances) < 2:
        return []
    overloaded = [i for i in instances if i.pending > 0]
    if overloaded:
        return _migrate_pending(instances, overloaded)
    return _migrate_executing(instances)


def _migrate_pending(instances: Sequence[InstanceLoad],
                     overloaded: Sequence[InstanceLoad]) -> list[Migrate]:
    receivers = [i for i in instances if i.pending == 0 and i.free_slots > 0]
    # With no source left nothing moves, which also ends rebalance's loop instead of picking
    # the same worker again.
    sources = [i for i in overloaded if i.holds_ours]
    if not receivers or not sources:
        return []
    src = max(sources, key=lambda i: (i.pending, i.worker_id))
    dst = max(receivers, key=lambda i: (i.free_slots, i.worker_id))
    # The newest queued request is last in the source's FIFO queue; a source whose capacity we
    # underestimate may have no queued one, and then its newest running request goes.
    request_id = (src.queued or src.running)[-1]
    return [Migrate(request_id, src.worker_id, dst.worker_id, "pending")]


def _migrate_executing(instances: Sequence[InstanceLoad]) -> list[Migrate]:
    idle = [i for i in instances if i.executing == 0]
    if not idle:
        return []
    dst = max(idle, key=lambda i: (i.capacity, i.worker_id))
    sources = [i for i in instances if i.holds_ours]
    if not sources:
        return []
    src = max(sources, key=lambda i: (i.executing, i.worker_id))
    if src.plateau is None or src is dst:
        return []
    count = min(max(src.executing - src.plateau, 0), dst.capacity)
    movable = src.running + src.queued
    return [Migrate(r, src.worker_id, dst.worker_id, "executing") for r in movable[:count]]


def rebalance(instances: Sequence[InstanceLoad], max_moves: int) -> list[Migrate]:
    """Run CONTINUOUSLB until it is satisfied or ``max_moves`` requests moved.

    The pending case moves one request per iteration "until the receiver is saturated" (§4.2.1);
    each iteration sees the snapshot updated with the previous moves.
    """
    by_id = {i.worker_id: i for i in instances}
    moves: list[Migrate] = []
    while len(moves) < max_moves:
        step = continuous_lb(list(by_id.values()))
        if not step:
            break
        for m in step[: max_moves - len(moves)]:
            _apply_move(by_id, m)
            moves.append(m)
    return moves


def _apply_move(by_id: dict[str, InstanceLoad], move: Migrate) -> None:
    src, dst = by_id[move.src], by_id[move.dst]
    by_id[move.src] = replace(src, queued=tuple(r for r in src.queued if r != move.request_id),
                              running=tuple(r for r in src.running if r != move.request_id))
    by_id[move.dst] = queue_on(dst, move.request_id)
