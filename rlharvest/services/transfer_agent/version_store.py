"""The transfer agent's host-memory store of recent weight versions (RLBoost §4.3, ROSE §4.2).

RLBoost's agent holds the trainer's weights in a CPU buffer so workers pull whenever they join;
ROSE's relay keeps W_{t-1} so a worker holding it receives only the sparse ΔW_t, sliced to its own
TP shard. This store keeps the last ``max_versions`` versions within ``byte_budget``, accepts a
full model or a training side's TP shards, and answers a pull with a plan of encoded slices.
Versions only move forward; eviction drops the oldest and returns a record the service reports.
Encoded slices are cached per (base, version, tp_rank, tp_size) so N workers cost one encode.
A version the trainer published as a delta arrives with its encodings, which go straight into
that cache: a worker holding the base pulls them without the agent diffing anything. The linear
sums (checksum.py) of the slices are kept too, chained from base to target by each delta, so
the worker verifies a delta without re-reading its tensors.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace

import grpc
import torch

from rlharvest.common.errors import InvalidArgument
from rlharvest.services.transfer_agent import sharding
from rlharvest.services.transfer_agent.delta_codec import EncodedTensor, encode_delta, encode_dense


class VersionStoreError(InvalidArgument, ValueError):
    """A publish or pull the store refuses; the message says what and what to do."""


class VersionOrderError(VersionStoreError):
    """A publish of a version not newer than the latest one."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class OverBudgetError(VersionStoreError):
    """A version larger than the whole byte budget: no eviction can make room for it."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class UnknownTensorsError(VersionStoreError):
    """A pull that names tensors the version does not have."""

    code = grpc.StatusCode.NOT_FOUND


class VersionUnavailableError(VersionStoreError):
    """A pull of a version the store does not hold (never published, or evicted)."""

    code = grpc.StatusCode.NOT_FOUND

    def __init__(self, message: str, evicted: EvictionRecord | None) -> None:
        super().__init__(message)
        self.evicted = evicted


@dataclass(frozen=True)
class EvictionRecord:
    version: int
    freed_bytes: int
    reason: str  # "max_versions" | "byte_budget"
    at: float


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a version: the full tensor, or a training side's TP shards (rank order)."""

    shards: tuple[torch.Tensor, ...]
    full_shape: tuple[int, ...]
    checksum: int | None = None  # CRC of the full tensor, when known (verified at publish)

    @property
    def dtype(self) -> torch.dtype:
        return self.shards[0].dtype

    @property
    def nbytes(self) -> int:
        return sum(s.numel() * s.element_size() for s in self.shards)


@dataclass(frozen=True)
class TransferPlan:
    """What a worker needs to go from ``holding`` to ``version`` for its TP slice. Entries are
    deltas against ``base_version`` unless DENSE; ``base_version`` is None when all are dense."""

    version: int
    base_version: int | None
    tp_rank: int
    tp_size: int
    tensors: tuple[tuple[str, EncodedTensor], ...]
    dense_bytes: int  # what the same slices cost sent dense
    note: str  # why the plan looks the way it does, for logs and the worker

    @property
    def payload_bytes(self) -> int:
        return sum(encoded.nbytes for _, encoded in self.tensors)


@dataclass
class _Version:
    tensors: dict[str, StoredTensor]
    published_at: float
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.nbytes = sum(t.nbytes for t in self.tensors.values())


