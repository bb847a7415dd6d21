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

import heapq
from collections import deque
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace

from rlharvest.services.rollout_manager.batching_profile import ThroughputProfile
from rlharvest.services.rollout_manager.commands import Dispatch, Migrate

__all__ = ["InstanceLoad", "LazyIds", "MoveCosts", "SelectFn", "ThroughputProfile",
           "select_instance", "RoundRobinSelect", "dispatch_waiting", "continuous_lb",
           "rebalance", "move_gain", "source_pace"]


class LazyIds(Sequence[str]):
    """Request ids whose number is known at once and whose order is read out on first use.

    Algorithm 2 reads every instance's counts each tick but the ids and their order only of
    the one or few instances it moves requests from: at 1,024 workers x 32 requests, reading out
    (and, under the paper's rule, sorting) every worker's ids was most of a tick
    (bench/manager_scale_sim.py). ``fill(key)`` must return ``count`` ids; it is called at most
    once, so a load built from live state is to be read before that state changes (the control
    loop builds loads, decides, then applies the decisions).
    """

    __slots__ = ("_count", "_fill", "_key", "_ids")

    def __init__(self, count: int, fill: Callable[[str], tuple[str, ...]], key: str) -> None:
        self._count = count
        self._fill = fill
        self._key = key
        self._ids: tuple[str, ...] | None = None

    def _all(self) -> tuple[str, ...]:
        if self._ids is None:
            self._ids = self._fill(self._key)
            if len(self._ids) != self._count:
                raise AssertionError(f"{self._key!r}: {len(self._ids)} ids read out where "
                                     f"{self._count} were counted; the counts are stale")
        return self._ids

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, index):
        return self._all()[index]  # an int or a slice, as a tuple takes them

    def __iter__(self) -> Iterator[str]:
        return iter(self._all())

    def __contains__(self, value: object) -> bool:
        return value in self._all()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and tuple(self._all()) == tuple(other)

    def __hash__(self) -> int:
        return hash(self._all())

    def __repr__(self) -> str:
        return repr(self._all())


@dataclass(frozen=True)
class InstanceLoad:
    """One eligible instance as Algorithm 2 sees it."""

    worker_id: str
    capacity: int
    # Assigned requests that have produced no token on this worker yet, oldest first. The newest
    # ones are the tail of its FIFO queue: the ones to move when it is overloaded. (Any
    # sequence; the control loop's are LazyIds.)
    queued: Sequence[str] = ()
    # Requests producing tokens, in the order to move them when it runs above the plateau.
    running: Sequence[str] = ()
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
    # The cost-aware migration rule's view (MoveCosts; migration_cost.py): its decode pace in
    # tokens/s per request, measured at a batch of ``pace_batch`` requests, and its prefill rate
    # in tokens/s; None: not measured yet.
    pace: float | None = None
    pace_batch: float = 1.0
    prefill_rate: float | None = None
    # The manager hands its requests over at a set moment: a seed worker at its seeding window's
    # close, a lent co-executor when serving takes it back. The cost-aware rule neither takes
    # requests from it nor gives it any before then: that hand-over is what it is there for.
    handed_over: bool = False

    # The counts below are read for every instance, several times a tick (each of rebalance's
    # iterations scans them all): computed once as the load is made (``replace`` makes a new
    # one), from the two lengths, instead of on first read through a descriptor each (five
    # Python calls per load, a fifth of a tick at 1,024 workers).
    # holds_ours: it holds requests of this manager (a kv_memory worker's load may be all
    # others'): only such an instance is a migration source, there being nothing else to move.
    holds_ours: bool = field(init=False, repr=False, compare=False)
    assigned: int = field(init=False, repr=False, compare=False)  # running, queued, unmanaged
    pending: int = field(init=False, repr=False, compare=False)
    executing: int = field(init=False, repr=False, compare=False)
    free_slots: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        queued, running, capacity = len(self.queued), len(self.running), self.capacity
        assigned = queued + running + self.unmanaged
        pending = assigned - capacity if assigned > capacity else 0
        executing = capacity if assigned > capacity else assigned
        free = 0 if pending or self.refusing or capacity <= executing else capacity - executing
        set_ = object.__setattr__  # frozen: the dataclass's own way past it
        set_(self, "holds_ours", bool(queued or running))
        set_(self, "assigned", assigned)
        set_(self, "pending", pending)
        set_(self, "executing", executing)
        set_(self, "free_slots", free)


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
    # Sizes matter only where some instance reports its room (need 0 fits everywhere).
    if not any(i.room_tokens is not None for i in instances):
        need_of = None
    if select is select_instance and need_of is None:
        return _dispatch_jsq(request_ids, instances, theta)
    by_id = {i.worker_id: i for i in instances}
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


