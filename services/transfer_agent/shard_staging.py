"""Staging a training side's TP shards until every rank of a version has published (ROSE §4.2:
the trainer need not gather its model before a transfer; the agent re-slices the shards for
workers of any TP size). Each rank publishes its own shard on its own stream and returns at
once; the shard that completes the version hands all of them, in rank order, to the version
store. Pure bookkeeping: no I/O, no clock.

A rank that never publishes leaves its version staged; the version is dropped as soon as a newer
one is held (it can never be announced then), and the memory bound refuses new shards while
stale ones fill it, naming the versions that wait for ranks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

# name -> (dtype name, shape): what every rank's shard of a version must agree on.
Signature = Mapping[str, tuple[str, tuple[int, ...]]]


class ShardStagingError(ValueError):
    """A shard the agent refuses; ``code`` is the gRPC status name the refusal is answered with."""

    def __init__(self, message: str, code: str = "INVALID_ARGUMENT") -> None:
        super().__init__(message)
        self.code = code


@dataclass
class _Staged:
    tp_size: int
    signature: dict[str, tuple[str, tuple[int, ...]]]
    ranks: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    expected: set[int] = field(default_factory=set)  # ranks admitted, their bytes still arriving
    nbytes: int = 0

    def missing(self) -> list[int]:
        return [r for r in range(self.tp_size) if r not in self.ranks]


class ShardStaging:
    """Shards of not-yet-complete versions of one job, bounded by ``byte_budget``."""

    def __init__(self, byte_budget: int) -> None:
        self.byte_budget = byte_budget
        self._staged: dict[int, _Staged] = {}

    @property
    def staged_versions(self) -> tuple[int, ...]:
        return tuple(sorted(self._staged))

    def missing(self, version: int) -> list[int]:
        staged = self._staged.get(version)
        return staged.missing() if staged else []

    def admit(self, version: int, tp_rank: int, tp_size: int, signature: Signature,
              nbytes: int) -> None:
        """Check a shard's header before its bytes arrive: the rank is one of ``tp_size``, no
        other stream brings it, ``tp_size`` and the tensors (names, dtypes, shapes) agree with
        the ranks already staged, and the staged bytes stay within the budget."""
        if tp_size < 2 or not 0 <= tp_rank < tp_size:
            raise ShardStagingError(f"shard of version {version}: tp_rank {tp_rank} of tp_size "
                                    f"{tp_size} is not a rank of a TP group (tp_size >= 2, ranks "
                                    "0 to tp_size - 1); publish a full model with tp_size 0")
        staged = self._staged.get(version)
        if staged is None:
            self._check_budget(version, nbytes)
            staged = self._staged[version] = _Staged(tp_size, dict(signature))
        elif staged.tp_size != tp_size:
            raise ShardStagingError(f"rank {tp_rank} publishes version {version} at tp_size "
                                    f"{tp_size}, but other ranks did at tp_size "
                                    f"{staged.tp_size}; every rank states the same tp_size")
        else:
            _check_signature(version, tp_rank, signature, staged.signature)
            self._check_budget(version, nbytes)
        if tp_rank in staged.ranks or tp_rank in staged.expected:
            raise ShardStagingError(f"rank {tp_rank} of version {version} was already published; "
                                    "publish each rank's shard once", "ALREADY_EXISTS")
        staged.expected.add(tp_rank)
        staged.nbytes += nbytes

    def add(self, version: int, tp_rank: int,
            tensors: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]] | None:
        """Stage an admitted rank's decoded shard. Returns every rank's shard, in rank order,
        once this one completes the version (which then leaves the staging); else None."""
        staged = self._staged[version]
        staged.expected.discard(tp_rank)
        staged.ranks[tp_rank] = tensors
        if staged.missing():
            return None
        del self._staged[version]
        return [staged.ranks[r] for r in range(staged.tp_size)]

    def abandon(self, version: int, tp_rank: int, nbytes: int) -> None:
        """An admitted shard whose stream failed: free its place so the rank may publish again."""
        staged = self._staged.get(version)
        if staged is None or tp_rank not in staged.expected:
            return
        staged.expected.discard(tp_rank)
        staged.nbytes -= nbytes
        if not staged.ranks and not staged.expected:
            del self._staged[version]

    def drop_through(self, version: int) -> list[int]:
        """Drop staged versions not newer than ``version`` (just held): they can never be
        announced, since versions only move forward. Returns the dropped versions."""
        dropped = [v for v in self._staged if v <= version]
        for v in dropped:
            del self._staged[v]
        return dropped

    def _check_budget(self, version: int, nbytes: int) -> None:
        staged_bytes = sum(s.nbytes for s in self._staged.values())
        if staged_bytes + nbytes > self.byte_budget:
            waiting = {v: s.missing() for v, s in sorted(self._staged.items())}
            raise ShardStagingError(
                f"a shard of version {version} ({nbytes} bytes) does not fit: {staged_bytes} "
                f"bytes of shards already wait for ranks {waiting} within the budget of "
                f"{self.byte_budget}; publish the missing ranks or a newer version",
                "RESOURCE_EXHAUSTED")


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
