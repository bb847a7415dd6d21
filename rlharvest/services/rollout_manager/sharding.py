"""A job's manager split into shards: which shard owns a worker, how a step's requests split
across the shards, and when queued requests cross from one shard to another. Pure: the
manager's shell (workers.py), its election (main.py) and the trainer's client (client.py,
shard_client.py) call it.

Ownership is a rule of the worker's id, crc32(worker id) mod shards, rather than a worker flag:
every manager of a shard, its standby included, computes the same set from the etcd records
alone, so a worker that kept a dead leader's requests is greeted by that shard's successor
and hands them over as with one manager, and a worker needs no restart when shards change."""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlharvest.services.rollout_manager.commands import Command
    from rlharvest.services.rollout_manager.step import Step


def shard_of(worker_id: str, shards: int) -> int:
    """The shard that owns ``worker_id`` (stable across processes and restarts: not hash())."""
    if shards < 1:
        raise ValueError(f"shards {shards} must be at least 1")
    return zlib.crc32(worker_id.encode()) % shards


def split_by_capacity(count: int, capacities: Sequence[int]) -> list[int]:
    """How many of ``count`` requests each shard gets: in proportion to its capacity (the sum
    of its workers' slots), largest remainders first, so the shards' queues empty together. A
    job whose shards report no capacity yet splits evenly."""
    if not capacities:
        raise ValueError("no shard to split a step across")
    weights = list(capacities) if sum(capacities) > 0 else [1] * len(capacities)
    total = sum(weights)
    exact = [count * w / total for w in weights]
    shares = [int(e) for e in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: (shares[i] - exact[i], i))
    for i in by_remainder[:count - sum(shares)]:
        shares[i] += 1
    return shares


@dataclass(frozen=True)
class ShardLoad:
    """One shard as its status shows it, for the step at hand: ``queued``, the step's requests
    that wait in the shard's manager on no worker (movable without losing a token);
    ``idle_slots``, its healthy workers' slots with no request assigned."""

    queued: int
    idle_slots: int


@dataclass(frozen=True)
class Move:
    src: int
    dst: int
    count: int


def plan_moves(loads: Mapping[int, ShardLoad]) -> list[Move]:
    """Queued requests to move: from the shard with the longest queue to the shard with the
    most idle slots, as many as the destination can start at once (and no more than the
    source has queued). A shard with its own queue gets none: its idle slots are about to be
    filled from it. At most one move per source per round: the client re-plans on fresh
    statuses after the move, so a shard's freed slots are not counted twice."""
    moves: list[Move] = []
    sources = sorted((s for s, load in loads.items() if load.queued > 0),
                     key=lambda s: (-loads[s].queued, s))
    free = {s: load.idle_slots for s, load in loads.items() if load.queued == 0
            and load.idle_slots > 0}
    for src in sources:
        if not free:
            break
        dst = max(free, key=lambda s: (free[s], -s))
        count = min(loads[src].queued, free.pop(dst))
        moves.append(Move(src, dst, count))
    return moves


@dataclass
class Withdrawal:
    """What a shard gave up (``RolloutControl.withdraw``): the requests, the tokens it had of
    each, the steps this left with none (ended) and the aborts for those on a worker."""

    taken: list[str] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    ended: list[Step] = field(default_factory=list)
    commands: list[Command] = field(default_factory=list)
