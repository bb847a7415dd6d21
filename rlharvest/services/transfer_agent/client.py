"""Client side of a transfer agent: what trainers (publish), rollout workers and other agents
(pull) call. Every call opens its own channel, so it can be used from any event loop."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import grpc
import torch

from rlharvest.common import keys, registry, rpc
from rlharvest.common.pb import transfer_agent_pb2 as pb, transfer_agent_pb2_grpc
from rlharvest.services.transfer_agent.apply import apply_pull
from rlharvest.services.transfer_agent.bucketing import ParallelMap, VersionManifest, pack
from rlharvest.services.transfer_agent.checksum import bytes_checksum, tensor_linear_sum
from rlharvest.services.transfer_agent.data_path import BucketAssembler, chunk_buckets
from rlharvest.services.transfer_agent.delta_codec import EncodedTensor, Encoding, encode_dense
from rlharvest.services.transfer_agent.delta_publish import DeltaStats, LastPublished
from rlharvest.services.transfer_agent.http_data import (
    DEFAULT_READ_TIMEOUT_S,
    DataPathError,
    RangeFetcher,
)
from rlharvest.services.transfer_agent.protocol import (
    AGENT_ROLE,
    DATA_ENDPOINT_METADATA,
    SERVICE_NAME,
)

log = logging.getLogger(__name__)

PUBLISH_CHUNK_BYTES = 16 << 20
MAX_MESSAGE_BYTES = 64 << 20
# Plans up to this size come with their buckets (one round trip): a sparse delta of a 1 GB
# model at 99% zeros is ~20 MB; dense pulls stay on the parallel range streams.
DEFAULT_INLINE_MAX_BYTES = 16 << 20


class PublishError(ValueError):
    """The agent refused a publish; the message is the agent's (e.g. an older version)."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.code = code


class PullError(RuntimeError):
    """A pull that could not complete from this agent; try another holder. ``code`` is the gRPC
    code name of the cause (UNAVAILABLE: the agent went away; DATA_LOSS: bytes stayed damaged;
    ABORTED: the plan changed under the pull — plan again)."""

    def __init__(self, message: str, code: str = "UNKNOWN") -> None:
        super().__init__(message)
        self.code = code


class DeltaApplyError(PullError):
    """The pull carried sparse deltas and they did not decode against the held tensors (a
    failed verification: damaged at the sender, or the held copy is not the base they name);
    the held tensors are as they were. Another holder's deltas may apply; a pull without
    ``held`` (dense) does not depend on them."""


def may_serve_dense(error: BaseException) -> bool:
    """Whether a holder whose delta pull failed with ``error`` is worth asking for the version
    dense: its deltas did not verify against the held copy (DeltaApplyError: a dense pull needs
    no base), or the plan changed under the pull (ABORTED: the base it named was evicted; plan
    again). Not a holder that is unreachable or went away (UNAVAILABLE), does not hold the
    version (NOT_FOUND), refused the pull otherwise, or whose plan or bytes stayed damaged
    (DATA_LOSS): a dense pull would end the same way, after the time it takes."""
    if isinstance(error, DeltaApplyError):
        return True
    if isinstance(error, grpc.aio.AioRpcError):
        return error.code() == grpc.StatusCode.ABORTED
    return isinstance(error, PullError) and error.code == "ABORTED"


def agent_channel(endpoint: str) -> grpc.aio.Channel:
    """A channel to a weight holder (a puller's, a relay's, a trainer's publish): under TLS the
    server must hold an agent's certificate, whatever etcd said the endpoint is."""
    return rpc.channel(endpoint, [SERVICE_NAME], max_message_bytes=MAX_MESSAGE_BYTES,
                       peer_role=AGENT_ROLE)