class VersionStore:
    """``byte_budget`` bounds the held versions; encoded slices are cached on top of it, LRU,
    within ``cache_bytes``. Not thread-safe: the service calls it from one thread."""

    def __init__(self, byte_budget: int, max_versions: int = 2,
                 cache_bytes: int = 256 << 20, eviction_history: int = 1024) -> None:
        if byte_budget <= 0 or max_versions < 1 or cache_bytes < 0:
            raise ValueError(f"VersionStore needs byte_budget > 0 and max_versions >= 1 "
                             f"(got {byte_budget}, {max_versions}) and cache_bytes >= 0")
        self.byte_budget = byte_budget
        self.max_versions = max_versions
        self.cache_bytes = cache_bytes
        self._versions: OrderedDict[int, _Version] = OrderedDict()
        self._latest: int | None = None  # survives eviction: versions never move back
        self._evicted: OrderedDict[int, EvictionRecord] = OrderedDict()
        self._eviction_history = eviction_history
        self._cache: OrderedDict[tuple, EncodedTensor] = OrderedDict()
        self._cached_bytes = 0
        # (version, tp_rank, tp_size, name) -> linear sum of that slice, learned from encodes
        # and delta publishes; 8 bytes a tensor, dropped with the version.
        self._sums: dict[tuple[int, int, int, str], int] = {}

    # --- publishing -------------------------------------------------------------------------

    @property
    def latest(self) -> int | None:
        return self._latest

    @property
    def held_versions(self) -> tuple[int, ...]:
        return tuple(self._versions)

    @property
    def held_bytes(self) -> int:
        return sum(v.nbytes for v in self._versions.values())

    def publish(self, version: int, tensors: Mapping[str, torch.Tensor], *, now: float,
                copy: bool = True, checksums: Mapping[str, int] | None = None,
                sums: Mapping[str, int | None] | None = None,
                deltas: tuple[int, Mapping[str, EncodedTensor]] | None = None,
                ) -> list[EvictionRecord]:
        """Store a full model. ``copy=False`` hands over tensors the caller will not touch again.
        ``checksums``: tensor CRCs the caller verified (pulls of the whole tensor reuse them).
        ``sums``: their linear sums, where known. ``deltas``: (base version, encodings) the
        trainer published this version as; pulls from that base are served from them."""
        known = checksums or {}
        stored = {name: StoredTensor((_own(t, copy),), tuple(t.shape), known.get(name))
                  for name, t in tensors.items()}
        records = self._admit(version, stored, now)
        for name, value in (sums or {}).items():
            if value is not None:
                self._sums[(version, 0, 1, name)] = value
        if deltas is not None and deltas[0] in self._versions:
            for name, item in deltas[1].items():
                self._remember((deltas[0], version, 0, 1, name), item)
                self._learn_sums(deltas[0], version, 0, 1, name, item)
        return records

    def sums(self, version: int, tp_rank: int = 0, tp_size: int = 1) -> dict[str, int]:
        """The linear sums known for a held version's slices (rank ``tp_rank`` of ``tp_size``)."""
        return {name: value for (v, rank, size, name), value in self._sums.items()
                if (v, rank, size) == (version, tp_rank, tp_size)}

    def publish_shards(self, version: int, shards: Sequence[Mapping[str, torch.Tensor]], *,
                       now: float, copy: bool = True) -> list[EvictionRecord]:
        """Store a training side's TP shards as published (shards[r]: rank r's tensors), without
        gathering them: workers of any TP size are served by re-slicing (ROSE §4.2)."""
        if not shards:
            raise VersionStoreError(f"publish_shards(version={version}) got no shards")
        names = list(shards[0])
        for rank, rank_tensors in enumerate(shards):
            if sorted(rank_tensors) != sorted(names):
                raise VersionStoreError(f"training rank {rank} published tensors "
                                        f"{sorted(set(rank_tensors) ^ set(names))} that rank 0 did "
                                        "not (or vice versa); every rank publishes every tensor")
        stored = {}
        for name in names:
            parts = [rank_tensors[name] for rank_tensors in shards]
            _check_shards_match(version, name, parts)
            full = sharding.full_shape(name, parts[0].shape, len(parts))
            if sharding.split_dim(sharding.layout_of(name, full)) is None:
                parts = parts[:1]  # replicated: every rank holds the same tensor; keep one
            stored[name] = StoredTensor(tuple(_own(p, copy) for p in parts), full)
        return self._admit(version, stored, now)

    def full_tensors(self, version: int) -> dict[str, torch.Tensor]:
        """Every tensor of a held version, whole: the stored tensor itself when it was published
        whole, gathered (a copy) when a training side published it as TP shards."""
        held = self._held(version)
        return {name: stored.shards[0] if len(stored.shards) == 1
                else sharding.gather_shards(name, stored.shards)
                for name, stored in held.tensors.items()}

    def _admit(self, version: int, tensors: dict[str, StoredTensor],
               now: float) -> list[EvictionRecord]:
        if self._latest is not None and version <= self._latest:
            raise VersionOrderError(f"version {version} is not newer than the latest published "
                                    f"version {self._latest}; versions only move forward")
        if self._versions:
            _check_same_model(version, tensors, next(reversed(self._versions.items())))
        incoming = _Version(tensors, now)
        if incoming.nbytes > self.byte_budget:
            raise OverBudgetError(f"version {version} needs {incoming.nbytes} bytes but the "
                                  f"agent's budget is {self.byte_budget}: raise byte_budget")
        records = []
        while self._versions and (len(self._versions) >= self.max_versions
                                  or self.held_bytes + incoming.nbytes > self.byte_budget):
            reason = "max_versions" if len(self._versions) >= self.max_versions else "byte_budget"
            records.append(self._evict_oldest(reason, now))
        self._versions[version] = incoming
        self._latest = version
        return records

    def _evict_oldest(self, reason: str, now: float) -> EvictionRecord:
        version, dropped = self._versions.popitem(last=False)
        record = EvictionRecord(version, dropped.nbytes, reason, now)
        self._evicted[version] = record
        while len(self._evicted) > self._eviction_history:
            self._evicted.popitem(last=False)
        for key in [k for k in self._cache if version in (k[0], k[1])]:
            self._cached_bytes -= self._cache.pop(key).nbytes
        for key in [k for k in self._sums if k[0] == version]:
            del self._sums[key]
        return record

    # --- pulling ----------------------------------------------------------------------------

    def plan(self, version: int, *, holding: int | None = None, tp_rank: int = 0,
             tp_size: int = 1, names: Collection[str] | None = None,
             parallel_map: Callable[..., Iterator] = map) -> TransferPlan:
        """Encoded slices that take a worker holding ``holding`` (None: nothing) to ``version``
        for its TP slice (tp_rank, tp_size): sparse deltas where ``holding`` is still held and a
        delta is smaller, dense slices otherwise. ``names`` limits the plan to those tensors.
        Tensors missing from the cache are encoded through ``parallel_map`` (the encoders are
        pure functions of read-only tensors, so a thread pool's map is safe; the cache itself is
        only touched from the calling thread)."""
        target = self._held(version)
        if holding is not None and holding > version:
            raise VersionStoreError(f"the worker holds version {holding}, newer than the "
                                    f"requested {version}; versions only move forward")
        wanted = list(target.tensors) if names is None else list(names)
        unknown = [n for n in wanted if n not in target.tensors]
        if unknown:
            raise UnknownTensorsError(f"version {version} has no tensors named {unknown[:5]}"
                                      f"{' ...' if len(unknown) > 5 else ''}; ask for names from "
                                      "its manifest")
        if holding == version:
            return TransferPlan(version, None, tp_rank, tp_size, (), 0,
                                f"the worker already holds version {version}")
        base = self._versions.get(holding) if holding is not None else None
        base_version = holding if base is not None else None
        cached = {name: self._cached((base_version, version, tp_rank, tp_size, name))
                  for name in wanted}
        misses = [name for name in wanted if cached[name] is None]
        base_sums = {} if base_version is None else self.sums(base_version, tp_rank, tp_size)
        target_sums = self.sums(version, tp_rank, tp_size)
        fresh = dict(zip(misses, parallel_map(
            lambda name: _encode(name, target, base, tp_rank, tp_size, base_sums.get(name),
                                 target_sums.get(name)), misses)))
        encoded, dense_bytes = [], 0
        for name in wanted:
            item = cached[name]
            if item is None:
                item = fresh[name]
                self._remember((base_version, version, tp_rank, tp_size, name), item)
            self._learn_sums(base_version, version, tp_rank, tp_size, name, item)
            encoded.append((name, item))
            dense_bytes += _slice_bytes(name, target.tensors[name], tp_size)
        uses_base = any(item.needs_base for _, item in encoded)
        return TransferPlan(version, base_version if uses_base else None, tp_rank, tp_size,
                            tuple(encoded), dense_bytes,
                            _plan_note(version, holding, base_version, self._evicted, uses_base))

    def _held(self, version: int) -> _Version:
        if version in self._versions:
            return self._versions[version]
        held = list(self._versions)
        evicted = self._evicted.get(version)
        if evicted is not None:
            why = f"was evicted ({evicted.reason}) at t={evicted.at:.3f}"
        elif self._latest is None or version > self._latest:
            why = "has not been published yet"
        else:
            why = "is unknown here (never published, or evicted long ago)"
        raise VersionUnavailableError(f"weight version {version} {why}; this agent holds "
                                      f"{held or 'nothing'} — pull the latest instead", evicted)

    def _learn_sums(self, base_version: int | None, version: int, tp_rank: int, tp_size: int,
                    name: str, item: EncodedTensor) -> None:
        if item.target_sum is not None:
            self._sums[(version, tp_rank, tp_size, name)] = item.target_sum
        if item.base_sum is not None and base_version is not None:
            self._sums[(base_version, tp_rank, tp_size, name)] = item.base_sum

    def _cached(self, key: tuple) -> EncodedTensor | None:
        item = self._cache.get(key)
        if item is not None:
            self._cache.move_to_end(key)
        return item

    def _remember(self, key: tuple, item: EncodedTensor) -> None:
        if item.nbytes > self.cache_bytes:
            return
        self._cache[key] = item
        self._cached_bytes += item.nbytes
        while self._cached_bytes > self.cache_bytes:
            self._cached_bytes -= self._cache.popitem(last=False)[1].nbytes


