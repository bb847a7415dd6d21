"""The agent's Publish RPC refuses what it cannot hold with a precise status, never UNKNOWN: a
whole-model header over a shard's manifest, a TP group beyond the cap, a shard whose version was
dropped while it decoded."""

from __future__ import annotations

import json

import grpc
import pytest
import torch

from rlharvest.common.pb import transfer_agent_pb2 as pb
from rlharvest.services.transfer_agent import sharding
from rlharvest.services.transfer_agent.client import _pack_dense
from rlharvest.services.transfer_agent.config import AgentConfig
from rlharvest.services.transfer_agent.data_path import chunk_buckets
from rlharvest.services.transfer_agent.service import AgentService

JOB = "job-publish"
NAME = "model.layers.0.self_attn.q_proj.weight"
FULL = {NAME: torch.arange(64, dtype=torch.float32).reshape(8, 8)}


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code


class Context:
    """The servicer context of a plaintext call: no peer certificate."""

    def auth_context(self) -> dict:
        return {}

    async def abort(self, code: grpc.StatusCode, message: str):
        raise Aborted(code, message)


async def publish(service: AgentService, version: int, tensors: dict[str, torch.Tensor], *,
                  tp_rank: int = 0, tp_size: int = 1,
                  header_tp: tuple[int, int] | None = None) -> pb.PublishReply:
    """One Publish stream; ``header_tp`` states another (rank, size) than the manifest's."""
    manifest, buckets = _pack_dense(version, tensors, 1 << 20, tp_rank, tp_size)
    rank, size = header_tp or (tp_rank, tp_size)
    header = pb.PublishHeader(job=JOB, version=version, tp_rank=rank, tp_size=size,
                              manifest_json=json.dumps(manifest.to_dict()))

    async def messages():
        yield pb.PublishChunk(header=header)
        for chunk in chunk_buckets(buckets, 1 << 20):
            yield pb.PublishChunk(chunk=chunk)

    return await service.Publish(messages(), Context())


@pytest.fixture
def service():
    agent = AgentService(AgentConfig(agent_id="publish-test"))
    yield agent
    agent.close()


def rank_shard(rank: int, tp_size: int = 2) -> dict[str, torch.Tensor]:
    return {NAME: sharding.take_shard(NAME, FULL[NAME], rank, tp_size).contiguous()}


async def test_a_whole_model_header_over_a_shards_manifest_is_refused(service):
    with pytest.raises(Aborted, match="as a whole model .* manifest is TP rank 1 of 2") as err:
        await publish(service, 1, rank_shard(1), tp_rank=1, tp_size=2, header_tp=(0, 1))
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert service.held(JOB) == ()


async def test_a_tp_group_beyond_max_tp_size_is_refused_before_its_bytes(service):
    shard = {NAME: torch.zeros(1, 8)}  # a 1000-way slice of a (1000, 8) tensor
    with pytest.raises(Aborted, match="tp_size 1000 is over this agent's max_tp_size 256") as err:
        await publish(service, 1, shard, tp_rank=0, tp_size=1000)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT


async def test_a_shard_whose_version_was_dropped_while_it_decoded_gets_failed_precondition(
        service, monkeypatch):
    """Version 5 arrives whole from elsewhere (a relay) while rank 0's shard of it decodes."""
    decode = service._decode_publish

    async def decode_then_hold_elsewhere(header, assembler):
        tensors = await decode(header, assembler)
        await service.hold(JOB, 5, {NAME: FULL[NAME].clone()}, "relay")
        return tensors

    monkeypatch.setattr(service, "_decode_publish", decode_then_hold_elsewhere)
    with pytest.raises(Aborted, match="not staged any more") as err:
        await publish(service, 5, rank_shard(0), tp_rank=0, tp_size=2)
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert service.held(JOB) == (5,)


async def test_ranks_shards_complete_a_version_and_a_retry_replaces_a_staged_shard(service):
    stale = {NAME: torch.full_like(rank_shard(1)[NAME], -1.0)}
    assert list((await publish(service, 3, stale, tp_rank=1, tp_size=2)).shards_missing) == [0]
    again = await publish(service, 3, rank_shard(1), tp_rank=1, tp_size=2)
    assert list(again.shards_missing) == [0]
    done = await publish(service, 3, rank_shard(0), tp_rank=0, tp_size=2)
    assert list(done.held_versions) == [3]
    assert torch.equal((await service.full_tensors(JOB, 3))[NAME], FULL[NAME])  # no stale shard


async def test_a_manifest_naming_an_unknown_dtype_is_refused_invalid_argument_after_a_drain(
        service):
    manifest, buckets = _pack_dense(1, FULL, 1 << 20)
    data = manifest.to_dict()
    data["entries"][0]["dtype"] = "nosuchtype"
    header = pb.PublishHeader(job=JOB, version=1, manifest_json=json.dumps(data))
    chunks = list(chunk_buckets(buckets, 1 << 20))
    sent = []

    async def messages():
        yield pb.PublishChunk(header=header)
        for chunk in chunks:
            sent.append(chunk)
            yield pb.PublishChunk(chunk=chunk)

    with pytest.raises(Aborted, match="unknown dtype 'nosuchtype'") as err:
        await service.Publish(messages(), Context())
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert len(sent) == len(chunks)  # read to its end: the publisher sees this status
    assert service.held(JOB) == ()


@pytest.mark.parametrize("field, value", [("dtype", "complex64"), ("encoding", "ZIP")])
async def test_a_manifest_field_the_codec_cannot_read_is_refused_as_an_invalid_manifest(
        service, field, value):
    """At the header, where the manifest is parsed: not as bytes that failed to decode
    (DATA_LOSS), nor as a delta without a base."""
    manifest, buckets = _pack_dense(1, FULL, 1 << 20)
    data = manifest.to_dict()
    data["entries"][0][field] = value
    header = pb.PublishHeader(job=JOB, version=1, manifest_json=json.dumps(data))

    async def messages():
        yield pb.PublishChunk(header=header)
        for chunk in chunk_buckets(buckets, 1 << 20):
            yield pb.PublishChunk(chunk=chunk)

    with pytest.raises(Aborted, match=f"publish manifest is not valid: .*{field} '{value}'") \
            as err:
        await service.Publish(messages(), Context())
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert service.held(JOB) == ()