async def publish(endpoint: str, job: str, version: int, tensors: Mapping[str, torch.Tensor],
                  *, bucket_bytes: int = 64 << 20, tp_rank: int = 0, tp_size: int = 1,
                  run: int = 0, dp_rank: int = 0, dp_size: int = 1,
                  full_shapes: Mapping[str, Sequence[int]] | None = None) -> pb.PublishReply:
    """Hand version ``version`` of ``job`` to the agent at ``endpoint``. Returns once the agent
    holds it (it announces the version in etcd itself); raises PublishError with the agent's
    message when it refuses (an older version, a shape change, a version over its budget).

    With ``tp_size`` > 1, ``tensors`` is training rank ``tp_rank``'s TP shard of every tensor and
    the call returns once the agent has staged it: the reply's ``shards_missing`` lists the ranks
    still to come (empty: this shard completed the version, which the agent now holds). Every
    rank publishes to the same agent, which never gathers the shards (ROSE §4.2). ``run``: a
    number every rank of one trainer run states alike and a restarted trainer raises (e.g. rank
    0's start time, broadcast); the agent then drops what the dead run staged of a version
    instead of completing it with the new run's shards. A rank publishing a version again
    replaces the shard it staged.

    With ``dp_size`` > 1, ``tensors`` is ZeRO/DP rank ``dp_rank``'s flat slice of every tensor
    (``flat_shards.py``) and ``full_shapes`` the whole tensors' shapes; the agent joins the
    slices once every rank has published, with the same replies and ``run`` rule as TP shards."""
    shapes = _dp_full_shapes(tensors, dp_size, full_shapes)
    loop = asyncio.get_running_loop()
    manifest, buckets = await loop.run_in_executor(
        None, partial(_pack_dense, version, tensors, bucket_bytes, tp_rank, tp_size, run))
    manifest = replace(manifest, full_shapes=shapes)
    header = pb.PublishHeader(job=job, version=version, tp_rank=tp_rank, tp_size=tp_size,
                              dp_rank=dp_rank, dp_size=dp_size if dp_size > 1 else 0,
                              manifest_json=json.dumps(manifest.to_dict()))
    return await _send_publish(endpoint, header, buckets)


def _dp_full_shapes(names: Mapping[str, Any], dp_size: int,
                    full_shapes: Mapping[str, Sequence[int]] | None
                    ) -> tuple[tuple[int, ...], ...]:
    """The whole tensors' shapes a flat DP shard's manifest carries, in ``names``' order (none
    for a whole version or a TP shard)."""
    if dp_size <= 1:
        return ()
    if full_shapes is None:
        raise ValueError("a flat DP shard needs full_shapes: the agent cannot infer them")
    return tuple(tuple(full_shapes[name]) for name in names)


async def publish_delta(endpoint: str, job: str, version: int, base_version: int,
                        encoded: Mapping[str, EncodedTensor], *,
                        bucket_bytes: int = 64 << 20, run: int = 0, dp_rank: int = 0,
                        dp_size: int = 1,
                        full_shapes: Mapping[str, Sequence[int]] | None = None
                        ) -> pb.PublishReply:
    """Hand version ``version`` to the agent as ``encoded`` (every tensor, each a sparse delta
    against ``base_version`` or dense; see ``DeltaPublisher``). The agent applies the deltas to
    its copy of the base and serves them as they are to workers holding it. Raises PublishError
    FAILED_PRECONDITION when the agent does not hold ``base_version``: publish dense then.

    With ``dp_size`` > 1, ``encoded`` is ZeRO/DP rank ``dp_rank``'s flat slice of every tensor,
    each a delta against that rank's slice of ``base_version`` or dense, and the reply, ``run``
    and ``full_shapes`` are as in ``publish``: the agent applies the deltas to its slices of the
    base, then stages and joins the slices like dense ones."""
    shapes = _dp_full_shapes(encoded, dp_size, full_shapes)
    base = base_version if any(item.needs_base for item in encoded.values()) else None
    manifest, buckets = await asyncio.get_running_loop().run_in_executor(
        None, partial(pack, version, base, list(encoded.items()), bucket_bytes))
    manifest = replace(manifest, run=run, full_shapes=shapes)
    header = pb.PublishHeader(job=job, version=version, dp_rank=dp_rank,
                              dp_size=dp_size if dp_size > 1 else 0,
                              manifest_json=json.dumps(manifest.to_dict()))
    return await _send_publish(endpoint, header, buckets)

Offload = Callable[[Callable[[], Any]], Awaitable[Any]]