def _encode(name: str, target: _Version, base: _Version | None, tp_rank: int, tp_size: int,
            base_sum: int | None, target_sum: int | None) -> EncodedTensor:
    """A slice dense (with its sum when known) or as a delta from ``base`` (the base's sum
    computed, a full pass, only the first time a delta from it is encoded)."""
    stored = target.tensors[name]
    new = _worker_slice(name, stored, tp_rank, tp_size)
    whole = len(stored.shards) == 1 and new is stored.shards[0]
    checksum = stored.checksum if whole else None
    if base is None or name not in base.tensors:
        return encode_dense(new, checksum=checksum, target_sum=target_sum)
    item = encode_delta(_worker_slice(name, base.tensors[name], tp_rank, tp_size), new,
                        checksum=checksum, base_sum=base_sum)
    return item if item.target_sum is not None else replace(item, target_sum=target_sum)


def _slice_bytes(name: str, stored: StoredTensor, tp_size: int) -> int:
    """Bytes of one worker's dense slice, from shapes alone (no slicing, no copy)."""
    itemsize = stored.shards[0].element_size()
    if len(stored.shards) == 1 and tp_size == 1:
        return stored.shards[0].numel() * itemsize
    return math.prod(sharding.shard_shape(name, stored.full_shape, tp_size)) * itemsize


