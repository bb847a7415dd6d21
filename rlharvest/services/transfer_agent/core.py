"""The transfer agent's core: which jobs it holds (each a version store and a shard staging),
which publishes and pulls it admits and why it refuses the others, which packed pulls it keeps,
and when an idle job goes. Synchronous and free of I/O: no sockets, threads, event loop,
metrics or logs. Refusals are ``errors.ServiceError``s, which the servicer answers through the
one error-to-status mapping; what the servicer should log comes back as data.

Threading contract (the servicer's): the bookkeeping methods here run on the event loop's
thread; the ``VersionStore`` of a job (``job(...).store``) is handed to the one store thread for
its heavy work, as it always was, so this class never touches a store from two threads at once
itself.
"""

from __future__ import annotations

import json
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from rlharvest.common import errors
from rlharvest.common.pb import transfer_agent_pb2 as pb
from rlharvest.services.transfer_agent import flat_shards, sharding
from rlharvest.services.transfer_agent.bucketing import VersionManifest, manifest_dtype, pack
from rlharvest.services.transfer_agent.config import AgentConfig
from rlharvest.services.transfer_agent.delta_codec import Encoding
from rlharvest.services.transfer_agent.protocol import manifest_id
from rlharvest.services.transfer_agent.shard_staging import Admission, ShardStaging
from rlharvest.services.transfer_agent.sharding import ShardingError
from rlharvest.services.transfer_agent.version_store import (
    EvictionRecord,
    VersionStore,
    VersionUnavailableError,
)

# Packed pulls kept: the plans N workers ask for after a publish; more would hold old bytes.
PACKED_CACHE_ENTRIES = 8

# A pull's identity: (job, version, holding, tp_rank, tp_size, names). Two requests with the
# same key get the same plan and buckets.
PullKey = tuple[str, int, int | None, int, int, tuple[str, ...]]
ParallelMap = Callable[..., Iterator]


@dataclass
class PackedPull:
    """One planned pull, packed: what PlanPull answered and the buckets PullBuckets streams."""

    plan: pb.PullPlan
    buckets: list[bytes]


@dataclass
class JobState:
    store: VersionStore
    staging: ShardStaging  # TP/DP shards of versions whose other ranks have not published yet
    used_at: float  # the core's clock at its last publish, relay or pull


@dataclass(frozen=True)
class PublishAdmission:
    """A publish header the agent admitted before its bytes arrive: its parsed manifest and,
    for a shard, its place in the staging (hand back to ``add_shard`` or ``abandon``)."""

    manifest: VersionManifest
    shard: Admission | None


@dataclass(frozen=True)
class DroppedJob:
    """An idle job the core let go, for the servicer's log and metrics."""

    job: str
    idle_s: float
    freed_bytes: int
    versions: tuple[int, ...]


def is_shard(header: pb.PublishHeader) -> bool:
    """tp/dp_size 0 or 1 and rank 0 publish a whole model; anything else claims to be a shard."""
    return header.tp_size > 1 or header.tp_rank != 0 or is_dp_shard(header)


def is_dp_shard(header: pb.PublishHeader) -> bool:
    return header.dp_size > 1 or header.dp_rank != 0


def shard_label(header: pb.PublishHeader) -> str:
    return "DP" if is_dp_shard(header) else "TP"


