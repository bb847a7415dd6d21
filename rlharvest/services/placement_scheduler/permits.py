"""Run permits for job phases inside one co-execution group (WEAVE §4.3 and §5.1).

A job's phase shim blocks until it holds a run permit. Each node runs the phases of the jobs
pinned to it in the group's round-robin order (admission order): the rollout nodes execute
Roll_A -> Roll_B -> ..., the training pool Train_A -> Train_B -> ..., and every job runs each
phase exactly once per meta-iteration (§4.3). Per node this is the FIFO queue of §5.1 with the
meta-iteration order fixed: a node waits for the job whose turn it is, and when that phase
completes the turn passes to the next job and the job's next phase waits on the other pool.
Long-tail migration (§4.3) shrinks a running rollout to a few nodes and hands the freed ones to
the next job in the order before the tail ends.

Guarantees (tested): a node is held by at most one permit; a job has exactly one next phase, so
no phase runs twice or out of order. Time is an explicit ``now`` argument; the state round-trips
through a plain dict so the service can persist it in etcd.
"""


from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlharvest.services.placement_scheduler.model import PlacementError, Pool

WAITING, RUNNING = "waiting", "running"


@dataclass(frozen=True)
class Permit:
    """Job ``job_id`` may run ``phase`` of ``iteration`` on ``node_ids`` now. ``pending_node_ids``
    are handed over as a migrated tail releases them (only after a long-tail migration)."""

    job_id: str
    phase: Pool
    iteration: int
    node_ids: tuple[str, ...]
    pending_node_ids: tuple[str, ...]
    granted_at: float


@dataclass
class _NextPhase:
    phase: Pool
    iteration: int
    status: str = WAITING
    held: list[str] = field(default_factory=list)
    pending: list[str] = field(default_factory=list)
    granted_at: float = 0.0
    tail: bool = False  # a running rollout shrunk by long-tail migration