async def _inline(work: Callable[[], Any]) -> Any:
    return work()


class DeltaPublisher:
    """Publishes each version as what changed since the last one it published to the same
    agent (its ``LastPublished``): the trainer's whole-model publisher keeps one, and so does
    each rank publishing its shard. The first version, one to another agent, one not newer than
    the record (published again) and one whose base the agent refuses (it no longer holds that
    version: FAILED_PRECONDITION) go dense, with their sums. ``offload`` runs the encode and the
    record's advance (whole-model passes) where the caller wants them: off its event loop, or
    inline on a thread of its own; ``parallel_map`` encodes tensors side by side."""

    def __init__(self) -> None:
        self._last: tuple[str, LastPublished] | None = None  # (agent, record)

    async def publish(self, endpoint: str, job: str, version: int,
                      tensors: Mapping[str, torch.Tensor], *, offload: Offload = _inline,
                      parallel_map: ParallelMap = map, **publish_args: Any
                      ) -> tuple[pb.PublishReply, DeltaStats]:
        """Publish ``version`` (``publish_args``: ``publish_delta``'s: bucket size, a shard's
        rank, run and shapes); the reply and what it changed."""
        last = self._last[1] if self._last is not None and self._last[0] == endpoint \
            and self._last[1].version < version else None
        try:
            return await self._against(endpoint, job, version, tensors, last, offload,
                                       parallel_map, publish_args)
        except PublishError as exc:
            if last is None or exc.code != grpc.StatusCode.FAILED_PRECONDITION:
                raise
            log.warning("agent %s no longer holds version %d: publishing version %d dense",
                        endpoint, last.version, version)
            return await self._against(endpoint, job, version, tensors, None, offload,
                                       parallel_map, publish_args)

    async def _against(self, endpoint: str, job: str, version: int,
                       tensors: Mapping[str, torch.Tensor], last: LastPublished | None,
                       offload: Offload, parallel_map: ParallelMap, publish_args: dict[str, Any]
                       ) -> tuple[pb.PublishReply, DeltaStats]:
        """Encode against ``last`` (None: all dense, with sums), publish, move the record on."""
        base = last or LastPublished(-1, {})
        encoded, stats = await offload(partial(base.encode_next, tensors, None, parallel_map))
        reply = await publish_delta(endpoint, job, version, base.version, encoded,
                                    **publish_args)
        self._last = None  # ``advance`` moves the record on in place: a failed one is no base
        self._last = (endpoint, await offload(partial(base.advance, version, tensors,
                                                      encoded)))
        return reply, stats


async def _send_publish(endpoint: str, header: pb.PublishHeader,
                        buckets: Sequence[bytes]) -> pb.PublishReply:
    def messages():
        yield pb.PublishChunk(header=header)
        for chunk in chunk_buckets(buckets, PUBLISH_CHUNK_BYTES):
            yield pb.PublishChunk(chunk=chunk)

    async with agent_channel(endpoint) as chan:
        try:
            return await transfer_agent_pb2_grpc.TransferAgentStub(chan).Publish(messages())
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise  # transport trouble, not a refusal: the caller retries or picks another agent
            raise PublishError(exc.details() or exc.code().name, exc.code()) from None


def _pack_dense(version: int, tensors: Mapping[str, torch.Tensor], bucket_bytes: int,
                tp_rank: int = 0, tp_size: int = 1, run: int = 0):
    items = [(name, encode_dense(tensor)) for name, tensor in tensors.items()]
    manifest, buckets = pack(version, None, items, bucket_bytes, tp_rank=tp_rank, tp_size=tp_size)
    return replace(manifest, run=run), buckets


async def find_agent(etcd_client, node: str | None = None) -> str:
    """The endpoint of a live agent (on ``node`` when given); LookupError when there is none."""
    members = await registry.list_members(etcd_client, "transfer_agent")
    found = sorted((info.get("agent_id", key), info) for key, info in members.items()
                   if node is None or info.get("node") == node)
    if not found:
        where = f" on node {node!r}" if node is not None else ""
        raise LookupError(f"no transfer agent{where} is registered in etcd; start "
                          "rlharvest-transfer-agent there")
    return found[0][1]["endpoint"]


