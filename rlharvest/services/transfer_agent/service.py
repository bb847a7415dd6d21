"""The transfer agent's servicer: moves publish streams, pull plans and bucket bytes between gRPC
(and the HTTP data path) and the core (core.py), which decides what is held, admitted and
refused. Store work (publish, plan, encode) runs on one thread, in order — the store is not
thread-safe — so the event loop keeps streaming other pulls meanwhile; streaming itself never
touches the store, so a slow pull never holds up a publish."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import NoReturn, TypeVar

import grpc
import torch

from rlharvest.common import errors, server_guard
from rlharvest.common.etcd_outage import etcd_away
from rlharvest.common.pb import transfer_agent_pb2 as pb, transfer_agent_pb2_grpc
from rlharvest.services.transfer_agent import flat_shards, metrics
from rlharvest.services.transfer_agent.apply import apply_pull
from rlharvest.services.transfer_agent.bucketing import ManifestError, VersionManifest, unpack
from rlharvest.services.transfer_agent.checksum import ChecksumMismatchError, tensor_checksum
from rlharvest.services.transfer_agent.config import AgentConfig
from rlharvest.services.transfer_agent.core import (
    AgentCore,
    DroppedJob,
    PackedPull,
    PublishAdmission,
    PullKey,
    check_planned,
    delta_base,
    is_dp_shard,
    is_shard,
    pack_pull,
    pull_kind,
    rides_inline,
    shard_label,
)
from rlharvest.services.transfer_agent.data_path import BucketAssembler, stream_buckets
from rlharvest.services.transfer_agent.delta_codec import (
    DeltaCodecError,
    EncodedTensor,
    Encoding,
    encoded_tensor,
)
from rlharvest.services.transfer_agent.protocol import DATA_ENDPOINT_METADATA
from rlharvest.services.transfer_agent.shard_staging import Admission
from rlharvest.services.transfer_agent.throttle import TokenBucket
from rlharvest.services.transfer_agent.version_store import EvictionRecord, VersionStore

log = logging.getLogger(__name__)

# The idle-job check runs this often at most: a dropped job outlives job_idle_s by up to this.
_IDLE_CHECK_MAX_S = 60.0
T = TypeVar("T")

# A publish's decoded tensors, and the sparse encodings (by name) it arrived in.
_Decoded = tuple[dict[str, torch.Tensor], dict[str, EncodedTensor]]

# Hooks the shell calls after a version lands (announce + holder record in etcd) and after an
# idle job was dropped (its holder record deleted).
OnHeld = Callable[[str, int, list[EvictionRecord]], Awaitable[None]]
OnDropped = Callable[[str], Awaitable[None]]


class AgentService(transfer_agent_pb2_grpc.TransferAgentServicer):
    def __init__(self, cfg: AgentConfig, on_held: OnHeld | None = None,
                 on_dropped: OnDropped | None = None, core: AgentCore | None = None) -> None:
        self.cfg = cfg
        self.core = core or AgentCore(cfg)
        self._on_held = on_held
        self._on_dropped = on_dropped
        self._store_thread = ThreadPoolExecutor(1, thread_name_prefix="store")
        # Encoders and bucket checksums run side by side here (numpy and zlib release the GIL);
        # only the store thread submits to it, so store state stays single-threaded.
        self._codec_pool = ThreadPoolExecutor(cfg.codec_threads, thread_name_prefix="codec")
        # One pack per key, however many ask.
        self._packing: dict[PullKey, asyncio.Task[PackedPull]] = {}
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
        return self.core.held(job)

    def latest(self, job: str) -> int | None:
        return self.core.latest(job)

    async def full_tensors(self, job: str, version: int) -> dict[str, torch.Tensor] | None:
        """A held version's whole tensors (a relay's delta base); None when it is not held.
        Runs on the store thread: a version published as TP shards is gathered (a copy)."""
        entry = self.core.touched(job)
        if entry is None:
            return None
        store = entry.store

        def whole() -> dict[str, torch.Tensor] | None:  # checked here: a publish may evict it
            return store.full_tensors(version) if version in store.held_versions else None

        return await self._in_store(whole)

    async def sums(self, job: str, version: int) -> dict[str, int]:
        """The linear sums this agent knows for a held version's whole tensors."""
        entry = self.core.touched(job)
        if entry is None:
            return {}
        store = entry.store
        return await self._in_store(lambda: store.sums(version))

    def jobs(self) -> list[str]:
        return self.core.jobs()

    def health(self) -> dict:
        return {"status": "ok", "jobs": {job: list(self.held(job)) for job in self.jobs()}}

    # ---- dropping idle jobs -------------------------------------------------------------------

    def drop_idle(self, now: float) -> None:
        """Drop the jobs the core finds idle at ``now`` (a pull streaming already keeps its
        bytes until it ends); ``forget_dropped`` deletes their holder records."""
        for dropped in self.core.drop_idle(now):
            _note_dropped(dropped)

    async def forget_dropped(self) -> None:
        """Run the on_dropped hook (delete the holder record) for every dropped job not yet
        forgotten; one that raises is tried again at the next call. etcd away (the hook logs
        the outage) ends this round quietly: the next idle check tries again, and the loop
        does not crash and restart for every check of an outage."""
        for job in self.core.unannounced():
            if self._on_dropped is not None:
                try:
                    await self._on_dropped(job)
                except Exception as exc:
                    if not etcd_away(exc):
                        raise
                    return  # the others would fail alike
            self.core.announced(job)

    async def drop_idle_jobs(self) -> None:
        """The agent's background loop (job_idle_s > 0): every job_idle_s / 4, at most every
        60 s, drop the idle jobs and delete their holder records, so a long-running agent's
        memory follows the jobs it serves now, not every job it ever served."""
        period = min(self.cfg.job_idle_s / 4, _IDLE_CHECK_MAX_S)
        while True:
            await asyncio.sleep(period)
            self.drop_idle(self.core.clock())
            await self.forget_dropped()

    # ---- holding versions -------------------------------------------------------------------

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
        self.core.claim(job)
        try:
            store = self.core.job(job).store
            records = await self._in_store(lambda: store.publish(
                version, tensors, now=time.time(), copy=False, checksums=checksums, sums=sums,
                deltas=deltas))
            return await self._now_held(job, version, records, source)
        finally:
            self.core.release(job)

    async def hold_shards(self, job: str, version: int,
                          shards: list[dict[str, torch.Tensor]]) -> list[EvictionRecord]:
        """Store a version a training side published as TP shards (shards[r]: rank r's)."""
        store = self.core.job(job).store
        records = await self._in_store(lambda: store.publish_shards(
            version, shards, now=time.time(), copy=False))
        return await self._now_held(job, version, records, f"{len(shards)} TP shards")

    async def hold_flat_shards(self, job: str, version: int, shards: list[dict[str, torch.Tensor]],
                               full_shapes: Mapping[str, tuple[int, ...]]) -> list[EvictionRecord]:
        """Store a version a training side published as flat DP shards: joined on the store
        thread (one copy), then held like a whole publish."""
        store = self.core.job(job).store

        def join_and_store() -> list[EvictionRecord]:
            tensors = {name: flat_shards.join_flat(name, [r[name] for r in shards], shape)
                       for name, shape in full_shapes.items()}
            return store.publish(version, tensors, now=time.time(), copy=False)

        records = await self._in_store(join_and_store)
        return await self._now_held(job, version, records, f"{len(shards)} DP shards")

    async def _now_held(self, job: str, version: int, records: list[EvictionRecord],
                        source: str) -> list[EvictionRecord]:
        for record in records:
            metrics.EVICTIONS.labels(record.reason).inc()
            log.warning("job %s: evicted version %d (%d bytes, %s) to hold version %d", job,
                        record.version, record.freed_bytes, record.reason, version)
        for stale in self.core.now_held(job, version, records):
            log.warning("job %s: dropped the shards of version %d: its other ranks never "
                        "published and version %d is held now", job, stale, version)
        held = self.held(job)
        metrics.VERSIONS_HELD.labels(job).set(len(held))
        metrics.HELD_BYTES.labels(job).set(self.core.held_bytes(job))
        metrics.LATEST.labels(job).set(version)
        log.info("job %s: holding version %d from %s (held %s)", job, version, source,
                 list(held))
        if self._on_held is not None:
            await self._on_held(job, version, records)
        return records

    # ---- publishes ----------------------------------------------------------------------------

    async def Publish(self, request_iterator: AsyncIterator[pb.PublishChunk],
                      context: grpc.aio.ServicerContext) -> pb.PublishReply:
        claimed: str | None = None  # the job, claimed by _receive_publish once it returned
        try:
            header, admitted, (tensors, encodings) = await self._receive_publish(
                request_iterator, context)
            claimed = header.job
            if admitted.shard is not None:
                return await self._publish_shard(header, admitted.manifest, admitted.shard,
                                                 tensors)
            records = await self._hold_published(header, admitted.manifest, tensors, encodings)
        except errors.ServiceError as exc:
            await _drain(request_iterator)
            await self._refuse(context, "Publish", exc)
        finally:
            if claimed is not None:
                self.core.release(claimed)
        metrics.PUBLISHES.labels("ok").inc()
        return pb.PublishReply(version=header.version, held_versions=self.held(header.job),
                               evicted_versions=[r.version for r in records])

    async def _receive_publish(self, request_iterator: AsyncIterator[pb.PublishChunk],
                               context: grpc.aio.ServicerContext
                               ) -> tuple[pb.PublishHeader, PublishAdmission, _Decoded]:
        """The header, admission (with the staging place of a shard) and decoded tensors (with
        the encodings of a delta publish) of one publish stream, the job claimed (the caller
        releases it) from its header on, so no idle check drops it while the bytes arrive. A
        shard admitted to the staging is taken back out if its stream fails, so its rank may
        publish again."""
        header: pb.PublishHeader | None = None
        assembler: BucketAssembler | None = None
        admitted: PublishAdmission | None = None
        try:
            async for message in request_iterator:
                if header is None:
                    header = message.header if message.HasField("header") else None
                    if header is None:
                        raise errors.InvalidArgument("a publish stream starts with a header "
                                                     "(job, version, manifest)")
                    self.core.claim(header.job)
                    await server_guard.require_job(context, header.job)  # its trainer only
                    admitted = self.core.admit_publish(header)
                    _note_staging_drops(header, admitted.shard)
                    assembler = BucketAssembler(admitted.manifest)
                    continue
                _add_chunk(message, assembler)
            if header is None or assembler is None or admitted is None:
                raise errors.InvalidArgument("empty publish stream")
            return header, admitted, await self._decode_publish(header, assembler)
        except BaseException:
            if header is not None:
                if admitted is not None and admitted.shard is not None:
                    self.core.abandon(header.job, admitted.shard)
                self.core.release(header.job)
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
            store = self.core.job(header.job).store
            base, base_sums = await self._in_store(partial(delta_base, store, header,
                                                           base_version))
        loop = asyncio.get_running_loop()
        try:  # bytes that do not fit the (valid) manifest
            tensors = await loop.run_in_executor(None, partial(
                apply_pull, manifest, assembler.buffers, base, manifest.base_version,
                parallel_map=self._codec_pool.map, held_sums=base_sums))
            if is_shard(header):  # staged and joined as tensors: no encodings to serve as is
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
        # Refused if the version was dropped while the shard decoded.
        shards = self.core.add_shard(header.job, admission, tensors)
        if shards is None:
            missing = self.core.shards_missing(header.job, header.version)
            log.info("job %s: staged %s rank %d of version %d; waiting for ranks %s",
                     header.job, shard_label(header), admission.tp_rank, header.version,
                     missing)
            metrics.PUBLISHES.labels("staged").inc()
            return pb.PublishReply(version=header.version, held_versions=self.held(header.job),
                                   shards_missing=missing)
        try:
            if is_dp_shard(header):
                records = await self.hold_flat_shards(header.job, header.version, shards,
                                                      manifest.full_shape_of())
            else:
                records = await self.hold_shards(header.job, header.version, shards)
        finally:
            self.core.shards_stored(header.job, header.version)
        metrics.PUBLISHES.labels("ok").inc()
        return pb.PublishReply(version=header.version, held_versions=self.held(header.job),
                               evicted_versions=[r.version for r in records])

    # ---- pulls ----------------------------------------------------------------------------------

    async def PlanPull(self, request: pb.PullRequest, context) -> pb.PullPlan:
        try:
            packed = await self._packed_pull(request)
        except errors.ServiceError as exc:
            await self._refuse(context, "PlanPull", exc)
        if self.data_endpoint:  # where the bytes are served
            context.set_trailing_metadata(((DATA_ENDPOINT_METADATA, self.data_endpoint),))
        return self._with_inline_buckets(request, packed)

    def _with_inline_buckets(self, request: pb.PullRequest, packed: PackedPull) -> pb.PullPlan:
        """The plan, with its buckets when the core says they ride along."""
        throttles, link = self.send_path(request)
        if not rides_inline(packed, request.inline_max_bytes, bool(throttles),
                            self._corrupt_left > 0):
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
                              indices: Sequence[int]) -> PackedPull:
        """The packed pull that ``PlanPull`` answered for ``pull``, checked against the plan id
        the client quotes and the bucket indices it asks for; a ServiceError otherwise."""
        packed = await self._packed_pull(pull, count=False)
        check_planned(packed, plan_id, indices)
        return packed

    def send_path(self, pull: pb.PullRequest) -> tuple[list[TokenBucket], str]:
        """Throttles every chunk of this pull is charged to, and its link label."""
        cross = self.core.is_cross_cluster(pull)
        throttles = [t for t in (self._send_throttle, self._link_throttle if cross else None) if t]
        return throttles, "cross" if cross else "local"

    async def GetStatus(self, request: pb.StatusRequest, context) -> pb.AgentStatus:
        return pb.AgentStatus(
            agent_id=self.cfg.agent_id, node=self.cfg.node, cluster=self.cfg.cluster,
            jobs=[pb.JobVersions(job=job, held_versions=self.held(job),
                                 latest=self.latest(job) or 0,
                                 held_bytes=self.core.held_bytes(job))
                  for job in self.jobs()])

    async def _packed_pull(self, request: pb.PullRequest, count: bool = True) -> PackedPull:
        """Every pull enters here: PlanPull, PullBuckets and the HTTP data path."""
        key, store = self.core.admit_pull(request)
        packed = self.core.packed(key)
        if packed is None:
            # N parallel range requests after an eviction: pack once. The pack is a task of
            # its own, which no request owns: the request that started it may be cancelled
            # (its client left) while others wait, and the store thread finishes the work
            # anyway, so the pack completes for them and for the cache.
            packing = self._packing.get(key)
            if packing is None:
                packing = self._packing[key] = asyncio.create_task(
                    self._pack_now(store, key), name=f"pack {key[:3]}")
                packing.add_done_callback(partial(self._pack_finished, key))
            packed = await asyncio.shield(packing)
        if count:
            _count_pull(packed.plan)
        return packed

    def _pack_finished(self, key: PullKey, packing: asyncio.Task[PackedPull]) -> None:
        """The pack of ``key`` ended: packed (and cached), failed or cancelled (the loop
        closing); the next request for ``key`` finds it cached or packs again."""
        del self._packing[key]
        if not packing.cancelled():
            packing.exception()  # retrieved: no "never retrieved" warning when nobody waits

    async def _pack_now(self, store: VersionStore, key: PullKey) -> PackedPull:
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        self.core.claim(key[0])  # a job dropped mid-pack would see its packed pull cached again
        try:
            packed = await loop.run_in_executor(self._store_thread, self._pack, store, key)
        finally:
            self.core.release(key[0])
        metrics.PLAN_SECONDS.observe(time.perf_counter() - started)
        self.core.remember(key, packed)
        return packed

    def _pack(self, store: VersionStore, key: PullKey) -> PackedPull:
        return pack_pull(store, key, self.cfg.bucket_bytes, self._codec_pool.map)

    def damage(self) -> bool:
        """The fault_corrupt_chunks test hook: True while chunks are still to be corrupted."""
        if self._corrupt_left <= 0:
            return False
        self._corrupt_left -= 1
        metrics.CORRUPTED.inc()
        log.warning("fault_corrupt_chunks: corrupting a chunk on purpose (%d more)",
                    self._corrupt_left)
        return True

    # ---- refusals -----------------------------------------------------------------------------

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