def _jsq_key(assigned: int, capacity: int, worker_id: str) -> tuple[int, int, str]:
    """select_instance's order, (pending, -free slots, id), of an instance that is not
    refusing with ``assigned`` requests on it."""
    return max(0, assigned - capacity), -max(0, capacity - assigned), worker_id


def _dispatch_jsq(request_ids: Sequence[str], instances: Sequence[InstanceLoad],
                  theta: int) -> list[Dispatch]:
    """``dispatch_waiting`` with ``select_instance`` and no sizes, in O((requests + instances)
    log instances) instead of a scan of every instance per request: a step's first tick at
    1,024 workers dispatches ~32k requests (bench/manager_scale_sim.py). A dispatch changes
    only its target's key, so a heap of the candidates picks what select_instance picks."""
    if theta < 1:
        select_instance(instances, theta)  # its ValueError
    heap = [(_jsq_key(i.assigned, i.capacity, i.worker_id), i.assigned, i.capacity)
            for i in instances if i.pending < theta and not i.refusing]
    heapq.heapify(heap)
    out: list[Dispatch] = []
    for request_id in request_ids:
        if not heap:
            break  # every instance has Θ pending: the rest wait for a completion (line 12)
        (_, _, worker_id), assigned, capacity = heapq.heappop(heap)
        out.append(Dispatch(request_id, worker_id))
        assigned += 1
        if assigned - capacity < theta:
            heapq.heappush(heap, (_jsq_key(assigned, capacity, worker_id), assigned, capacity))
    return out


def queue_on(load: InstanceLoad, request_id: str, tokens: int = 0) -> InstanceLoad:
    """``load`` once ``request_id`` (of ``tokens`` of KV) is dispatched to it (the tail of its
    queue)."""
    room = None if load.room_tokens is None else load.room_tokens - tokens
    return replace(load, queued=(*load.queued, request_id), room_tokens=room)


@dataclass(frozen=True)
class MoveCosts:
    """What the cost-aware rule weighs a move of a request by (None in ``rebalance``:
    the paper's rule). Requests are named by id; the control loop answers from its tracker.

    * ``remaining``: the request's expected remaining tokens (migration_cost.LengthModel).
    * ``context``: its context length, prompt and tokens so far: what the destination prefills
      to resume it (in the pending case a queued request pays that prefill wherever it runs,
      so there only a running one's move costs it).
    * ``left``: the workers it was moved away from within its step: it never goes back to
      one of them (the paper's rule moves the excess over B to any idle worker, so at a step's
      tail requests bounce between workers as each runs dry).
    * ``relocated``: whether this case (the executing one) moved it within its step: it does
      not move again (a worker's evacuation or the pending case does not count).
    * ``prefill_tokens_per_s``: the destination's prefill rate until it has measured its own.
    * ``min_gain``: a move must save this share of the request's remaining time at the source
      beyond its prefill. The paces are moving averages of noisy engine steps: on equal workers
      they differ by noise alone, and a move on noise is a prefill for nothing.
    """

    remaining: Callable[[str], float]
    context: Callable[[str], int]
    left: Callable[[str], Collection[str]]
    prefill_tokens_per_s: float = 10_000.0
    min_gain: float = 0.1
    relocated: Callable[[str], bool] = lambda request_id: False
    # (remaining, context) of each of the ids at once, as the two above answer them: the
    # rule's one loop over requests asks it of every running request on each slow worker.
    figures: Callable[[Sequence[str]], Iterable[tuple[float, int]]] | None = None

    def both(self, request_ids: Sequence[str]) -> Iterable[tuple[float, int]]:
        if self.figures is not None:
            return self.figures(request_ids)
        return ((self.remaining(r), self.context(r)) for r in request_ids)


def predicted_pace(load: InstanceLoad, batch: int) -> float | None:
    """The instance's per-request pace once it decodes ``batch`` requests. Not credited for a
    batch smaller than the one it was measured at (a memory-bound GPU decodes one request
    about as fast as a few), debited in proportion for a larger one (as if compute-bound):
    pessimistic both ways for a destination, so a move is never made on a speed-up it may not
    have. (At ``batch`` 1 it is the measured pace.)
    The paper's P would give the curve per kind, but it is frozen a step late and is the
    same for every worker of a kind, which is what a slow worker is not."""
    if load.pace is None or load.pace <= 0:
        return None
    return load.pace * min(1.0, load.pace_batch / max(batch, 1))


