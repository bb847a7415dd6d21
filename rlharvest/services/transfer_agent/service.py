"""The transfer agent's async shell: receives publishes, answers pull plans and streams bucket
bytes; the version store (pure core) decides what is held and what a pull carries. Store work
(publish, plan, encode) runs on one thread, in order — the store is not thread-safe — so the
event loop keeps streaming other pulls meanwhile; streaming itself never touches the store, so a
slow pull never holds up a publish."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import NoReturn, TypeVar

import grpc
import torch

from rlharvest.common import errors, server_guard
from rlharvest.common.etcd_outage import etcd_away
from rlharvest.common.pb import transfer_agent_pb2 as pb, transfer_agent_pb2_grpc
from rlharvest.services.transfer_agent import flat_shards, metrics, sharding
from rlharvest.services.transfer_agent.apply import apply_pull
from rlharvest.services.transfer_agent.bucketing import (
    ManifestError,
    VersionManifest,
    manifest_dtype,
    pack,
    unpack,
)
from rlharvest.services.transfer_agent.checksum import ChecksumMismatchError, tensor_checksum
from rlharvest.services.transfer_agent.client import DATA_ENDPOINT_METADATA, manifest_id
from rlharvest.services.transfer_agent.config import AgentConfig
from rlharvest.services.transfer_agent.data_path import BucketAssembler, stream_buckets
from rlharvest.services.transfer_agent.delta_codec import (
    DeltaCodecError,
    EncodedTensor,
    Encoding,
    encoded_tensor,
)
from rlharvest.services.transfer_agent.shard_staging import Admission, ShardStaging
from rlharvest.services.transfer_agent.sharding import ShardingError
from rlharvest.services.transfer_agent.throttle import TokenBucket
from rlharvest.services.transfer_agent.version_store import (
    EvictionRecord,
    VersionStore,
    VersionUnavailableError,
)

log = logging.getLogger(__name__)

_PACKED_CACHE_ENTRIES = 8
# The idle-job check runs this often at most: a dropped job outlives job_idle_s by up to this.
_IDLE_CHECK_MAX_S = 60.0
T = TypeVar("T")


@dataclass
class _Packed:
    """One planned pull, packed: what PlanPull answered and the buckets PullBuckets streams."""

    plan: pb.PullPlan
    buckets: list[bytes]


# A publish's decoded tensors, and the sparse encodings (by name) it arrived in.
_Decoded = tuple[dict[str, torch.Tensor], dict[str, EncodedTensor]]


@dataclass
class _Job:
    store: VersionStore
    staging: ShardStaging  # TP shards of versions whose other ranks have not published yet
    used_at: float  # time.monotonic() of its last publish, relay or pull


# Hooks the shell calls after a version lands (announce + holder record in etcd) and after an
# idle job was dropped (its holder record deleted).
OnHeld = Callable[[str, int, list[EvictionRecord]], Awaitable[None]]
OnDropped = Callable[[str], Awaitable[None]]


class AgentService(transfer_agent_pb2_grpc.TransferAgentServicer):
    def __init__(self, cfg: AgentConfig, on_held: OnHeld | None = None,
                 on_dropped: OnDropped | None = None) -> None:
        self.cfg = cfg
        self._on_held = on_held
        self._on_dropped = on_dropped
        self._jobs: dict[str, _Job] = {}
        # Per job, the publishes, relays and packs of it under way: an idle check never drops a
        # job whose store or staging work is still to land (its hooks read self._jobs[job]).
        self._using: dict[str, int] = {}
        # Dropped jobs whose holder record is still to be deleted (etcd may be unreachable).
        self._unannounced: set[str] = set()
        self._packed: OrderedDict[tuple, _Packed] = OrderedDict()
        self._store_thread = ThreadPoolExecutor(1, thread_name_prefix="store")
        # Encoders and bucket checksums run side by side here (numpy and zlib release the GIL);
        # only the store thread submits to it, so store state stays single-threaded.
        self._codec_pool = ThreadPoolExecutor(cfg.codec_threads, thread_name_prefix="codec")
        # One pack per key, however many ask.
        self._packing: dict[tuple, asyncio.Task[_Packed]] = {}
        now = time.monotonic()
        self._send_throttle = (TokenBucket(cfg.send_rate_bytes_per_s, cfg.chunk_bytes, now)
                               if cfg.send_rate_bytes_per_s else None)
        self._link_throttle = (TokenBucket(cfg.cross_cluster_rate_bytes_per_s, cfg.chunk_bytes, now)
                               if cfg.cross_cluster_rate_bytes_per_s else None)
        self._corrupt_left = cfg.fault_corrupt_chunks
        self.endpoint = ""
        self.data_endpoint = ""  # host:port of the HTTP data path; "" serves bytes over gRPC only

    # ---- state other parts of the process read ----------------------------------------------

    def held(self, job: str) -> tuple[int, ...]:
        entry = self._jobs.get(job)
        return entry.store.held_versions if entry else ()

    def latest(self, job: str) -> int | None:
        entry = self._jobs.get(job)
        return entry.store.latest if entry else None

    async def full_tensors(self, job: str, version: int) -> dict[str, torch.Tensor] | None:
        """A held version's whole tensors (a relay's delta base); None when it is not held.
        Runs on the store thread: a version published as TP shards is gathered (a copy)."""
        entry = self._touched(job)
        if entry is None:
            return None

        def whole() -> dict[str, torch.Tensor] | None:  # checked here: a publish may evict it
            held = version in entry.store.held_versions
            return entry.store.full_tensors(version) if held else None

        return await self._in_store(whole)

    async def sums(self, job: str, version: int) -> dict[str, int]:
        """The linear sums this agent knows for a held version's whole tensors."""
        entry = self._touched(job)
        if entry is None:
            return {}
        store = entry.store
        return await self._in_store(lambda: store.sums(version))

    def jobs(self) -> list[str]:
        return sorted(self._jobs)

    def health(self) -> dict:
        return {"status": "ok", "jobs": {job: list(self.held(job)) for job in self._jobs}}

    # ---- holding versions -------------------------------------------------------------------

    def _job(self, job: str) -> _Job:
        """The job's entry, touched; a job this agent does not hold (never, or dropped) starts
        afresh."""
        entry = self._touched(job)
        if entry is None:
            entry = self._jobs[job] = _Job(VersionStore(self.cfg.memory_budget_bytes,
                                                        self.cfg.max_versions,
                                                        self.cfg.encode_cache_bytes),
                                           ShardStaging(self.cfg.memory_budget_bytes,
                                                        self.cfg.max_tp_size),
                                           time.monotonic())
        return entry

    # ---- dropping idle jobs -------------------------------------------------------------------

    def _touched(self, job: str) -> _Job | None:
        """The job's entry (None when not held), its idle clock restarted: every publish, relay
        and pull of a job passes here or through ``_job``."""
        entry = self._jobs.get(job)
        if entry is not None:
            entry.used_at = time.monotonic()
        return entry

    def _claim(self, job: str) -> None:
        """A publish, relay or pack of ``job`` began: the job is not dropped until it ends."""
        self._using[job] = self._using.get(job, 0) + 1

    def _release(self, job: str) -> None:
        """The claimed work ended; the job's idle clock starts now, after the work's holder
        record and announcement went out (a relay compares announcement ages with job_idle_s,
        so a dropped job's latest announcement is always at least that old)."""
        left = self._using[job] - 1
        if left:
            self._using[job] = left
        else:
            del self._using[job]
        self._touched(job)

    def drop_idle(self, now: float) -> None:
        """Drop every job unused (no publish, relay or pull) since ``now - job_idle_s`` and with
        no publish, relay or pack under way: its versions, staged shards and packed pulls go (a
        pull streaming already keeps its bytes until it ends). Their holder records are deleted
        by ``forget_dropped``. job_idle_s 0 drops nothing."""
        idle_s = self.cfg.job_idle_s
        if not idle_s:
            return
        dropped = [job for job, entry in self._jobs.items()
                   if job not in self._using and now - entry.used_at >= idle_s]
        for job in dropped:
            entry = self._jobs.pop(job)
            for key in [k for k in self._packed if k[0] == job]:
                del self._packed[key]
            for gauge in (metrics.VERSIONS_HELD, metrics.HELD_BYTES, metrics.LATEST):
                gauge.remove(job)
            metrics.JOBS_DROPPED.inc()
            log.info("job %s: dropped after %.0fs with no publish, relay or pull (freed %d "
                     "bytes of versions %s); a new publish starts it afresh", job,
                     now - entry.used_at, entry.store.held_bytes, list(entry.store.held_versions))
        self._unannounced.update(dropped)

    async def forget_dropped(self) -> None:
        """Run the on_dropped hook (delete the holder record) for every dropped job not yet
        forgotten; one that raises is tried again at the next call. etcd away (the hook logs
        the outage) ends this round quietly: the next idle check tries again, and the loop
        does not crash and restart for every check of an outage."""
        for job in sorted(self._unannounced):
            if self._on_dropped is not None:
                try:
                    await self._on_dropped(job)
                except Exception as exc:
                    if not etcd_away(exc):
                        raise
                    return  # the others would fail alike
            self._unannounced.discard(job)

    async def drop_idle_jobs(self) -> None:
        """The agent's background loop (job_idle_s > 0): every job_idle_s / 4, at most every
        60 s, drop the idle jobs and delete their holder records, so a long-running agent's
        memory follows the jobs it serves now, not every job it ever served."""
        period = min(self.cfg.job_idle_s / 4, _IDLE_CHECK_MAX_S)
        while True:
            await asyncio.sleep(period)
            self.drop_idle(time.monotonic())
            await self.forget_dropped()

    async def _in_store(self, work: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._store_thread, work)

    async def hold(self, job: str, version: int, tensors: dict[str, torch.Tensor],
                   source: str, checksums: dict[str, int] | None = None,
                   sums: Mapping[str, int | None] | None = None,
                   deltas: tuple[int, Mapping[str, EncodedTensor]] | None = None,
                   ) -> list[EvictionRecord]:
        """Store a whole version (publish or relay), report evictions, then run the on_held hook.
        ``checksums``: the tensors' CRCs, already verified while decoding them; ``sums``: their
        linear sums where known; ``deltas``: the encodings a delta publish arrived as."""
        self._claim(job)
        try:
            store = self._job(job).store
            records = await self._in_store(lambda: store.publish(
                version, tensors, now=time.time(), copy=False, checksums=checksums, sums=sums,
                deltas=deltas))
            return await self._now_held(job, version, records, source)
        finally:
            self._release(job)

    async def hold_shards(self, job: str, version: int,
                          shards: list[dict[str, torch.Tensor]]) -> list[EvictionRecord]:
        """Store a version a training side published as TP shards (shards[r]: rank r's)."""
        store = self._job(job).store
        records = await self._in_store(lambda: store.publish_shards(
            version, shards, now=time.time(), copy=False))
        return await self._now_held(job, version, records, f"{len(shards)} TP shards")

    async def hold_flat_shards(self, job: str, version: int, shards: list[dict[str, torch.Tensor]],
                               full_shapes: Mapping[str, tuple[int, ...]]) -> list[EvictionRecord]:
        """Store a version a training side published as flat DP shards: joined on the store
        thread (one copy), then held like a whole publish."""
        store = self._job(job).store

        def join_and_store() -> list[EvictionRecord]:
            tensors = {name: flat_shards.join_flat(name, [r[name] for r in shards], shape)
                       for name, shape in full_shapes.items()}
            return store.publish(version, tensors, now=time.time(), copy=False)

        records = await self._in_store(join_and_store)
        return await self._now_held(job, version, records, f"{len(shards)} DP shards")

    async def _now_held(self, job: str, version: int, records: list[EvictionRecord],
                        source: str) -> list[EvictionRecord]:
        entry = self._jobs[job]
        for record in records:
            metrics.EVICTIONS.labels(record.reason).inc()
            log.warning("job %s: evicted version %d (%d bytes, %s) to hold version %d", job,
                        record.version, record.freed_bytes, record.reason, version)
        for key in [k for k in self._packed if k[0] == job and
                    any(r.version in (k[1], k[2]) for r in records)]:
            del self._packed[key]
        for stale in entry.staging.drop_through(version):
            log.warning("job %s: dropped the shards of version %d: its other ranks never "
                        "published and version %d is held now", job, stale, version)
        metrics.VERSIONS_HELD.labels(job).set(len(entry.store.held_versions))
        metrics.HELD_BYTES.labels(job).set(entry.store.held_bytes)
        metrics.LATEST.labels(job).set(version)
        log.info("job %s: holding version %d from %s (held %s)", job, version, source,
                 list(entry.store.held_versions))
        if self._on_held is not None:
            await self._on_held(job, version, records)
        return records

    # ---- RPCs ---------------------------------------------------------------------------------

    async def Publish(self, request_iterator: AsyncIterator[pb.PublishChunk],
                      context: grpc.aio.ServicerContext) -> pb.PublishReply:
        claimed: str | None = None  # the job, claimed by _receive_publish once it returned
        try:
            header, manifest, admission, (tensors, encodings) = await self._receive_publish(
                request_iterator, context)
            claimed = header.job
            if admission is not None:
                return await self._publish_shard(header, manifest, admission, tensors)
            records = await self._hold_published(header, manifest, tensors, encodings)
        except errors.ServiceError as exc:
            await _drain(request_iterator)
            await self._refuse(context, "Publish", exc)
        finally:
            if claimed is not None:
                self._release(claimed)
        metrics.PUBLISHES.labels("ok").inc()
        return pb.PublishReply(version=header.version, held_versions=self.held(header.job),
                               evicted_versions=[r.version for r in records])

    async def _receive_publish(self, request_iterator: AsyncIterator[pb.PublishChunk],
                               context: grpc.aio.ServicerContext
                               ) -> tuple[pb.PublishHeader, VersionManifest, Admission | None,
                                          _Decoded]:
        """The header, manifest, staging admission (TP shards only) and decoded tensors (with
        the encodings of a delta publish) of one publish stream, the job claimed (the caller
        releases it) from its header on, so no idle check drops it while the bytes arrive. A
        shard admitted to the staging is taken back out if its stream fails, so its rank may
        publish again."""
        header: pb.PublishHeader | None = None
        assembler: BucketAssembler | None = None
        admission: Admission | None = None
        try:
            async for message in request_iterator:
                if header is None:
                    header = message.header if message.HasField("header") else None
                    if header is None:
                        raise errors.InvalidArgument("a publish stream starts with a header "
                                                     "(job, version, manifest)")
                    self._claim(header.job)
                    await server_guard.require_job(context, header.job)  # its trainer only
                    manifest = self._check_publish(header)
                    if _is_shard(header):
                        admission = self._admit_shard(header, manifest)
                    assembler = BucketAssembler(manifest)
                    continue
                if not message.HasField("chunk") or assembler is None:
                    raise errors.InvalidArgument("a second header in one publish stream; "
                                                 "publish one version per stream")
                try:
                    assembler.add(message.chunk)
                except ValueError as exc:
                    raise errors.InvalidArgument(str(exc)) from None
                metrics.BYTES_IN.labels("publish").inc(len(message.chunk.data))
            if header is None or assembler is None:
                raise errors.InvalidArgument("empty publish stream")
            decoded = await self._decode_publish(header, assembler)
            return header, assembler.manifest, admission, decoded
        except BaseException:
            if header is not None:
                if admission is not None:
                    self._jobs[header.job].staging.abandon(admission)
                self._release(header.job)
            raise

    async def _decode_publish(self, header: pb.PublishHeader,
                              assembler: BucketAssembler) -> _Decoded:
        """The published tensors; a delta publish is applied to copies of its base version and
        its sparse encodings are kept (bytes copied out of the stream's buffers)."""
        if assembler.missing():
            raise errors.InvalidArgument(f"publish of version {header.version} ended with "
                                         f"buckets {assembler.missing()} incomplete; send every "
                                         "bucket")
        manifest = assembler.manifest
        base: dict[str, torch.Tensor] = {}
        base_sums: dict[str, int] = {}
        base_version = manifest.base_version
        if base_version is not None:
            store = self._job(header.job).store

            def base_of() -> tuple[dict[str, torch.Tensor], dict[str, int]]:
                whole = store.full_tensors(base_version)
                if not _is_dp_shard(header):
                    return whole, store.sums(base_version)
                # A DP shard's delta is against this rank's slice of the base (a copy of 1/N);
                # the store's sums are the whole tensors', so the slices' are computed.
                return flat_shards.flat_shards(whole, header.dp_rank, header.dp_size), {}

            try:
                base, base_sums = await self._in_store(base_of)
            except VersionUnavailableError:  # evicted while the delta arrived
                raise errors.FailedPrecondition(
                    f"version {base_version}, the base of the delta publish of version "
                    f"{header.version}, was evicted meanwhile: publish this version dense"
                ) from None
        loop = asyncio.get_running_loop()
        try:  # bytes that do not fit the (valid) manifest
            tensors = await loop.run_in_executor(None, partial(
                apply_pull, manifest, assembler.buffers, base, manifest.base_version,
                parallel_map=self._codec_pool.map, held_sums=base_sums))
            if _is_shard(header):  # staged and joined as tensors: no encodings to serve as is
                return tensors, {}
            sparse = {e.name for e in manifest.entries if e.encoding != Encoding.DENSE.name}
            payloads = unpack(manifest, assembler.buffers, sparse,
                              range(len(manifest.bucket_sizes)))
            return tensors, {name: encoded_tensor(bytes(view)) for name, view in payloads.items()}
        except (ManifestError, DeltaCodecError, ChecksumMismatchError) as exc:
            raise errors.DataLoss(f"publish of version {header.version}: {exc}") from None

    async def _hold_published(self, header: pb.PublishHeader, manifest: VersionManifest,
                              tensors: dict[str, torch.Tensor],
                              encodings: dict[str, EncodedTensor]) -> list[EvictionRecord]:
        """Hold a whole published version. A delta publish's new tensors get their CRCs here,
        off every pull's path, so dense pulls of it cost what they cost after a dense publish;
        its encodings serve the pulls of workers holding the base as they are."""
        crcs = {e.name: e.checksum for e in manifest.entries if e.encoding == Encoding.DENSE.name}
        deltas = None
        if manifest.base_version is not None:
            missing = [name for name in tensors if name not in crcs]
            loop = asyncio.get_running_loop()
            crcs.update(zip(missing, await asyncio.gather(*(
                loop.run_in_executor(self._codec_pool, tensor_checksum, tensors[name])
                for name in missing))))
            deltas = (manifest.base_version, encodings)
        return await self.hold(header.job, header.version, tensors, "publish", crcs,
                               {e.name: e.sum for e in manifest.entries}, deltas)

    async def _publish_shard(self, header: pb.PublishHeader, manifest: VersionManifest,
                             admission: Admission,
                             tensors: dict[str, torch.Tensor]) -> pb.PublishReply:
        """Stage one training rank's shard; the rank that completes the version stores it (TP:
        the store re-slices shards for workers of any TP size; DP: the agent joins them) and
        answers for the whole version."""
        staging = self._jobs[header.job].staging
        shards = staging.add(admission, tensors)  # refused if dropped while the shard decoded
        if shards is None:
            missing = staging.missing(header.version)
            log.info("job %s: staged %s rank %d of version %d; waiting for ranks %s",
                     header.job, _shard_label(header), admission.tp_rank, header.version,
                     missing)
            metrics.PUBLISHES.labels("staged").inc()
            return pb.PublishReply(version=header.version, held_versions=self.held(header.job),
                                   shards_missing=missing)
        try:
            if _is_dp_shard(header):
                records = await self.hold_flat_shards(header.job, header.version, shards,
                                                      manifest.full_shape_of())
            else:
                records = await self.hold_shards(header.job, header.version, shards)
        finally:
            staging.stored(header.version)
        metrics.PUBLISHES.labels("ok").inc()
        return pb.PublishReply(version=header.version, held_versions=self.held(header.job),
                               evicted_versions=[r.version for r in records])

    def _check_publish(self, header: pb.PublishHeader) -> VersionManifest:
        if not header.job or "/" in header.job:
            raise errors.InvalidArgument(f"job {header.job!r} must be non-empty and contain "
                                         "no '/'")
        if header.version < 0:
            raise errors.InvalidArgument(f"version must be >= 0, got {header.version}")
        latest = self.latest(header.job)
        if latest is not None and header.version <= latest:  # refuse before the bytes arrive
            raise errors.FailedPrecondition(f"version {header.version} of job {header.job} is "
                                            f"not newer than the latest published version "
                                            f"{latest}; versions only move forward")
        try:
            manifest = VersionManifest.from_dict(json.loads(header.manifest_json))
        except (ValueError, TypeError) as exc:
            raise errors.InvalidArgument(f"publish manifest is not valid: {exc}") from None
        if manifest.version != header.version:
            raise errors.InvalidArgument(f"the manifest is for version {manifest.version} but "
                                         f"the header publishes {header.version}")
        self._check_publish_base(header, manifest)
        full_bytes = sum(math.prod(e.shape) * manifest_dtype(e).itemsize
                         for e in manifest.entries)
        if max(full_bytes, manifest.total_bytes) > self.cfg.memory_budget_bytes:
            raise errors.ResourceExhausted(f"version {header.version} is {full_bytes} bytes, "
                                           "over this agent's memory_budget_bytes "
                                           f"{self.cfg.memory_budget_bytes}")
        if _is_dp_shard(header) and (header.tp_size > 1 or header.tp_rank):
            raise errors.InvalidArgument(f"version {header.version} is published as DP shards "
                                         f"and TP shards (tp_size {header.tp_size}) at once; "
                                         "publish one layout (TP within DP is not supported)")
        if not _is_shard(header) and (manifest.tp_size > 1 or manifest.tp_rank):
            raise errors.InvalidArgument(f"the header publishes version {header.version} as a "
                                         f"whole model (tp_size {header.tp_size}) but its "
                                         f"manifest is TP rank {manifest.tp_rank} of "
                                         f"{manifest.tp_size}; a shard's header states its "
                                         "tp_rank and tp_size")
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
        if _is_shard(header) and not _is_dp_shard(header):
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
        if _is_dp_shard(header):
            return self._admit_dp_shard(header, manifest)
        if (manifest.tp_rank, manifest.tp_size) != (header.tp_rank, header.tp_size):
            raise errors.InvalidArgument(f"the header says TP rank {header.tp_rank} of "
                                         f"{header.tp_size} but the manifest says "
                                         f"{manifest.tp_rank} of {manifest.tp_size}")
        signature = {e.name: (e.dtype, e.shape) for e in manifest.entries}
        try:
            for entry in manifest.entries:  # every tensor needs a TP rule to be re-sliced
                sharding.full_shape(entry.name, entry.shape, max(header.tp_size, 1))
            admission = self._job(header.job).staging.admit(
                header.version, header.tp_rank, header.tp_size, signature, manifest.total_bytes,
                manifest.run)
        except ShardingError as exc:
            raise errors.InvalidArgument(f"TP shard of version {header.version}: {exc}") from None
        if admission.dropped:
            log.warning("job %s: dropped the staged TP shards of versions %s for rank %d of "
                        "version %d: their missing ranks moved on, a newer run replaced them, "
                        "or the staging budget needed their bytes", header.job,
                        list(admission.dropped), header.tp_rank, header.version)
        return admission

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
            admission = self._job(header.job).staging.admit(
                header.version, header.dp_rank, header.dp_size, signature, decoded,
                manifest.run, layout="dp")
        except flat_shards.FlatShardError as exc:
            raise errors.InvalidArgument(f"DP shard of version {header.version}: {exc}") from None
        if admission.dropped:
            log.warning("job %s: dropped the staged DP shards of versions %s for rank %d of "
                        "version %d", header.job, list(admission.dropped), header.dp_rank,
                        header.version)
        return admission

    async def PlanPull(self, request: pb.PullRequest, context) -> pb.PullPlan:
        try:
            packed = await self._packed_pull(request)
        except errors.ServiceError as exc:
            await self._refuse(context, "PlanPull", exc)
        if self.data_endpoint:  # where the bytes are served; a proto field would need a new
            context.set_trailing_metadata(((DATA_ENDPOINT_METADATA, self.data_endpoint),))
        return self._with_inline_buckets(request, packed)

    def _with_inline_buckets(self, request: pb.PullRequest, packed: _Packed) -> pb.PullPlan:
        """The plan, with its buckets when they are small enough to ride along: a sparse delta
        then costs one round trip instead of a plan, a connection and range fetches. Never
        under a throttle (inline bytes would bypass it) or the chunk-corrupting test hook."""
        throttles, link = self.send_path(request)
        if (not packed.buckets or packed.plan.payload_bytes > request.inline_max_bytes
                or throttles or self._corrupt_left > 0):
            return packed.plan
        plan = pb.PullPlan()
        plan.CopyFrom(packed.plan)
        plan.inline_buckets.extend(packed.buckets)
        metrics.BYTES_OUT.labels(link).inc(plan.payload_bytes)
        return plan

    async def PullBuckets(self, request: pb.BucketsRequest, context) -> AsyncIterator[pb.BucketChunk]:
        try:
            packed = await self.planned_buckets(request.pull, request.plan_id, request.buckets)
        except errors.ServiceError as exc:
            await self._refuse(context, "PullBuckets", exc)
        throttles, link = self.send_path(request.pull)
        started = time.perf_counter()
        async for chunk in stream_buckets(packed.buckets, list(request.buckets),
                                          self.cfg.chunk_bytes, throttles, self.damage):
            yield chunk
            metrics.BYTES_OUT.labels(link).inc(len(chunk.data))
        metrics.BUCKET_SECONDS.observe(time.perf_counter() - started)

    # ---- serving bucket bytes (gRPC above, HTTP in http_data.py) ------------------------------

    async def planned_buckets(self, pull: pb.PullRequest, plan_id: int,
                              indices: Sequence[int]) -> _Packed:
        """The packed pull that ``PlanPull`` answered for ``pull``, checked against the plan id
        the client quotes and the bucket indices it asks for; a ServiceError otherwise."""
        packed = await self._packed_pull(pull, count=False)
        if plan_id and plan_id != packed.plan.plan_id:
            raise errors.Aborted("the pull's plan changed since PlanPull (a base version was "
                                 "evicted); plan the pull again")
        n = len(packed.buckets)
        bad = [i for i in indices if not 0 <= i < n]
        if bad or not indices:
            raise errors.OutOfRange(f"bucket indices {bad or '[]'} are not in this plan's "
                                    f"0..{n - 1}; ask for indices of the manifest PlanPull "
                                    "returned")
        return packed

    def send_path(self, pull: pb.PullRequest) -> tuple[list[TokenBucket], str]:
        """Throttles every chunk of this pull is charged to, and its link label."""
        cross = bool(pull.requester_cluster) and pull.requester_cluster != self.cfg.cluster
        throttles = [t for t in (self._send_throttle, self._link_throttle if cross else None) if t]
        return throttles, "cross" if cross else "local"

    async def GetStatus(self, request: pb.StatusRequest, context) -> pb.AgentStatus:
        return pb.AgentStatus(
            agent_id=self.cfg.agent_id, node=self.cfg.node, cluster=self.cfg.cluster,
            jobs=[pb.JobVersions(job=job, held_versions=self.held(job),
                                 latest=self.latest(job) or 0,
                                 held_bytes=self._jobs[job].store.held_bytes)
                  for job in self.jobs()])

    # ---- pulls ----------------------------------------------------------------------------------

    async def _packed_pull(self, request: pb.PullRequest, count: bool = True) -> _Packed:
        """Every pull enters here: PlanPull, PullBuckets and the HTTP data path."""
        entry = self._touched(request.job)
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
        key = (request.job, version, holding, request.tp_rank, tp_size, names)
        packed = self._packed.get(key)
        if packed is not None:
            self._packed.move_to_end(key)
        else:
            # N parallel range requests after an eviction: pack once. The pack is a task of
            # its own, which no request owns: the request that started it may be cancelled
            # (its client left) while others wait, and the store thread finishes the work
            # anyway, so the pack completes for them and for the cache.
            packing = self._packing.get(key)
            if packing is None:
                packing = self._packing[key] = asyncio.create_task(
                    self._pack_now(entry.store, key), name=f"pack {key[:3]}")
                packing.add_done_callback(partial(self._pack_finished, key))
            packed = await asyncio.shield(packing)
        if count:
            plan = packed.plan
            kind = "delta" if plan.delta_tensors else ("noop" if not plan.dense_bytes else "dense")
            metrics.PULLS.labels(kind).inc()
            if plan.delta_tensors:
                metrics.DELTA_RATIO.set(plan.payload_bytes / max(plan.dense_bytes, 1))
        return packed

    def _pack_finished(self, key: tuple, packing: asyncio.Task[_Packed]) -> None:
        """The pack of ``key`` ended: packed (and cached), failed or cancelled (the loop
        closing); the next request for ``key`` finds it cached or packs again."""
        del self._packing[key]
        if not packing.cancelled():
            packing.exception()  # retrieved: no "never retrieved" warning when nobody waits

    async def _pack_now(self, store: VersionStore, key: tuple) -> _Packed:
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        self._claim(key[0])  # a job dropped mid-pack would see its packed pull cached again
        try:
            packed = await loop.run_in_executor(self._store_thread, self._pack, store, key)
        finally:
            self._release(key[0])
        metrics.PLAN_SECONDS.observe(time.perf_counter() - started)
        self._packed[key] = packed
        while len(self._packed) > _PACKED_CACHE_ENTRIES:
            self._packed.popitem(last=False)
        return packed

    def _pack(self, store: VersionStore, key: tuple) -> _Packed:
        _, version, holding, tp_rank, tp_size, names = key
        plan = store.plan(version, holding=holding, tp_rank=tp_rank, tp_size=tp_size,
                          names=names or None, parallel_map=self._codec_pool.map)
        manifest, buckets = pack(plan.version, plan.base_version, list(plan.tensors),
                                 self.cfg.bucket_bytes, tp_rank=tp_rank, tp_size=tp_size,
                                 parallel_map=self._codec_pool.map)
        manifest_json = json.dumps(manifest.to_dict())
        deltas = sum(1 for _, item in plan.tensors if item.needs_base)
        return _Packed(pb.PullPlan(manifest_json=manifest_json, version=plan.version,
                                   note=plan.note, payload_bytes=plan.payload_bytes,
                                   dense_bytes=plan.dense_bytes, delta_tensors=deltas,
                                   plan_id=manifest_id(manifest_json)), buckets)

    def damage(self) -> bool:
        """The fault_corrupt_chunks test hook: True while chunks are still to be corrupted."""
        if self._corrupt_left <= 0:
            return False
        self._corrupt_left -= 1
        metrics.CORRUPTED.inc()
        log.warning("fault_corrupt_chunks: corrupting a chunk on purpose (%d more)",
                    self._corrupt_left)
        return True

    async def _refuse(self, context: grpc.aio.ServicerContext, rpc_name: str,
                      refused: errors.ServiceError) -> NoReturn:
        self.note_refusal(rpc_name, refused)
        await errors.abort(context, refused)

    def note_refusal(self, rpc_name: str, refused: errors.ServiceError) -> None:
        metrics.REFUSED.labels(rpc_name, refused.code.name).inc()
        if rpc_name == "Publish":
            metrics.PUBLISHES.labels("refused").inc()
        log.info("%s refused (%s): %s", rpc_name, refused.code.name, refused)

    def close(self) -> None:
        self._store_thread.shutdown(wait=False, cancel_futures=True)
        self._codec_pool.shutdown(wait=False, cancel_futures=True)