def _add_chunk(message: pb.PublishChunk, assembler: BucketAssembler | None) -> None:
    """One bucket chunk of a publish stream, after its header."""
    if not message.HasField("chunk") or assembler is None:
        raise errors.InvalidArgument("a second header in one publish stream; publish one "
                                     "version per stream")
    try:
        assembler.add(message.chunk)
    except ValueError as exc:
        raise errors.InvalidArgument(str(exc)) from None
    metrics.BYTES_IN.labels("publish").inc(len(message.chunk.data))


def _note_staging_drops(header: pb.PublishHeader, admission: Admission | None) -> None:
    """Log the staged versions that made way for an admitted shard."""
    if admission is None or not admission.dropped:
        return
    if is_dp_shard(header):
        log.warning("job %s: dropped the staged DP shards of versions %s for rank %d of "
                    "version %d", header.job, list(admission.dropped), header.dp_rank,
                    header.version)
    else:
        log.warning("job %s: dropped the staged TP shards of versions %s for rank %d of "
                    "version %d: their missing ranks moved on, a newer run replaced them, "
                    "or the staging budget needed their bytes", header.job,
                    list(admission.dropped), header.tp_rank, header.version)


def _note_dropped(dropped: DroppedJob) -> None:
    for gauge in (metrics.VERSIONS_HELD, metrics.HELD_BYTES, metrics.LATEST):
        gauge.remove(dropped.job)
    metrics.JOBS_DROPPED.inc()
    log.info("job %s: dropped after %.0fs with no publish, relay or pull (freed %d bytes of "
             "versions %s); a new publish starts it afresh", dropped.job, dropped.idle_s,
             dropped.freed_bytes, list(dropped.versions))


def _count_pull(plan: pb.PullPlan) -> None:
    metrics.PULLS.labels(pull_kind(plan)).inc()
    if plan.delta_tensors:
        metrics.DELTA_RATIO.set(plan.payload_bytes / max(plan.dense_bytes, 1))


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