async def holders(etcd_client, job: str) -> dict[str, dict]:
    """agent id -> holder record (endpoint, cluster, versions) of every live agent of ``job``."""
    prefix = keys.weights_holder_key(job, "x")[:-1]
    found = await etcd_client.get_prefix(prefix.encode())
    return {kv.key.decode().rsplit("/", 1)[-1]: json.loads(kv.value) for kv in found}


@dataclass
class PullResult:
    version: int
    tensors: dict[str, torch.Tensor]
    note: str
    delta: bool  # some tensors came as sparse deltas against the held version
    payload_bytes: int
    dense_bytes: int
    rejected_buckets: int  # failed their checksum and were pulled again
    seconds: float
    sources: dict[str, int] = field(default_factory=dict)  # agent id -> bytes (scattered pulls)
    # Linear sums of the pulled tensors where the agent knew them (every delta's): hand them
    # back as ``held_sums`` with the next pull, so its deltas verify without a full pass.
    sums: dict[str, int] = field(default_factory=dict)


def pull_request(job: str, version: int = 0, held_version: int | None = None, tp_rank: int = 0,
                 tp_size: int = 1, names: Sequence[str] = (), cluster: str = "",
                 inline_max_bytes: int = 0) -> pb.PullRequest:
    return pb.PullRequest(job=job, version=version, has_holding=held_version is not None,
                          holding=held_version or 0, tp_rank=tp_rank, tp_size=tp_size,
                          names=list(names), requester_cluster=cluster,
                          inline_max_bytes=inline_max_bytes)


async def plan_pull(channel: grpc.aio.Channel,
                    request: pb.PullRequest) -> tuple[pb.PullPlan, str]:
    """The agent's plan for ``request`` and the host:port it serves the plan's bucket bytes on
    over HTTP ("" when it serves them over gRPC only). Raises grpc.aio.AioRpcError when the
    agent refuses the pull or cannot be reached."""
    call = transfer_agent_pb2_grpc.TransferAgentStub(channel).PlanPull(request)
    plan = await call
    trailing = await call.trailing_metadata()
    return plan, (trailing.get(DATA_ENDPOINT_METADATA) if trailing else None) or ""


async def agent_status(endpoint: str) -> pb.AgentStatus:
    """What the agent at ``endpoint`` holds, per job."""
    async with agent_channel(endpoint) as chan:
        return await transfer_agent_pb2_grpc.TransferAgentStub(chan).GetStatus(pb.StatusRequest())