def _is_shard(header: pb.PublishHeader) -> bool:
    """tp/dp_size 0 or 1 and rank 0 publish a whole model; anything else claims to be a shard."""
    return header.tp_size > 1 or header.tp_rank != 0 or _is_dp_shard(header)


def _is_dp_shard(header: pb.PublishHeader) -> bool:
    return header.dp_size > 1 or header.dp_rank != 0


def _shard_label(header: pb.PublishHeader) -> str:
    return "DP" if _is_dp_shard(header) else "TP"


# A refused publish is read to its end (within these bounds) before the refusal goes out.
_DRAIN_LIMIT_BYTES = 64 << 20
_DRAIN_TIMEOUT_S = 5.0


async def _drain(request_iterator: AsyncIterator[pb.PublishChunk]) -> None:
    """Read and drop what is left of a refused publish stream. grpc's asyncio client, still
    writing when a client-streaming RPC's status arrives, reports INTERNAL "Internal error from
    Core" instead of that status (grpc/grpc#36066; CI saw it on a two-message publish), so the
    publisher would lose the reason. Reading the rest lets the status through; the bounds keep
    a refused multi-gigabyte publish from being read in full (its client may then see INTERNAL;
    it retries or gives up either way)."""
    async def read_rest() -> None:
        seen = 0
        async for message in request_iterator:
            seen += message.ByteSize()
            if seen > _DRAIN_LIMIT_BYTES:
                return

    try:
        await asyncio.wait_for(read_rest(), _DRAIN_TIMEOUT_S)
    except (asyncio.TimeoutError, grpc.RpcError):
        return  # the stream broke or takes too long: refuse as it is