def source_pace(load: InstanceLoad, batch: int) -> float | None:
    """A source's per-request pace while it decodes ``batch`` requests (the ones it keeps):
    flat up to its plateau B (the paper's P: up to B, a batch decodes each request about as
    fast as a smaller one), then inversely to the batch (past B its throughput stays). Without
    P, flat up to the batch it was measured at. So a source that sheds requests is credited
    for the pace its kept batch gains, which ``predicted_pace`` never credits a destination
    with: pessimistic for a move at both ends. Without that credit a worker holding a whole
    step (the first to hold a new weight version takes every request) gave an idle one all but
    a few, which then was the busiest for the next idle worker: each request moved twice."""
    if load.pace is None or load.pace <= 0:
        return None
    knee = load.plateau if load.plateau is not None else load.pace_batch
    return load.pace * max(load.pace_batch, knee) / max(batch, knee, 1)


def move_gain(costs: MoveCosts, request_id: str, src: InstanceLoad, dst: InstanceLoad,
              dst_batch: int, src_batch: int | None = None) -> float | None:
    """Seconds a move of ``request_id`` from ``src`` to ``dst`` is predicted to save beyond
    its cost: its expected remaining tokens at the source's pace (decoding ``src_batch``
    requests, itself included; default: all it runs now) less the same at the destination's
    (decoding ``dst_batch``), less its context's prefill there, less ``min_gain`` of its time
    at the source. None: a pace is unknown, nothing can be predicted. A queued request pays
    the prefill too: the source may have begun it, or hold a turn's history in its prefix
    cache (turn_routing.py), where the destination prefills the whole context."""
    src_pace = source_pace(src, src.executing if src_batch is None else src_batch)
    dst_pace = predicted_pace(dst, dst_batch)
    if src_pace is None or dst_pace is None:
        return None
    remaining = costs.remaining(request_id)
    at_src = remaining / src_pace
    prefill = costs.context(request_id) / (dst.prefill_rate or costs.prefill_tokens_per_s)
    return at_src - remaining / dst_pace - prefill - costs.min_gain * at_src


def continuous_lb(instances: Sequence[InstanceLoad], costs: MoveCosts | None = None,
                  limit: int | None = None) -> list[Migrate]:
    """One iteration of CONTINUOUSLB (lines 14-27).

    Pending case: move one request from the instance with the most pending to one with none.
    Deviation: the destination must also have a free batch slot. Moving a request into a queue
    gains nothing, and when the source has one pending request it would bounce back and forth.
    In both cases an instance holding none of this manager's requests (only ``unmanaged``
    ones) is no source: there is nothing on it the manager can move.

    Executing case (nothing pending anywhere, some instance idle): move max(m_exec_j - B, 0)
    requests from the busiest instance j, where B is j's batching plateau, capped by the idle
    instance's capacity. Without a profile (first step) B is unknown and nothing moves.

    With ``costs`` (the cost-aware rule) the executing case is ``_migrate_paying`` instead, and
    the pending case moves a running request (a source with none queued) only where it did not
    come from within its step. ``limit``: the most moves wanted (the first ones are the same
    whatever it is); None for all.
    """
    if len(instances) < 2:
        return []
    overloaded = [i for i in instances if i.pending > 0]
    if overloaded:
        return _migrate_pending(instances, overloaded, costs)
    if costs is None:
        return _migrate_executing(instances)
    return _migrate_paying(instances, costs, limit)


def _migrate_pending(instances: Sequence[InstanceLoad], overloaded: Sequence[InstanceLoad],
                     costs: MoveCosts | None = None) -> list[Migrate]:
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
    if costs is not None and not src.queued and dst.worker_id in costs.left(request_id):
        return []  # back where it came from: the bounce the cost-aware rule rules out
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
    movable = (*src.running, *src.queued)
    return [Migrate(r, src.worker_id, dst.worker_id, "executing") for r in movable[:count]]


