"""Staging a training side's shards until every rank of a version has published (ROSE §4.2:
the trainer need not gather its model before a transfer). Two layouts: ``tp`` (tensor-parallel
shards, which the store keeps and re-slices for workers of any TP size) and ``dp`` (flat
ZeRO/data-parallel shards, flat_shards.py, which the agent joins). Each rank publishes its own
shard on its own stream and returns at once; the shard that completes the version hands all of
them, in rank order, to the version store. Pure bookkeeping: no I/O, no clock. ``tp_rank`` and
``tp_size`` below name the rank and group size of either layout.

A rank that never publishes (it crashed) must not leave its version staged for good, nor let a
restarted trainer's shards join the dead run's:

- admitting rank r's shard of version v drops every older staged version r has not sent: ranks
  publish their versions in order, so r has moved on and those versions can never complete;
- when shards do not fit the byte budget, the oldest staged versions older than v are evicted
  for v; only shards of v and newer ones wait for ranks at the budget's expense;
- a rank publishing a version it already staged replaces its shard (a retry), and a shard of a
  newer trainer ``run`` drops what an older run staged of that version (a restart);
- a version is dropped as soon as a newer one is held (it can never be announced then).

An admitted shard's bytes arrive later: ``admit`` returns an ``Admission`` that ``add`` and
``abandon`` take back, so a stream whose version was dropped meanwhile is told so rather than
joining a later admission of the same rank.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field

import grpc
import torch

from rlharvest.common.errors import InvalidArgument

# name -> (dtype name, shape): what every rank's shard of a version must agree on.
Signature = Mapping[str, tuple[str, tuple[int, ...]]]


class ShardStagingError(InvalidArgument, ValueError):
    """A shard the agent refuses: INVALID_ARGUMENT, unless the raiser gives the ``code`` that
    fits the case (ALREADY_EXISTS, FAILED_PRECONDITION, RESOURCE_EXHAUSTED)."""


@dataclass(frozen=True)
class Admission:
    """A shard admitted before its bytes arrive; hand it back to ``add`` or ``abandon``.
    ``dropped``: the staged versions that made way for it (for the caller to log)."""

    version: int
    tp_rank: int
    ticket: int
    dropped: tuple[int, ...] = ()


@dataclass
class _Staged:
    tp_size: int
    layout: str
    signature: dict[str, tuple[str, tuple[int, ...]]]
    run: int
    ranks: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    expected: dict[int, int] = field(default_factory=dict)  # rank -> ticket of its arriving bytes
    rank_bytes: dict[int, int] = field(default_factory=dict)  # arriving or staged, per rank

    @property
    def nbytes(self) -> int:
        return sum(self.rank_bytes.values())

    @property
    def complete(self) -> bool:
        return len(self.ranks) == self.tp_size

    def has(self, tp_rank: int) -> bool:
        return tp_rank in self.ranks or tp_rank in self.expected

    def missing(self) -> list[int]:  # tp_size is capped by admit, so this list stays short
        return [r for r in range(self.tp_size) if r not in self.ranks]

    def release(self, tp_rank: int) -> None:
        self.ranks.pop(tp_rank, None)
        self.rank_bytes.pop(tp_rank, None)


class ShardStaging:
    """Shards of not-yet-complete versions of one job, bounded by ``byte_budget``; TP groups of
    at most ``max_tp_size`` ranks."""

    def __init__(self, byte_budget: int, max_tp_size: int = 256) -> None:
        self.byte_budget = byte_budget
        self.max_tp_size = max_tp_size
        self._staged: dict[int, _Staged] = {}
        self._completing: set[int] = set()  # complete, on their way into the store
        self._tickets = itertools.count(1)

    @property
    def staged_versions(self) -> tuple[int, ...]:
        return tuple(sorted(self._staged))

    @property
    def staged_bytes(self) -> int:
        return sum(s.nbytes for s in self._staged.values())

    def missing(self, version: int) -> list[int]:
        staged = self._staged.get(version)
        return staged.missing() if staged else []

    def admit(self, version: int, tp_rank: int, tp_size: int, signature: Signature,
              nbytes: int, run: int = 0, layout: str = "tp") -> Admission:
        """Check a shard's header before its bytes arrive: the rank is one of ``tp_size`` (at
        most ``max_tp_size``), no other stream brings it, ``layout``, ``tp_size`` and the
        tensors (names, dtypes, shapes; a ``dp`` signature gives the whole tensors' shapes)
        agree with the ranks already staged, ``run`` is not older than theirs, and the staged
        bytes stay within the budget (evicting older versions if need be)."""
        self._check_rank(version, tp_rank, tp_size, layout)
        if version in self._completing:
            raise ShardStagingError(f"version {version} is complete and being stored; rank "
                                    f"{tp_rank}'s shard is not needed",
                                    code=grpc.StatusCode.ALREADY_EXISTS)
        dropped = self._drop_older_run(version, tp_rank, run)
        staged = self._staged.get(version)
        if staged is not None:
            _check_joins(version, tp_rank, tp_size, layout, signature, staged)
            staged.release(tp_rank)  # a rank publishing again replaces what it staged
        dropped += self._drop_left_behind(version, tp_rank)
        dropped += self._make_room(version, nbytes)
        if staged is None:
            staged = self._staged[version] = _Staged(tp_size, layout, dict(signature), run)
        admission = Admission(version, tp_rank, next(self._tickets), tuple(dropped))
        staged.expected[tp_rank] = admission.ticket
        staged.rank_bytes[tp_rank] = nbytes
        return admission

    def add(self, admission: Admission,
            tensors: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]] | None:
        """Stage an admitted shard's decoded tensors. Returns every rank's shard, in rank order,
        once this one completes the version (which then leaves the staging and stays marked as
        completing until ``stored``); else None. ShardStagingError (FAILED_PRECONDITION) when
        the version was dropped while the bytes arrived."""
        version, tp_rank = admission.version, admission.tp_rank
        staged = self._staged.get(version)
        if staged is None or staged.expected.get(tp_rank) != admission.ticket:
            raise ShardStagingError(
                f"rank {tp_rank}'s shard of version {version} is not staged any more: the "
                "version was dropped while its bytes arrived (a newer version is held, a newer "
                "one needed the staging budget, or the rank or a newer run published it again); "
                "publish a newer version", code=grpc.StatusCode.FAILED_PRECONDITION)
        del staged.expected[tp_rank]
        staged.ranks[tp_rank] = tensors
        if not staged.complete:
            return None
        del self._staged[version]
        self._completing.add(version)
        return [staged.ranks[r] for r in range(staged.tp_size)]

    def stored(self, version: int) -> None:
        """A version ``add`` completed has reached the store, or failed to: no longer marked."""
        self._completing.discard(version)

    def abandon(self, admission: Admission) -> None:
        """An admitted shard whose stream failed: free its place so the rank may publish again."""
        staged = self._staged.get(admission.version)
        if staged is None or staged.expected.get(admission.tp_rank) != admission.ticket:
            return
        del staged.expected[admission.tp_rank]
        staged.rank_bytes.pop(admission.tp_rank, None)
        if not staged.ranks and not staged.expected:
            del self._staged[admission.version]

    def drop_through(self, version: int) -> list[int]:
        """Drop staged versions not newer than ``version`` (just held): they can never be
        announced, since versions only move forward. Returns the dropped versions."""
        return self._drop([v for v in self._staged if v <= version])

    def _check_rank(self, version: int, tp_rank: int, tp_size: int, layout: str) -> None:
        if layout not in ("tp", "dp"):
            raise ShardStagingError(f"shard of version {version}: layout {layout!r} is not "
                                    "'tp' or 'dp'")
        if tp_size > self.max_tp_size:
            raise ShardStagingError(f"shard of version {version}: {layout}_size {tp_size} is "
                                    f"over this agent's max_tp_size {self.max_tp_size}")
        if tp_size < 2 or not 0 <= tp_rank < tp_size:
            raise ShardStagingError(f"shard of version {version}: {layout}_rank {tp_rank} of "
                                    f"{layout}_size {tp_size} is not a rank of a shard group "
                                    f"({layout}_size >= 2, ranks 0 to {layout}_size - 1); publish "
                                    "a full model with tp_size 0")

    def _drop_older_run(self, version: int, tp_rank: int, run: int) -> list[int]:
        """A restarted trainer's shards never join the dead run's: the newer run's first shard
        drops what the older one staged of ``version``; an older run's shard is refused."""
        staged = self._staged.get(version)
        if staged is None or staged.run == run:
            return []
        if run < staged.run:
            raise ShardStagingError(f"rank {tp_rank}'s shard of version {version} is from run "
                                    f"{run}, but run {staged.run} has staged that version; a "
                                    "restarted trainer publishes with a larger run",
                                    code=grpc.StatusCode.FAILED_PRECONDITION)
        return self._drop([version])

    def _drop_left_behind(self, version: int, tp_rank: int) -> list[int]:
        # Ranks publish their versions in order: rank tp_rank is at ``version`` now, so an older
        # version it never sent can never complete.
        return self._drop([v for v, s in self._staged.items()
                           if v < version and not s.has(tp_rank)])

    def _make_room(self, version: int, nbytes: int) -> list[int]:
        """Evict the oldest staged versions older than ``version`` until ``nbytes`` more fit;
        refuse, evicting nothing, when even all of them would not make room."""
        older = sorted(v for v in self._staged if v < version)
        evictable = sum(self._staged[v].nbytes for v in older)
        over = self.staged_bytes + nbytes - self.byte_budget
        if over > evictable:
            waiting = {v: f"{len(s.ranks)} of {s.tp_size} ranks"
                       for v, s in sorted(self._staged.items())}
            raise ShardStagingError(
                f"a shard of version {version} ({nbytes} bytes) does not fit: "
                f"{self.staged_bytes} bytes of shards already wait for ranks ({waiting}) within "
                f"the budget of {self.byte_budget}; publish the missing ranks or a newer version",
                code=grpc.StatusCode.RESOURCE_EXHAUSTED)
        evicted = []
        for v in older:
            if over <= 0:
                break
            over -= self._staged[v].nbytes
            evicted.append(v)
        return self._drop(evicted)

    def _drop(self, versions: list[int]) -> list[int]:
        for v in versions:
            del self._staged[v]
        return versions


def _check_joins(version: int, tp_rank: int, tp_size: int, layout: str, signature: Signature,
                 staged: _Staged) -> None:
    """A shard joins the ranks already staged only in their layout, at their group size, with
    their tensors and while no other stream brings the same rank."""
    if staged.layout != layout:
        raise ShardStagingError(f"rank {tp_rank} publishes version {version} as {layout} "
                                f"shards, but other ranks did as {staged.layout} shards; every "
                                "rank publishes in the same layout")
    if staged.tp_size != tp_size:
        raise ShardStagingError(f"rank {tp_rank} publishes version {version} at tp_size "
                                f"{tp_size}, but other ranks did at tp_size "
                                f"{staged.tp_size}; every rank states the same tp_size")
    _check_signature(version, tp_rank, signature, staged.signature)
    if tp_rank in staged.expected:
        raise ShardStagingError(f"rank {tp_rank}'s shard of version {version} is already "
                                "arriving on another stream; publish each rank's shard once",
                                code=grpc.StatusCode.ALREADY_EXISTS)


def _check_signature(version: int, tp_rank: int, signature: Signature, first: Signature) -> None:
    if set(signature) != set(first):
        diff = sorted(set(signature) ^ set(first))
        raise ShardStagingError(f"rank {tp_rank}'s shard of version {version} differs from the "
                                f"ranks already staged in tensors {diff[:5]}; every rank "
                                "publishes every tensor")
    for name, (dtype, shape) in signature.items():
        if (dtype, tuple(shape)) != (first[name][0], tuple(first[name][1])):
            raise ShardStagingError(f"rank {tp_rank}'s shard of {name} is {dtype}{tuple(shape)} "
                                    f"but the ranks already staged sent {first[name][0]}"
                                    f"{tuple(first[name][1])}; shards of one tensor match")