class PhaseQueues:
    """The permit state machine of one group; members take turns in the order they were added."""

    def __init__(self) -> None:
        self._nodes: dict[str, dict[Pool, tuple[str, ...]]] = {}  # admission (= round-robin) order
        self._next: dict[str, _NextPhase] = {}
        self._cycle: dict[str, list[str]] = {}  # per node: its jobs in round-robin order
        self._turn: dict[str, int] = {}  # per node: index in _cycle of the job whose turn it is
        self._holder: dict[str, str | None] = {}

    # --- membership ----------------------------------------------------------------------------
    def add_job(self, job_id: str, rollout_node_ids: Sequence[str],
                train_node_ids: Sequence[str], iteration: int = 0,
                phase: Pool = Pool.ROLLOUT) -> None:
        """Admit a job at the end of the round-robin order; its next phase is ``phase`` (the
        rollout for a new job) of ``iteration`` (0 for a new job, the checkpointed iteration
        for a resubmitted one, where it stood for one moved from another group)."""
        if job_id in self._nodes:
            raise PlacementError(f"job {job_id!r} already has a phase queue; remove it first")
        if not rollout_node_ids or not train_node_ids or \
                set(rollout_node_ids) & set(train_node_ids):
            raise PlacementError(f"job {job_id!r} needs at least one rollout and one train node, "
                                 f"disjoint; got {rollout_node_ids} and {train_node_ids}")
        self._nodes[job_id] = {Pool.ROLLOUT: tuple(rollout_node_ids),
                               Pool.TRAIN: tuple(train_node_ids)}
        for node_id in (*rollout_node_ids, *train_node_ids):
            self._cycle.setdefault(node_id, []).append(job_id)
            self._turn.setdefault(node_id, 0)
            self._holder.setdefault(node_id, None)
        self._next[job_id] = _NextPhase(phase, iteration)
        if phase is Pool.ROLLOUT:
            self._start_on_idle_nodes(job_id, rollout_node_ids)

    def _start_on_idle_nodes(self, job_id: str, node_ids: Sequence[str]) -> None:
        """A new job's first phase (its rollout) goes first on its nodes when all of them idle,
        waiting for jobs that are busy on the other pool: on each, the job moves from the end of
        the order to just before the job whose turn it is, and takes the turn. Otherwise it
        waits at the end of the order. The paper adds a job at the end of the round robin
        without saying where its first turn falls; this sets the pipeline's phase offset right:
        a job joining while its partner trains rolls out alongside that training, instead of
        queueing behind the partner's next rollout, which would make the two run one phase
        after the other for ever. Moving it in front of the turn (not jumping the turn to the
        end) skips nobody, so the other jobs' turns keep their order on every node; all or
        none, so no two jobs each hold the turn of a node the other needs."""
        def idle(node_id: str) -> bool:
            turn = self.turn(node_id)
            return self._holder[node_id] is None and turn is not None and turn != job_id \
                and self._next[turn].phase is not Pool.ROLLOUT
        if not node_ids or not all(idle(n) for n in node_ids):
            return
        for node_id in node_ids:
            cycle = self._cycle[node_id]
            cycle.remove(job_id)
            cycle.insert(self._turn[node_id], job_id)  # the turn index now names the new job

    def remove_job(self, job_id: str) -> list[Permit]:
        """Drop a job (failure or leave): its turns pass to the next members and its nodes are
        freed, so the rest of the group keeps going. Returns permits that grew as a result."""
        nxt = self._next.pop(self._known(job_id))
        for node_id in (*self._nodes[job_id][Pool.ROLLOUT], *self._nodes[job_id][Pool.TRAIN]):
            cycle, turn = self._cycle[node_id], self._turn[node_id]
            index = cycle.index(job_id)
            cycle.pop(index)
            self._turn[node_id] = (turn - (index < turn)) % max(len(cycle), 1)
        held = list(nxt.held)
        del self._nodes[job_id]
        return self._free(held)

    # --- permits -------------------------------------------------------------------------------
    def runnable(self) -> list[tuple[str, Pool]]:
        """Waiting phases that ``acquire`` would grant now, in round-robin order."""
        return [(j, n.phase) for j, n in self._next.items()
                if n.status == WAITING and self._grantable(j) is not None]

    def acquire(self, job_id: str, phase: Pool, now: float) -> Permit | None:
        """Grant ``phase`` to ``job_id`` if it is its turn on all the phase's nodes and they are
        free; None means "not your turn yet, wait". Raises if ``phase`` is not the job's next phase
        (out of order, or already running: a phase never runs twice)."""
        nxt = self._next[self._known(job_id)]
        if nxt.phase != Pool(phase) or nxt.status != WAITING:
            raise PlacementError(f"job {job_id!r} asked for a {Pool(phase).value} permit but its "
                                 f"next phase is {nxt.phase.value} #{nxt.iteration} ({nxt.status});"
                                 " finish and release the current phase first")
        grant = self._grantable(job_id)
        if grant is None:
            return None
        free, pending = grant
        for node_id in free:
            self._holder[node_id] = job_id
        nxt.status, nxt.held, nxt.pending, nxt.granted_at = RUNNING, free, pending, now
        return self._permit(job_id)

    def release(self, job_id: str, phase: Pool, now: float) -> list[Permit]:
        """Complete the job's running ``phase``: free its nodes, pass their turn on, and make the
        job's next phase (on the other pool) wait for its turn. Returns permits that grew because
        they were waiting on these nodes."""
        nxt = self._next[self._known(job_id)]
        if nxt.phase != Pool(phase) or nxt.status != RUNNING or nxt.pending:
            raise PlacementError(f"job {job_id!r} released {Pool(phase).value} but its running "
                                 f"phase is {nxt.phase.value} #{nxt.iteration} ({nxt.status}, "
                                 f"pending nodes {nxt.pending}); release only a fully held phase")
        if nxt.phase is Pool.ROLLOUT:
            self._next[job_id] = _NextPhase(Pool.TRAIN, nxt.iteration)
        else:
            self._next[job_id] = _NextPhase(Pool.ROLLOUT, nxt.iteration + 1)
        return self._pass_turn(nxt.held)

    def shrink(self, job_id: str, keep_node_ids: Sequence[str]) -> list[Permit]:
        """Long-tail migration: the job's running rollout keeps only ``keep_node_ids``; its turn
        on the other nodes passes on so the next job's rollout can start there. Returns permits
        that grew because they were waiting on the freed nodes (as ``release`` does: a second
        shrink can hand a partly started rollout its last node)."""
        nxt = self._next[self._known(job_id)]
        keep = [n for n in nxt.held if n in set(keep_node_ids)]
        if nxt.phase is not Pool.ROLLOUT or nxt.status != RUNNING or not keep or nxt.pending \
                or len(keep) != len(set(keep_node_ids)):
            raise PlacementError(f"job {job_id!r}: can only shrink a fully running rollout onto a "
                                 f"non-empty subset of its nodes {nxt.held}; got {keep_node_ids}")
        freed = [n for n in nxt.held if n not in keep]
        nxt.held, nxt.tail = keep, True
        return self._pass_turn(freed)

    def drop_train_nodes(self, node_ids: Sequence[str]) -> None:
        """The group's training pool shrank: every member trains on the remaining nodes. Only
        while no training phase holds a dropped node (the scheduler shrinks between phases)."""
        held = [n for n in node_ids if self._holder.get(n) is not None]
        if held:
            raise PlacementError(f"training nodes {held} are held by a running phase; shrink the "
                                 "pool once it is released")
        gone = set(node_ids)
        for job_id, nodes in self._nodes.items():
            kept = tuple(n for n in nodes[Pool.TRAIN] if n not in gone)
            if not kept:
                raise PlacementError(f"job {job_id!r} would keep no training node")
            nodes[Pool.TRAIN] = kept
        for node_id in gone:
            self._cycle.pop(node_id, None)
            self._turn.pop(node_id, None)
            self._holder.pop(node_id, None)

    # --- views ---------------------------------------------------------------------------------
    def holders(self) -> dict[str, str | None]:
        return dict(self._holder)

    def running(self) -> list[Permit]:
        return [self._permit(j) for j, n in self._next.items() if n.status == RUNNING]

    def next_phase(self, job_id: str) -> tuple[Pool, int, str]:
        nxt = self._next[self._known(job_id)]
        return nxt.phase, nxt.iteration, nxt.status

    def nodes(self) -> dict[str, dict[str, Any]]:
        """Per node of the group: its pool, whose turn it is and who holds it now."""
        pools = {n: pool.value for nodes in self._nodes.values()
                 for pool, ids in nodes.items() for n in ids}
        return {n: {"pool": pool, "turn": self.turn(n), "holder": self._holder.get(n)}
                for n, pool in sorted(pools.items())}

    def turn(self, node_id: str) -> str | None:
        """The job whose phase the node runs next (or runs now)."""
        cycle = self._cycle.get(node_id)
        return cycle[self._turn[node_id]] if cycle else None

    # --- persistence ---------------------------------------------------------------------------
    def job_ids(self) -> list[str]:
        """The members, in round-robin (admission) order."""
        return list(self._nodes)

    def to_dict(self) -> dict[str, Any]:
        return {
            "jobs": {j: {"rollout_node_ids": list(n[Pool.ROLLOUT]),
                         "train_node_ids": list(n[Pool.TRAIN])} for j, n in self._nodes.items()},
            "next": {j: {"phase": n.phase.value, "iteration": n.iteration, "status": n.status,
                         "held": list(n.held), "pending": list(n.pending),
                         "granted_at": n.granted_at, "tail": n.tail}
                     for j, n in self._next.items()},
            "cycle": {node: list(c) for node, c in self._cycle.items()},
            "turn": dict(self._turn),
            "holder": dict(self._holder),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PhaseQueues:
        queues = cls()
        for job_id, n in data["jobs"].items():
            queues._nodes[job_id] = {Pool.ROLLOUT: tuple(n["rollout_node_ids"]),
                                     Pool.TRAIN: tuple(n["train_node_ids"])}
        for job_id, n in data["next"].items():
            queues._next[job_id] = _NextPhase(Pool(n["phase"]), int(n["iteration"]), n["status"],
                                              list(n["held"]), list(n["pending"]),
                                              float(n["granted_at"]), bool(n["tail"]))
        queues._cycle = {node: list(c) for node, c in data["cycle"].items()}
        queues._turn = {node: int(t) for node, t in data["turn"].items()}
        queues._holder = dict(data["holder"])
        queues._check_consistent()
        return queues

    # --- internals -----------------------------------------------------------------------------
    def _known(self, job_id: str) -> str:
        if job_id not in self._nodes:
            raise PlacementError(f"job {job_id!r} has no phase queue in this group; admit it "
                                 f"first (members: {sorted(self._nodes)})")
        return job_id

    def _grantable(self, job_id: str) -> tuple[list[str], list[str]] | None:
        """(free nodes, nodes still held by a migrated tail) if the job may start now, else None.
        A rollout may start on part of its nodes only where the rest are held by a shrunk tail."""
        free, pending = [], []
        for node_id in self._nodes[job_id][self._next[job_id].phase]:
            cycle, turn, holder = self._cycle[node_id], self._turn[node_id], self._holder[node_id]
            if holder is None and cycle[turn] == job_id:
                free.append(node_id)
            elif holder is not None and holder != job_id and self._next[holder].tail \
                    and cycle[(turn + 1) % len(cycle)] == job_id:
                pending.append(node_id)  # the tail's turn here ends when it releases; ours is next
            else:
                return None
        return (free, pending) if free else None

    def _pass_turn(self, node_ids: Sequence[str]) -> list[Permit]:
        """Free ``node_ids``, advance their turn, and hand each to a partially started rollout
        that was waiting for exactly this node."""
        for node_id in node_ids:
            self._turn[node_id] = (self._turn[node_id] + 1) % len(self._cycle[node_id])
        return self._free(node_ids)

    def _free(self, node_ids: Sequence[str]) -> list[Permit]:
        grown: dict[str, None] = {}
        for node_id in node_ids:
            self._holder[node_id] = None
            heir = self.turn(node_id)
            if heir is not None and node_id in self._next[heir].pending:
                self._holder[node_id] = heir
                self._next[heir].pending.remove(node_id)
                self._next[heir].held.append(node_id)
                grown[heir] = None
        return [self._permit(j) for j in grown]

    def _permit(self, job_id: str) -> Permit:
        n = self._next[job_id]
        return Permit(job_id, n.phase, n.iteration, tuple(n.held), tuple(n.pending), n.granted_at)

    def _check_consistent(self) -> None:
        for job_id, nxt in self._next.items():
            for node_id in nxt.held:
                if self._holder.get(node_id) != job_id:
                    raise PlacementError(f"persisted permits are inconsistent: job {job_id!r} "
                                         f"holds {node_id} but the node's holder is "
                                         f"{self._holder.get(node_id)!r}; rebuild the group state")
