"""Client side of a transfer agent: what trainers (publish), rollout workers and other agents
(pull) call. Every call opens its own channel, so it can be used from any event loop."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import grpc
import torch

from rlharvest.common import keys, registry, rpc
from rlharvest.common.pb import transfer_agent_pb2 as pb, transfer_agent_pb2_grpc
from rlharvest.services.transfer_agent.apply import apply_pull
from rlharvest.services.transfer_agent.bucketing import VersionManifest, pack
from rlharvest.services.transfer_agent.checksum import tensor_checksum
from rlharvest.services.transfer_agent.data_path import BucketAssembler, chunk_buckets
from rlharvest.services.transfer_agent.delta_codec import encode_dense

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["TransferAgent"].full_name
PUBLISH_CHUNK_BYTES = 16 << 20
MAX_MESSAGE_BYTES = 64 << 20


class PublishError(ValueError):
    """The agent refused a publish; the message is the agent's (e.g. an older version)."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.code = code


class PullError(RuntimeError):
    """A pull that could not complete from this agent; try another holder."""


def _channel(endpoint: str) -> grpc.aio.Channel:
    return rpc.channel(endpoint, [SERVICE_NAME], max_message_bytes=MAX_MESSAGE_BYTES)


async def publish(endpoint: str, job: str, version: int, tensors: Mapping[str, torch.Tensor],
                  *, bucket_bytes: int = 64 << 20) -> None:
    """Hand version ``version`` of ``job`` to the agent at ``endpoint``. Returns once the agent
    holds it (it announces the version in etcd itself); raises PublishError with the agent's
    message when it refuses (an older version, a shape change, a version over its budget)."""
    loop = asyncio.get_running_loop()
    manifest, buckets = await loop.run_in_executor(None, _pack_dense, version, tensors, bucket_bytes)
    header = pb.PublishHeader(job=job, version=version,
                              manifest_json=json.dumps(manifest.to_dict()))

    def messages():
        yield pb.PublishChunk(header=header)
        for chunk in chunk_buckets(buckets, PUBLISH_CHUNK_BYTES):
            yield pb.PublishChunk(chunk=chunk)

    async with _channel(endpoint) as chan:
        try:
            await transfer_agent_pb2_grpc.TransferAgentStub(chan).Publish(messages())
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise  # transport trouble, not a refusal: the caller retries or picks another agent
            raise PublishError(exc.details() or exc.code().name, exc.code()) from None


def _pack_dense(version: int, tensors: Mapping[str, torch.Tensor], bucket_bytes: int):
    items = [(name, encode_dense(tensor)) for name, tensor in tensors.items()]
    return pack(version, None, items, bucket_bytes)


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


def pull_request(job: str, version: int = 0, held_version: int | None = None, tp_rank: int = 0,
                 tp_size: int = 1, names: Sequence[str] = (), cluster: str = "") -> pb.PullRequest:
    return pb.PullRequest(job=job, version=version, has_holding=held_version is not None,
                          holding=held_version or 0, tp_rank=tp_rank, tp_size=tp_size,
                          names=list(names), requester_cluster=cluster)


async def pull(endpoint: str, job: str, *, version: int = 0,
               held: Mapping[str, torch.Tensor] | None = None, held_version: int | None = None,
               tp_rank: int = 0, tp_size: int = 1, names: Sequence[str] = (), cluster: str = "",
               streams: int = 4, refetch_attempts: int = 3, decode: bool = True) -> PullResult:
    """Pull ``version`` (0: the agent's latest) of ``job`` for TP slice (tp_rank, tp_size):
    sparse deltas against ``held`` (the caller's tensors of ``held_version``) where the agent still
    holds that version, dense otherwise. Buckets stream over up to ``streams`` parallel streams;
    one failing its checksum is pulled again. Every tensor is checked against its checksum.
    Raises grpc.aio.AioRpcError for the agent's refusals and PullError when data stays damaged."""
    started = time.perf_counter()
    request = pull_request(job, version, held_version, tp_rank, tp_size, names, cluster)
    async with _channel(endpoint) as chan:
        stub = transfer_agent_pb2_grpc.TransferAgentStub(chan)
        plan = await stub.PlanPull(request)
        manifest = VersionManifest.from_dict(json.loads(plan.manifest_json))
        request.version = plan.version  # pin it: "latest" must not move under the bucket streams
        assembler = BucketAssembler(manifest)
        rejected = 0
        wanted = list(range(len(manifest.bucket_sizes)))
        for attempt in range(refetch_attempts + 1):
            groups = [wanted[i::streams] for i in range(min(streams, len(wanted)))]
            bad = await asyncio.gather(*(_fetch(stub, request, plan.plan_id, g, assembler)
                                         for g in groups))
            wanted = sorted(i for group in bad for i in group) + assembler.missing()
            wanted = sorted(set(wanted))
            if not wanted:
                break
            rejected += len(wanted)
            log.warning("buckets %s of version %d from %s failed their checksum; pulling them "
                        "again (attempt %d)", wanted, plan.version, endpoint, attempt + 1)
        else:
            raise PullError(f"buckets {wanted} of version {plan.version} from {endpoint} stayed "
                            f"damaged after {refetch_attempts} re-pulls; try another agent")
    tensors: dict[str, torch.Tensor] = {}
    if decode:
        loop = asyncio.get_running_loop()
        tensors = await loop.run_in_executor(None, apply_pull, manifest, assembler.buffers,
                                             held or {}, held_version)
    return PullResult(plan.version, tensors, plan.note, plan.delta_tensors > 0, plan.payload_bytes,
                      plan.dense_bytes, rejected, time.perf_counter() - started)


async def _fetch(stub, request: pb.PullRequest, plan_id: int, indices: list[int],
                 assembler: BucketAssembler) -> list[int]:
    """Stream ``indices``; returns those whose checksum failed (their buffers are dropped)."""
    damaged = []
    call = stub.PullBuckets(pb.BucketsRequest(pull=request, buckets=indices, plan_id=plan_id))
    async for chunk in call:
        try:
            done = assembler.add(chunk)
        except ValueError as exc:
            raise PullError(f"agent sent a bad chunk: {exc}") from None
        if done is not None and not assembler.intact(done):
            damaged.append(done)
            assembler.reset(done)
    return damaged


def weights_fingerprint(tensors: Mapping[str, torch.Tensor]) -> int:
    """One CRC-32 over every tensor's name and checksum, in name order: equal fingerprints mean
    bit-identical weights (used in logs, the worker's metrics and the tests)."""
    digest = 0
    for name in sorted(tensors):
        digest = zlib.crc32(f"{name}:{tensor_checksum(tensors[name]):08x};".encode(), digest)
    return digest & 0xFFFFFFFF


def manifest_id(manifest_json: str) -> int:
    return zlib.crc32(manifest_json.encode()) & 0xFFFFFFFF