class AgentCore:
    """Per job: a version store, a shard staging and an idle clock; across jobs: the packed
    pulls cache, the work under way (claims) and the dropped jobs still to be unannounced.
    ``clock`` is monotonic seconds (injected so tests move time by hand)."""

    def __init__(self, cfg: AgentConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.clock = clock
        self._jobs: dict[str, JobState] = {}
        # Per job, the publishes, relays and packs of it under way: an idle check never drops a
        # job whose store or staging work is still to land (the servicer reads its state then).
        self._using: dict[str, int] = {}
        # Dropped jobs whose holder record is still to be deleted (etcd may be unreachable).
        self._unannounced: set[str] = set()
        self._packed: OrderedDict[PullKey, PackedPull] = OrderedDict()

    # ---- what is held -------------------------------------------------------------------------

    def held(self, job: str) -> tuple[int, ...]:
        entry = self._jobs.get(job)
        return entry.store.held_versions if entry else ()

    def latest(self, job: str) -> int | None:
        entry = self._jobs.get(job)
        return entry.store.latest if entry else None

    def held_bytes(self, job: str) -> int:
        entry = self._jobs.get(job)
        return entry.store.held_bytes if entry else 0

    def jobs(self) -> list[str]:
        return sorted(self._jobs)

    def touched(self, job: str) -> JobState | None:
        """The job's state (None when not held), its idle clock restarted: every publish, relay
        and pull of a job passes here or through ``job``."""
        entry = self._jobs.get(job)
        if entry is not None:
            entry.used_at = self.clock()
        return entry

    def job(self, job: str) -> JobState:
        """The job's state, touched; a job this agent does not hold (never, or dropped) starts
        afresh."""
        entry = self.touched(job)
        if entry is None:
            cfg = self.cfg
            entry = self._jobs[job] = JobState(
                VersionStore(cfg.memory_budget_bytes, cfg.max_versions, cfg.encode_cache_bytes),
                ShardStaging(cfg.memory_budget_bytes, cfg.max_tp_size), self.clock())
        return entry

    # ---- work under way -----------------------------------------------------------------------

    def claim(self, job: str) -> None:
        """A publish, relay or pack of ``job`` began: the job is not dropped until it ends."""
        self._using[job] = self._using.get(job, 0) + 1

    def release(self, job: str) -> None:
        """The claimed work ended; the job's idle clock starts now, after the work's holder
        record and announcement went out (a relay compares announcement ages with job_idle_s,
        so a dropped job's latest announcement is always at least that old)."""
        left = self._using[job] - 1
        if left:
            self._using[job] = left
        else:
            del self._using[job]
        self.touched(job)

    # ---- admitting publishes ------------------------------------------------------------------

    def admit_publish(self, header: pb.PublishHeader) -> PublishAdmission:
        """Check a publish header before its bytes arrive; a shard also gets its staging place.
        Raises the refusal (a ServiceError) otherwise."""
        manifest = self._check_publish(header)
        return PublishAdmission(manifest, self._admit_shard(header, manifest)
                                if is_shard(header) else None)

    def _check_publish(self, header: pb.PublishHeader) -> VersionManifest:
        _check_job_and_version(header)
        latest = self.latest(header.job)
        if latest is not None and header.version <= latest:  # refuse before the bytes arrive
            raise errors.FailedPrecondition(f"version {header.version} of job {header.job} is "
                                            f"not newer than the latest published version "
                                            f"{latest}; versions only move forward")
        manifest = _parse_manifest(header)
        self._check_publish_base(header, manifest)
        full_bytes = sum(math.prod(e.shape) * manifest_dtype(e).itemsize
                         for e in manifest.entries)
        if max(full_bytes, manifest.total_bytes) > self.cfg.memory_budget_bytes:
            raise errors.ResourceExhausted(f"version {header.version} is {full_bytes} bytes, "
                                           "over this agent's memory_budget_bytes "
                                           f"{self.cfg.memory_budget_bytes}")
        _check_layout(header, manifest)
        return manifest

    def _check_publish_base(self, header: pb.PublishHeader, manifest: VersionManifest) -> None:
        """A delta publish (sparse entries against ``base_version``) of a whole model or of a
        flat DP shard (against that rank's slice of the base), whose base this agent holds;
        anything else carries every tensor dense."""
        sparse = any(e.encoding != Encoding.DENSE.name for e in manifest.entries)
        if manifest.base_version is None:
            if sparse:
                raise errors.InvalidArgument("a publish with delta entries names the version "
                                             "they apply to (the manifest's base_version)")
            return
        if is_shard(header) and not is_dp_shard(header):
            raise errors.InvalidArgument("TP shards are published dense; only a whole model "
                                         "or a flat DP shard is published as a delta")
        held = self.held(header.job)
        if manifest.base_version not in held:
            raise errors.FailedPrecondition(
                f"this agent does not hold version {manifest.base_version}, the base of the "
                f"delta publish of version {header.version} (it holds {list(held) or 'nothing'}"
                "): publish this version dense")

    def _admit_shard(self, header: pb.PublishHeader, manifest: VersionManifest) -> Admission:
        """Refuse a shard that cannot join its version before its bytes arrive."""
        if is_dp_shard(header):
            return self._admit_dp_shard(header, manifest)
        if (manifest.tp_rank, manifest.tp_size) != (header.tp_rank, header.tp_size):
            raise errors.InvalidArgument(f"the header says TP rank {header.tp_rank} of "
                                         f"{header.tp_size} but the manifest says "
                                         f"{manifest.tp_rank} of {manifest.tp_size}")
        signature = {e.name: (e.dtype, e.shape) for e in manifest.entries}
        try:
            for entry in manifest.entries:  # every tensor needs a TP rule to be re-sliced
                sharding.full_shape(entry.name, entry.shape, max(header.tp_size, 1))
            return self.job(header.job).staging.admit(
                header.version, header.tp_rank, header.tp_size, signature, manifest.total_bytes,
                manifest.run)
        except ShardingError as exc:
            raise errors.InvalidArgument(f"TP shard of version {header.version}: {exc}") from None

    def _admit_dp_shard(self, header: pb.PublishHeader, manifest: VersionManifest) -> Admission:
        """A flat DP shard: one slice of every tensor, whose whole shape the manifest states."""
        if not manifest.full_shapes:  # from_dict already refused a count that does not match
            raise errors.InvalidArgument(f"DP shard of version {header.version}: the manifest "
                                         "states no full_shapes; a flat shard names the whole "
                                         "shape of every tensor")
        shapes = manifest.full_shape_of()
        try:
            for entry in manifest.entries:
                flat_shards.check_shard_shape(entry.name, entry.shape, shapes[entry.name],
                                              header.dp_size)
            signature = {e.name: (e.dtype, shapes[e.name]) for e in manifest.entries}
            # What the shard stages is its decoded slices, which a delta's bytes understate.
            decoded = sum(math.prod(e.shape) * manifest_dtype(e).itemsize
                          for e in manifest.entries)
            return self.job(header.job).staging.admit(
                header.version, header.dp_rank, header.dp_size, signature, decoded,
                manifest.run, layout="dp")
        except flat_shards.FlatShardError as exc:
            raise errors.InvalidArgument(f"DP shard of version {header.version}: {exc}") from None

    def abandon(self, job: str, admission: Admission) -> None:
        """A shard's stream failed: its rank may publish again."""
        self._jobs[job].staging.abandon(admission)

    def add_shard(self, job: str, admission: Admission, tensors: dict[str, torch.Tensor]
                  ) -> list[dict[str, torch.Tensor]] | None:
        """Stage a decoded shard: every rank's shard once it completes the version, else None
        (``shards_missing`` says which ranks are still to come)."""
        return self._jobs[job].staging.add(admission, tensors)

    def shards_missing(self, job: str, version: int) -> list[int]:
        return self._jobs[job].staging.missing(version)

    def shards_stored(self, job: str, version: int) -> None:
        """The version ``add_shard`` completed reached the store, or failed to."""
        self._jobs[job].staging.stored(version)

    # ---- holding versions ---------------------------------------------------------------------

    def now_held(self, job: str, version: int, records: Sequence[EvictionRecord]) -> list[int]:
        """``version`` of ``job`` landed in its store, evicting ``records``: the packed pulls
        that read an evicted version go, and so do the staged shards of versions not newer
        (they can never be announced). Returns those staged versions, for the log."""
        evicted = {r.version for r in records}
        for key in [k for k in self._packed if k[0] == job and evicted & {k[1], k[2]}]:
            del self._packed[key]
        return self._jobs[job].staging.drop_through(version)

    # ---- admitting pulls ----------------------------------------------------------------------

    def admit_pull(self, request: pb.PullRequest) -> tuple[PullKey, VersionStore]:
        """The pull's key and its job's store (touched), or the refusal: a job with no version
        held, or a version, holding or TP slice that cannot be."""
        entry = self.touched(request.job)
        if entry is None or entry.store.latest is None:
            raise errors.NotFound(f"this agent holds no version of job {request.job!r}; wait "
                                  "for an announcement or ask another agent")
        tp_size = request.tp_size or 1
        if request.version < 0 or request.holding < 0 or tp_size < 1 or \
                not 0 <= request.tp_rank < tp_size:
            raise errors.InvalidArgument(f"pull of version {request.version} holding "
                                         f"{request.holding} for tp_rank {request.tp_rank} of "
                                         f"tp_size {tp_size}: versions are >= 0 and ranks run "
                                         "from 0 to tp_size - 1")
        version = request.version or entry.store.latest
        holding = request.holding if request.has_holding else None
        names = tuple(sorted(set(request.names)))
        return (request.job, version, holding, request.tp_rank, tp_size, names), entry.store

    def packed(self, key: PullKey) -> PackedPull | None:
        """The packed pull of ``key`` when it is cached (then the most recently used)."""
        packed = self._packed.get(key)
        if packed is not None:
            self._packed.move_to_end(key)
        return packed

    def remember(self, key: PullKey, packed: PackedPull) -> None:
        """Cache a packed pull; the least recently used go beyond PACKED_CACHE_ENTRIES."""
        self._packed[key] = packed
        while len(self._packed) > PACKED_CACHE_ENTRIES:
            self._packed.popitem(last=False)

    def is_cross_cluster(self, pull: pb.PullRequest) -> bool:
        """Whether the pull crosses the slow link: it names a cluster, and not this agent's."""
        return bool(pull.requester_cluster) and pull.requester_cluster != self.cfg.cluster

    # ---- dropping idle jobs -------------------------------------------------------------------

    def drop_idle(self, now: float) -> list[DroppedJob]:
        """Drop every job unused (no publish, relay or pull) since ``now - job_idle_s`` and with
        no work claimed: its versions, staged shards and packed pulls go. Their holder records
        are still to be deleted (``unannounced``). job_idle_s 0 drops nothing."""
        idle_s = self.cfg.job_idle_s
        if not idle_s:
            return []
        dropped = [job for job, entry in self._jobs.items()
                   if job not in self._using and now - entry.used_at >= idle_s]
        gone = []
        for job in dropped:
            entry = self._jobs.pop(job)
            for key in [k for k in self._packed if k[0] == job]:
                del self._packed[key]
            gone.append(DroppedJob(job, now - entry.used_at, entry.store.held_bytes,
                                   entry.store.held_versions))
        self._unannounced.update(dropped)
        return gone

    def unannounced(self) -> list[str]:
        """Dropped jobs whose holder record is still to be deleted, in name order."""
        return sorted(self._unannounced)

    def announced(self, job: str) -> None:
        """``job``'s holder record is deleted (or there is none to delete)."""
        self._unannounced.discard(job)


# ---- checks and steps that need no state --------------------------------------------------------


def _check_job_and_version(header: pb.PublishHeader) -> None:
    if not header.job or "/" in header.job:
        raise errors.InvalidArgument(f"job {header.job!r} must be non-empty and contain no '/'")
    if header.version < 0:
        raise errors.InvalidArgument(f"version must be >= 0, got {header.version}")


def _parse_manifest(header: pb.PublishHeader) -> VersionManifest:
    try:
        manifest = VersionManifest.from_dict(json.loads(header.manifest_json))
    except (ValueError, TypeError) as exc:
        raise errors.InvalidArgument(f"publish manifest is not valid: {exc}") from None
    if manifest.version != header.version:
        raise errors.InvalidArgument(f"the manifest is for version {manifest.version} but "
                                     f"the header publishes {header.version}")
    return manifest


def _check_layout(header: pb.PublishHeader, manifest: VersionManifest) -> None:
    """One layout per publish, and a whole-model header over a whole-model manifest."""
    if is_dp_shard(header) and (header.tp_size > 1 or header.tp_rank):
        raise errors.InvalidArgument(f"version {header.version} is published as DP shards "
                                     f"and TP shards (tp_size {header.tp_size}) at once; "
                                     "publish one layout (TP within DP is not supported)")
    if not is_shard(header) and (manifest.tp_size > 1 or manifest.tp_rank):
        raise errors.InvalidArgument(f"the header publishes version {header.version} as a "
                                     f"whole model (tp_size {header.tp_size}) but its "
                                     f"manifest is TP rank {manifest.tp_rank} of "
                                     f"{manifest.tp_size}; a shard's header states its "
                                     "tp_rank and tp_size")


def delta_base(store: VersionStore, header: pb.PublishHeader, base_version: int
               ) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """The tensors (and their known linear sums) a delta publish applies to: the whole base
    version, or for a DP shard this rank's slice of it (a copy of 1/N; the store's sums are the
    whole tensors', so the slices' are computed later). Refused when the base was evicted while
    the delta arrived. Runs where the store runs (the store thread)."""
    try:
        whole = store.full_tensors(base_version)
    except VersionUnavailableError:
        raise errors.FailedPrecondition(
            f"version {base_version}, the base of the delta publish of version "
            f"{header.version}, was evicted meanwhile: publish this version dense") from None
    if not is_dp_shard(header):
        return whole, store.sums(base_version)
    return flat_shards.flat_shards(whole, header.dp_rank, header.dp_size), {}


def pack_pull(store: VersionStore, key: PullKey, bucket_bytes: int,
              parallel_map: ParallelMap = map) -> PackedPull:
    """Plan ``key``'s pull from the store and pack it into buckets of ``bucket_bytes``; the
    encoders and checksums run through ``parallel_map``. Runs where the store runs."""
    _, version, holding, tp_rank, tp_size, names = key
    plan = store.plan(version, holding=holding, tp_rank=tp_rank, tp_size=tp_size,
                      names=names or None, parallel_map=parallel_map)
    manifest, buckets = pack(plan.version, plan.base_version, list(plan.tensors), bucket_bytes,
                             tp_rank=tp_rank, tp_size=tp_size, parallel_map=parallel_map)
    manifest_json = json.dumps(manifest.to_dict())
    deltas = sum(1 for _, item in plan.tensors if item.needs_base)
    return PackedPull(pb.PullPlan(manifest_json=manifest_json, version=plan.version,
                                  note=plan.note, payload_bytes=plan.payload_bytes,
                                  dense_bytes=plan.dense_bytes, delta_tensors=deltas,
                                  plan_id=manifest_id(manifest_json)), buckets)


def check_planned(packed: PackedPull, plan_id: int, indices: Sequence[int]) -> None:
    """A bucket request against ``packed``: the plan id the client quotes (0: none quoted) is
    the plan's, and it asks for at least one bucket, all of them in the plan."""
    if plan_id and plan_id != packed.plan.plan_id:
        raise errors.Aborted("the pull's plan changed since PlanPull (a base version was "
                             "evicted); plan the pull again")
    n = len(packed.buckets)
    bad = [i for i in indices if not 0 <= i < n]
    if bad or not indices:
        raise errors.OutOfRange(f"bucket indices {bad or '[]'} are not in this plan's "
                                f"0..{n - 1}; ask for indices of the manifest PlanPull "
                                "returned")


def pull_kind(plan: pb.PullPlan) -> str:
    """The pull's label in the pulls metric: a delta, nothing to send, or dense."""
    return "delta" if plan.delta_tensors else ("noop" if not plan.dense_bytes else "dense")


def rides_inline(packed: PackedPull, inline_max_bytes: int, throttled: bool,
                 corrupting: bool) -> bool:
    """Whether a plan's buckets ride along with it: a sparse delta then costs one round trip
    instead of a plan, a connection and range fetches. Never under a throttle (inline bytes
    would bypass it) or while the chunk-corrupting test hook is armed."""
    return (bool(packed.buckets) and packed.plan.payload_bytes <= inline_max_bytes
            and not throttled and not corrupting)