async def pull(endpoint: str, job: str, *, version: int = 0,
               held: Mapping[str, torch.Tensor] | None = None, held_version: int | None = None,
               tp_rank: int = 0, tp_size: int = 1, names: Sequence[str] = (), cluster: str = "",
               streams: int = 4, refetch_attempts: int = 3, decode: bool = True,
               inplace: bool = False, codec_threads: int = 2, transport: str = "auto",
               read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
               held_sums: Mapping[str, int] | None = None,
               inline_max_bytes: int = DEFAULT_INLINE_MAX_BYTES,
               channel: grpc.aio.Channel | None = None) -> PullResult:
    """Pull ``version`` (0: the agent's latest) of ``job`` for TP slice (tp_rank, tp_size):
    sparse deltas against ``held`` (the caller's tensors of ``held_version``) where the agent still
    holds that version, dense otherwise. The plan comes over gRPC; the bytes over the agent's HTTP
    data path (``transport`` "auto": when the agent serves one; "grpc": the PullBuckets stream)
    as byte ranges on up to ``streams`` connections (one silent for ``read_timeout_s`` fails the
    pull with PullError UNAVAILABLE). A bucket failing its checksum is pulled again; every tensor
    is checked against its checksum. Dense tensors decode on ``codec_threads`` threads as soon as
    their buckets are in; deltas once every bucket is.

    ``inplace`` applies deltas into ``held`` (all or nothing: on an error they are taken back
    out); only for a caller that owns those tensors. ``held_sums``: the ``sums`` of the pull
    that brought ``held`` (deltas against a tensor without one re-read it to verify). A plan of
    at most ``inline_max_bytes`` comes with its buckets in the PlanPull reply (0: never).
    ``channel``: an open ``agent_channel(endpoint)`` to reuse (a caller pulling every version
    from one agent saves the connection set-up, a few ms of a sparse pull); else one per pull.
    Raises grpc.aio.AioRpcError for the agent's refusals of the plan and PullError when bytes
    cannot be had, stay damaged or do not decode (DeltaApplyError: deltas that did not apply
    to ``held``)."""
    if transport not in ("auto", "http", "grpc"):
        raise ValueError(f"transport must be auto, http or grpc, got {transport!r}")
    started = time.perf_counter()
    request = pull_request(job, version, held_version, tp_rank, tp_size, names, cluster,
                           inline_max_bytes)
    with ThreadPoolExecutor(codec_threads, thread_name_prefix="pull-codec") as pool:
        async with _borrowed(channel) if channel is not None else agent_channel(endpoint) as chan:
            stub = transfer_agent_pb2_grpc.TransferAgentStub(chan)
            plan, data_endpoint = await plan_pull(chan, request)
            try:
                manifest = VersionManifest.from_dict(json.loads(plan.manifest_json))
            except ValueError as exc:  # ManifestError, JSONDecodeError: try another holder
                raise PullError(f"the agent at {endpoint} sent a malformed plan of version "
                                f"{plan.version}: {exc}", "DATA_LOSS") from exc
            # Pin it, so "latest" does not move under the fetches. A plan of version 0 cannot
            # be pinned (the agent reads 0 as its latest); the plan_id every fetch quotes still
            # turns a move into ABORTED instead of buckets of two versions.
            request.version = plan.version
            if transport == "http" and not data_endpoint:
                raise PullError(f"the agent at {endpoint} serves no HTTP data path "
                                "(http_data_path off); pull with transport='grpc'")
            http = transport != "grpc" and bool(data_endpoint)
            buffers: dict[int, bytearray] = {}
            decoder = PullDecoder(manifest, buffers, held or {}, held_version, inplace, pool,
                                  held_sums) if decode else None
            on_verified = decoder.bucket_verified if decoder else (lambda index: None)
            try:
                inline = await _take_inline(plan, manifest, buffers, pool, on_verified)
                if inline is not None:
                    rejected = inline
                elif http:
                    rejected = await _fetch_http(data_endpoint, request, plan, manifest, buffers,
                                                 streams, refetch_attempts, pool, on_verified,
                                                 read_timeout_s)
                else:
                    rejected = await _fetch_grpc(stub, request, plan, manifest, buffers, streams,
                                                 refetch_attempts, on_verified, endpoint)
            except BaseException:
                if decoder:
                    decoder.abandon()
                raise
        tensors = await decoder.finish() if decoder else {}
    sums = {e.name: e.sum for e in manifest.entries if e.sum is not None} if decoder else {}
    return PullResult(plan.version, tensors, plan.note, plan.delta_tensors > 0, plan.payload_bytes,
                      plan.dense_bytes, rejected, time.perf_counter() - started, sums=sums)


async def _fetch_http(data_endpoint: str, request: pb.PullRequest, plan: pb.PullPlan,
                      manifest: VersionManifest, buffers: dict[int, bytearray], streams: int,
                      refetch_attempts: int, pool: ThreadPoolExecutor,
                      on_verified: Callable[[int], None], read_timeout_s: float) -> int:
    """Byte ranges of every bucket into preallocated ``buffers``; each bucket's CRC runs once,
    on a codec thread, as soon as its last range lands. Returns how many were re-pulled."""
    loop = asyncio.get_running_loop()
    for index, size in enumerate(manifest.bucket_sizes):
        buffers[index] = bytearray(size)
    wanted, rejected = list(buffers), 0
    async with RangeFetcher(data_endpoint, request, plan.plan_id, buffers, streams,
                            read_timeout_s) as fetcher:
        for attempt in range(refetch_attempts + 1):
            checks: list[asyncio.Task] = []

            async def check(index: int) -> int | None:
                actual = await loop.run_in_executor(pool, bytes_checksum, buffers[index])
                if actual != manifest.bucket_checksums[index]:
                    return index
                on_verified(index)
                return None

            try:
                await fetcher.fetch(wanted, lambda i: checks.append(asyncio.create_task(check(i))))
            except DataPathError as exc:
                for task in checks:
                    task.cancel()
                raise PullError(f"version {plan.version} from {data_endpoint}: {exc}",
                                exc.code) from None
            wanted = [i for i in await asyncio.gather(*checks) if i is not None]
            if not wanted:
                return rejected
            rejected += len(wanted)
            log.warning("buckets %s of version %d from %s failed their checksum; pulling them "
                        "again (attempt %d)", wanted, plan.version, data_endpoint, attempt + 1)
    raise PullError(f"buckets {wanted} of version {plan.version} from {data_endpoint} stayed "
                    f"damaged after {refetch_attempts} re-pulls; try another agent", "DATA_LOSS")