def _own(tensor: torch.Tensor, copy: bool) -> torch.Tensor:
    tensor = tensor.detach().cpu()
    return tensor.clone(memory_format=torch.contiguous_format) if copy else tensor.contiguous()


def _worker_slice(name: str, stored: StoredTensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    if len(stored.shards) == 1 and tp_size == 1:
        return stored.shards[0]  # no TP on either side: any tensor, Qwen3 rule or not
    return sharding.reshard(name, stored.shards, tp_rank, tp_size)


def _check_shards_match(version: int, name: str, parts: Sequence[torch.Tensor]) -> None:
    """Re-slicing assumes equal shards: a rank with another shape was cut at another TP size."""
    first = parts[0]
    for rank, part in enumerate(parts):
        if part.shape != first.shape or part.dtype != first.dtype:
            raise VersionStoreError(f"version {version}: training rank {rank}'s shard of {name} "
                                    f"is {part.dtype}{tuple(part.shape)} but rank 0's is "
                                    f"{first.dtype}{tuple(first.shape)}; every rank publishes "
                                    "its shard at the same TP size")


def _check_same_model(version: int, tensors: Mapping[str, StoredTensor],
                      previous: tuple[int, _Version]) -> None:
    """Deltas need the same tensors with the same shapes and dtypes as the previous version."""
    prev_version, prev = previous
    if set(tensors) != set(prev.tensors):
        diff = sorted(set(tensors) ^ set(prev.tensors))
        raise VersionStoreError(f"version {version} differs from version {prev_version} in tensors "
                                f"{diff[:5]}: a model change needs a fresh agent store")
    for name, stored in tensors.items():
        old = prev.tensors[name]
        if stored.full_shape != old.full_shape or stored.dtype != old.dtype:
            raise VersionStoreError(
                f"{name} is {stored.dtype}{stored.full_shape} in version {version} but "
                f"{old.dtype}{old.full_shape} in version {prev_version}: shapes and dtypes must "
                "not change between versions")


def _plan_note(version: int, holding: int | None, base_version: int | None,
               evicted: Mapping[int, EvictionRecord], uses_base: bool) -> str:
    if holding is None:
        return f"dense: the worker holds no version; sending version {version} in full"
    if base_version is None:
        why = "was evicted" if holding in evicted else "is not held by this agent"
        return f"dense: the worker's version {holding} {why}, so no delta can be applied"
    if not uses_base:
        return f"dense: every tensor changed too much since version {holding} for a delta to pay"
    return f"delta: version {holding} -> {version}, sparse where it pays, dense elsewhere"
