"""A transfer agent drops a job nobody has published, relayed or pulled for ``--job-idle-s``:
its memory is freed, its holder record deleted, and a later publish starts it afresh; jobs in
use, and a publish still streaming in, are kept; a relaying agent does not pull a dropped job
back. Real agent processes, real gRPC and a real etcd; job_idle_s is 1.5 s to keep them short."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections.abc import AsyncIterator

import grpc
import pytest
import torch

from rlharvest.common.pb import transfer_agent_pb2 as pb, transfer_agent_pb2_grpc
from rlharvest.services.trainer.publish import Publisher
from rlharvest.services.transfer_agent.client import (
    _pack_dense,
    agent_channel,
    agent_status,
    holders,
    plan_pull,
    publish,
    pull,
    weights_fingerprint,
)
from rlharvest.services.transfer_agent.data_path import chunk_buckets

from .test_transfer_agent import scrape, start_agent, wait_for

pytestmark = pytest.mark.integration

IDLE_S = 1.5
IDLE = ("--job-idle-s", str(IDLE_S))


def weights(seed: int, n: int = 4096) -> dict[str, torch.Tensor]:
    return {"w": torch.randn(n, generator=torch.Generator().manual_seed(seed))}


def nudged(tensors: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """The next version: a few elements changed, so a delta publish of it is sparse."""
    w = tensors["w"].clone()
    w[torch.randperm(w.numel(), generator=torch.Generator().manual_seed(seed))[:16]] += 1.0
    return {"w": w}


async def held_by(etcd, job: str, agent_id: str) -> list[int]:
    """The versions ``agent_id``'s holder record of ``job`` lists; [] when it has none."""
    return (await holders(etcd, job)).get(agent_id, {}).get("versions", [])


async def status_jobs(endpoint: str) -> dict[str, list[int]]:
    reply = await agent_status(endpoint)
    return {j.job: list(j.held_versions) for j in reply.jobs}


async def plan_code(endpoint: str, job: str) -> grpc.StatusCode:
    async with agent_channel(endpoint) as chan:
        try:
            await plan_pull(chan, pb.PullRequest(job=job))
        except grpc.aio.AioRpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def healthz_jobs(metrics_port: int) -> dict[str, list[int]]:
    body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/healthz", timeout=5).read()
    return json.loads(body)["jobs"]


async def test_an_idle_job_is_dropped_while_jobs_pulled_or_published_meanwhile_are_kept(
        stack, etcd_client):
    _, endpoint, metrics_port = start_agent(stack, "idler", *IDLE)
    for job in ("idle", "pulled", "published"):
        await publish(endpoint, job, 1, weights(1))
    assert await held_by(etcd_client, "idle", "idler") == [1]

    # Twice job_idle_s and more, the other two jobs in use all along.
    version = 1
    until = time.monotonic() + 2 * IDLE_S + 1.0
    while time.monotonic() < until:
        await pull(endpoint, "pulled", version=1)
        version += 1
        await publish(endpoint, "published", version, weights(version))
        await asyncio.sleep(0.25)

    assert await held_by(etcd_client, "idle", "idler") == []  # workers stop asking this agent
    assert "idle" not in await status_jobs(endpoint)
    assert "idle" not in healthz_jobs(metrics_port)
    assert await plan_code(endpoint, "idle") == grpc.StatusCode.NOT_FOUND
    got = scrape(metrics_port)
    assert got["rlh_agent_jobs_dropped_total"] == 1
    assert "rlh_agent_held_bytes{job=idle}" not in got  # its memory and its gauges are gone
    assert await held_by(etcd_client, "pulled", "idler") == [1]
    assert (await status_jobs(endpoint))["published"] == [version - 1, version]


async def test_a_publish_streaming_in_for_longer_than_job_idle_s_keeps_its_job(
        stack, etcd_client):
    _, endpoint, metrics_port = start_agent(stack, "streamed", *IDLE)
    await publish(endpoint, "slow", 1, weights(1))
    manifest, buckets = _pack_dense(2, weights(2), 64 << 20)
    header = pb.PublishHeader(job="slow", version=2, manifest_json=json.dumps(manifest.to_dict()))

    async def slow_stream() -> AsyncIterator[pb.PublishChunk]:
        yield pb.PublishChunk(header=header)
        await asyncio.sleep(2 * IDLE_S + 0.5)  # the bytes take longer than job_idle_s
        for chunk in chunk_buckets(buckets, 1 << 20):
            yield pb.PublishChunk(chunk=chunk)

    async with agent_channel(endpoint) as chan:
        reply = await transfer_agent_pb2_grpc.TransferAgentStub(chan).Publish(slow_stream())
    assert list(reply.held_versions) == [1, 2]  # version 1 was kept: the job was not dropped
    assert scrape(metrics_port)["rlh_agent_jobs_dropped_total"] == 0


async def test_a_dropped_job_is_published_afresh_and_a_trainers_delta_publish_goes_dense(
        stack, etcd_client):
    _, endpoint, metrics_port = start_agent(stack, "fresh", *IDLE)
    publisher = Publisher(None, "comeback", endpoint, 1 << 20, deltas=True)
    v1 = weights(1)
    v2 = nudged(v1, 2)
    await publisher.publish(1, v1)
    await publisher.publish(2, v2)  # a delta against version 1
    assert publisher.last_stats is not None and publisher.last_stats.changed_fraction < 0.01
    await wait_for(lambda: _dropped(metrics_port), timeout=5 * IDLE_S, what="the job dropped")
    assert await held_by(etcd_client, "comeback", "fresh") == []

    v3 = nudged(v2, 3)
    await publisher.publish(3, v3)  # refused as a delta (the base is gone), then sent dense
    assert publisher.last_stats is not None and publisher.last_stats.changed_fraction == 1.0
    got = scrape(metrics_port)
    assert got["rlh_agent_refused_total{code=FAILED_PRECONDITION,rpc=Publish}"] == 1
    assert await held_by(etcd_client, "comeback", "fresh") == [3]
    pulled = await pull(endpoint, "comeback", version=3)
    assert weights_fingerprint(pulled.tensors) == weights_fingerprint(v3)


async def test_a_relaying_agent_does_not_pull_back_a_job_it_dropped(stack, etcd_client):
    job = "relayed-idle"
    # The source keeps its jobs (the default job_idle_s): the version stays there to pull.
    _, source, _ = start_agent(stack, "keeper")
    _, _, relay_metrics = start_agent(stack, "relayer", "--relay", "--relay-jobs", job, *IDLE)
    await publish(source, job, 1, weights(1))
    await wait_for(lambda: _equals(held_by(etcd_client, job, "relayer"), [1]), timeout=10,
                   what="the relay's copy of version 1")
    await wait_for(lambda: _dropped(relay_metrics), timeout=5 * IDLE_S, what="the job dropped")

    # Relay rounds run every second and on every etcd change (the deleted holder record is one).
    await asyncio.sleep(2 * IDLE_S)
    assert await held_by(etcd_client, job, "relayer") == []
    got = scrape(relay_metrics)
    assert got["rlh_agent_relays_total{link=local}"] == 1 and got[
        "rlh_agent_jobs_dropped_total"] == 1

    # The job resumes: its new version is relayed as ever.
    await publish(source, job, 2, weights(2))
    await wait_for(lambda: _equals(held_by(etcd_client, job, "relayer"), [2]), timeout=10,
                   what="the relay's copy of version 2")


def _dropped(metrics_port: int) -> bool:
    return scrape(metrics_port).get("rlh_agent_jobs_dropped_total", 0) >= 1


async def _equals(coro, expected) -> bool:
    return await coro == expected