@asynccontextmanager
async def _borrowed(channel: grpc.aio.Channel) -> AsyncIterator[grpc.aio.Channel]:
    yield channel  # the caller's: left open


async def _take_inline(plan: pb.PullPlan, manifest: VersionManifest,
                       buffers: dict[int, bytearray], pool: ThreadPoolExecutor,
                       on_verified: Callable[[int], None]) -> int | None:
    """Buckets that came inside the plan, checked like fetched ones. None when there were
    none, or one was damaged: the caller then fetches them all the usual way."""
    if not plan.inline_buckets:
        return None
    if len(plan.inline_buckets) != len(manifest.bucket_sizes):
        raise PullError(f"the plan of version {plan.version} carries "
                        f"{len(plan.inline_buckets)} inline buckets for a manifest of "
                        f"{len(manifest.bucket_sizes)}", "DATA_LOSS")
    loop = asyncio.get_running_loop()
    sums = await asyncio.gather(*(loop.run_in_executor(pool, bytes_checksum, data)
                                  for data in plan.inline_buckets))
    if list(sums) != list(manifest.bucket_checksums):
        log.warning("inline buckets of version %d failed their checksum; fetching them",
                    plan.version)
        return None
    for index, data in enumerate(plan.inline_buckets):
        buffers[index] = bytearray(data)
        on_verified(index)
    return 0


async def _fetch_grpc(stub, request: pb.PullRequest, plan: pb.PullPlan,
                      manifest: VersionManifest, buffers: dict[int, bytearray], streams: int,
                      refetch_attempts: int, on_verified: Callable[[int], None],
                      endpoint: str) -> int:
    """The same over ``streams`` PullBuckets streams, buckets dealt round-robin to them."""
    assembler = BucketAssembler(manifest, buffers)
    wanted, rejected = list(range(len(manifest.bucket_sizes))), 0
    for attempt in range(refetch_attempts + 1):
        groups = [wanted[i::streams] for i in range(min(streams, len(wanted)))]
        bad = await asyncio.gather(*(_fetch(stub, request, plan.plan_id, g, assembler, on_verified)
                                     for g in groups))
        wanted = sorted(set(i for group in bad for i in group) | set(assembler.missing()))
        if not wanted:
            return rejected
        rejected += len(wanted)
        log.warning("buckets %s of version %d from %s failed their checksum; pulling them "
                    "again (attempt %d)", wanted, plan.version, endpoint, attempt + 1)
    raise PullError(f"buckets {wanted} of version {plan.version} from {endpoint} stayed "
                    f"damaged after {refetch_attempts} re-pulls; try another agent", "DATA_LOSS")


async def _fetch(stub, request: pb.PullRequest, plan_id: int, indices: list[int],
                 assembler: BucketAssembler, on_verified: Callable[[int], None]) -> list[int]:
    """Stream ``indices``; returns those whose checksum failed (their buffers are dropped)."""
    damaged = []
    call = stub.PullBuckets(pb.BucketsRequest(pull=request, buckets=indices, plan_id=plan_id))
    async for chunk in call:
        try:
            done = assembler.add(chunk)
        except ValueError as exc:
            raise PullError(f"agent sent a bad chunk: {exc}", "DATA_LOSS") from None
        if done is None:
            continue
        if assembler.intact(done):
            on_verified(done)
        else:
            damaged.append(done)
            assembler.reset(done)
    return damaged