def _migrate_paying(instances: Sequence[InstanceLoad], costs: MoveCosts,
                    limit: int | None = None) -> list[Migrate]:
    """The executing case under the cost-aware rule: when nothing is pending and instances are
    idle, move to each, fastest first, the requests whose move pays (``move_gain`` > 0), best
    first, while each still pays with the destination's batch grown by the ones before and
    its source's shrunk by the ones it gave.

    Deviation from the paper: any instance's requests may go, not only the excess over B of
    the busiest. The plateau argument (a batch above B decodes no faster in total) says
    nothing about where a request finishes first, which is what the step's makespan is made
    of: a slow or throttled worker's requests gain from a faster idle one however small its
    batch, and on equal workers no move pays, whatever the batch. A request moves once a step
    by this case (``MoveCosts.relocated``): its destination was predicted the better place, and a
    second move is a second prefill on a prediction that moved on noise. Instances whose
    requests are handed over at a set moment (``handed_over``) take no part. One call serves
    every idle instance (the paper's loop serves one per iteration) so that a tick at
    thousands of workers ranks the candidates once. Destinations are served in turn, so it
    stops at ``limit`` moves (rebalance's bound) without changing those: at a step's tail it
    would otherwise plan hundreds of moves for the 64 a tick makes.
    """
    idle = [i for i in instances if i.executing == 0 and i.free_slots > 0 and
            not i.handed_over and predicted_pace(i, 1) is not None]
    if not idle:
        return []
    idle.sort(key=lambda i: (predicted_pace(i, 1) or 0.0, i.capacity, i.worker_id), reverse=True)
    candidates = _paying_candidates(instances, idle[0], costs)
    queue = deque(candidates)
    shed: dict[str, int] = {}  # requests each source gave in this call
    moves: list[Migrate] = []
    for dst in idle:
        if limit is not None and len(moves) >= limit:
            break
        free, batch, looked = dst.free_slots, 0, 0
        passed: list[tuple[float, str, InstanceLoad]] = []  # back to the queue's head after
        # A bounded look per destination: the queue is ranked for the fastest one, and a
        # request low in it rarely pays where a better one did not.
        while queue and batch < free and looked < 4 * free:
            candidate = queue.popleft()
            looked += 1
            _, request_id, src = candidate
            kept = src.executing - shed.get(src.worker_id, 0)
            saved = (None if dst.worker_id in costs.left(request_id) else
                     move_gain(costs, request_id, src, dst, batch + 1, kept))
            if saved is None or saved <= 0:
                passed.append(candidate)  # not with the batches moved so far
                continue
            batch += 1
            shed[src.worker_id] = shed.get(src.worker_id, 0) + 1
            moves.append(Migrate(request_id, src.worker_id, dst.worker_id, "executing"))
        queue.extendleft(reversed(passed))
        if not batch:
            break  # the next ones are slower: what did not pay here pays nowhere else
    return moves


def _paying_candidates(instances: Sequence[InstanceLoad], fastest: InstanceLoad,
                       costs: MoveCosts) -> list[tuple[float, str, InstanceLoad]]:
    """(gain at ``fastest`` at batch 1, request, source) of every request whose move there
    pays, best first: the queued and running requests of the instances that may give any (not
    handed over), not moved by this case within their step."""
    # A move pays only if the source is slower than the destination by more than min_gain
    # (saved / time at source <= 1 - source pace / destination pace): filter sources first, so
    # a tick looks at the requests of the few slow workers, not at every request in flight.
    ceiling = (predicted_pace(fastest, 1) or 0.0) * (1.0 - costs.min_gain)
    # move_gain against the fastest at batch 1, unrolled: the one loop over requests in a tick.
    per_token = 1.0 / (predicted_pace(fastest, 1) or 1.0)
    prefill_rate = fastest.prefill_rate or costs.prefill_tokens_per_s
    candidates: list[tuple[float, str, InstanceLoad]] = []
    for src in instances:
        if not src.holds_ours or src.handed_over:
            continue
        pace = source_pace(src, src.executing)  # its pace now; shedding only raises it
        if pace is None or pace >= ceiling:
            continue
        factor = (1.0 - costs.min_gain) / pace - per_token
        ids = [r for r in (*src.queued, *src.running)
               if not costs.relocated(r)]  # a request moves once within its step
        for request_id, (remaining, context) in zip(ids, costs.both(ids)):
            gain = remaining * factor - context / prefill_rate
            if gain > 0:
                candidates.append((gain, request_id, src))
    candidates.sort(key=lambda c: (-c[0], c[1]))
    return candidates


def rebalance(instances: Sequence[InstanceLoad], max_moves: int,
              costs: MoveCosts | None = None) -> list[Migrate]:
    """Run CONTINUOUSLB until it is satisfied or ``max_moves`` requests moved (``costs``: the
    cost-aware rule, None: the paper's).

    The pending case moves one request per iteration "until the receiver is saturated" (§4.2.1);
    each iteration sees the snapshot updated with the previous moves.
    """
    by_id = {i.worker_id: i for i in instances}
    moves: list[Migrate] = []
    if costs is not None:  # a request this round moved counts as relocated already
        moved: set[str] = set()
        relocated = costs.relocated
        costs = replace(costs, relocated=lambda r: r in moved or relocated(r))
    while len(moves) < max_moves:
        step = continuous_lb(list(by_id.values()), costs, max_moves - len(moves))
        if not step:
            break
        for m in step[: max_moves - len(moves)]:
            _apply_move(by_id, m)
            moves.append(m)
            if costs is not None and m.cause == "executing":
                moved.add(m.request_id)
    return moves


def _apply_move(by_id: dict[str, InstanceLoad], move: Migrate) -> None:
    src, dst = by_id[move.src], by_id[move.dst]
    by_id[move.src] = replace(src, queued=tuple(r for r in src.queued if r != move.request_id),
                              running=tuple(r for r in src.running if r != move.request_id))
    by_id[move.dst] = queue_on(dst, move.request_id)