class PullDecoder:
    """Decodes a pull's tensors while its buckets still arrive: a dense tensor goes to a codec
    thread as soon as every bucket it lies in passed its CRC; deltas (which may write into the
    held tensors) wait for the last bucket and then decode all together, all or nothing."""

    def __init__(self, manifest: VersionManifest, buffers: dict[int, bytearray],
                 held: Mapping[str, torch.Tensor], held_version: int | None, inplace: bool,
                 pool: ThreadPoolExecutor, held_sums: Mapping[str, int] | None = None) -> None:
        self._manifest = manifest
        self._held_sums = held_sums
        self._buffers = buffers
        self._held, self._held_version, self._inplace = held, held_version, inplace
        self._pool = pool
        self._verified: set[int] = set()
        self._started: set[str] = set()
        self._running: list[asyncio.Future] = []

    def bucket_verified(self, index: int) -> None:
        self._verified.add(index)
        ready = {e.name for e in self._manifest.entries
                 if e.name not in self._started and e.encoding == Encoding.DENSE.name
                 and all(s.bucket in self._verified for s in e.segments)}
        if ready:
            self._started |= ready
            self._running.append(asyncio.get_running_loop().run_in_executor(
                self._pool, partial(apply_pull, self._manifest, self._buffers, self._held,
                                    self._held_version, names=ready,
                                    verified=set(self._verified))))

    async def finish(self) -> dict[str, torch.Tensor]:
        """Every tensor of the manifest, verified. Bytes that arrived intact but do not decode
        (a tensor failing its checksum, a delta against another base, a malformed payload) raise
        PullError DATA_LOSS — DeltaApplyError when the pull carried deltas — like any pull
        that failed at this sender: the caller tries another holder, or a dense pull."""
        try:
            return await self._decode_rest()
        except ValueError as exc:  # ManifestError, DeltaCodecError, ChecksumMismatchError
            deltas = any(e.encoding != Encoding.DENSE.name for e in self._manifest.entries)
            error = DeltaApplyError if deltas else PullError
            raise error(f"version {self._manifest.version} arrived but does not decode: "
                        f"{type(exc).__name__}: {exc}", "DATA_LOSS") from exc

    async def _decode_rest(self) -> dict[str, torch.Tensor]:
        rest = {e.name for e in self._manifest.entries if e.name not in self._started}
        tensors: dict[str, torch.Tensor] = {}
        try:
            for part in await asyncio.gather(*self._running):
                tensors.update(part)
        except BaseException:
            self.abandon()
            raise
        if rest:  # outside the pool: apply_pull maps its tensors onto the pool itself
            tensors.update(await asyncio.get_running_loop().run_in_executor(None, partial(
                apply_pull, self._manifest, self._buffers, self._held, self._held_version,
                inplace=self._inplace, names=rest, verified=set(self._verified),
                parallel_map=self._pool.map, held_sums=self._held_sums)))
        return {e.name: tensors[e.name] for e in self._manifest.entries}

    def abandon(self) -> None:
        """The pull failed: nobody will read the decodes under way, so retrieve their errors."""
        for future in self._running:
            future.add_done_callback(lambda f: f.cancelled() or f.exception())


def weights_fingerprint(tensors: Mapping[str, torch.Tensor]) -> int:
    """One CRC-32 over every tensor's name and linear sum, in name order: equal fingerprints
    mean bit-identical weights (used in logs, the worker's metrics and the tests)."""
    return sums_fingerprint({name: tensor_linear_sum(t) for name, t in tensors.items()})


def sums_fingerprint(sums: Mapping[str, int]) -> int:
    """``weights_fingerprint`` from the tensors' linear sums, without reading the tensors: a
    worker that pulled a delta knows them already."""
    digest = 0
    for name in sorted(sums):
        digest = zlib.crc32(f"{name}:{sums[name]:016x};".encode(), digest)
    return digest & 0xFFFFFFFF
