"""The shared gRPC bootstrap against real servers on loopback: health, reflection, retries."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from rlharvest.common import rpc
from rlharvest.common.local_etcd import free_ports
from rlharvest.common.pb import rollout_worker_pb2
from rlharvest.common.retry import Backoff, retry

WORKER = rollout_worker_pb2.DESCRIPTOR.services_by_name["RolloutWorker"].full_name


async def _check(target: str, service: str = "") -> health_pb2.HealthCheckResponse:
    async with rpc.channel(target) as chan:
        return await health_pb2_grpc.HealthStub(chan).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=1)


UNAVAILABLE = rpc.status_in(grpc.StatusCode.UNAVAILABLE)


async def test_retry_on_unavailable_rides_out_a_server_that_is_not_up_yet():
    port = free_ports(1)[0]
    target = f"127.0.0.1:{port}"
    calls = 0

    async def call():
        nonlocal calls
        calls += 1
        return await _check(target)

    async def start_late() -> rpc.Server:
        await asyncio.sleep(0.5)
        return await rpc.start_server([], [WORKER], "127.0.0.1", port)

    starting = asyncio.create_task(start_late())
    reply = await retry(call, retry_if=UNAVAILABLE, attempts=8, backoff=Backoff(first_s=0.2))
    server = await starting
    try:
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        assert calls >= 2  # the first call found nothing listening and was retried
    finally:
        await server.stop(0)


async def test_retry_on_unavailable_gives_up_and_does_not_retry_other_codes():
    dead = f"127.0.0.1:{free_ports(1)[0]}"
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await retry(lambda: _check(dead), retry_if=UNAVAILABLE, attempts=2,
                    backoff=Backoff(first_s=0.01))
    assert exc.value.code() == grpc.StatusCode.UNAVAILABLE

    server = await rpc.start_server([], [WORKER], "127.0.0.1", 0)
    calls = 0

    async def unknown_service():
        nonlocal calls
        calls += 1
        return await _check(f"127.0.0.1:{server.port}", "no.such.Service")

    try:
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await retry(unknown_service, retry_if=UNAVAILABLE, attempts=5,
                        backoff=Backoff(first_s=0.01))
        assert exc.value.code() == grpc.StatusCode.NOT_FOUND and calls == 1
    finally:
        await server.stop(0)


async def test_health_follows_serving_state_and_reflection_lists_services():
    server = await rpc.start_server([], [WORKER], "127.0.0.1", 0)
    target = f"127.0.0.1:{server.port}"
    try:
        assert (await _check(target, WORKER)).status == health_pb2.HealthCheckResponse.SERVING
        await server.set_serving(False)
        assert (await _check(target, WORKER)).status == health_pb2.HealthCheckResponse.NOT_SERVING
        async with rpc.channel(target) as chan:
            stub = reflection_pb2_grpc.ServerReflectionStub(chan)
            request = reflection_pb2.ServerReflectionRequest(list_services="")
            async for reply in stub.ServerReflectionInfo(iter([request])):
                names = {s.name for s in reply.list_services_response.service}
                break
        assert {WORKER, "grpc.health.v1.Health"} <= names
    finally:
        await server.stop(0)


async def test_messages_over_the_size_limit_are_refused():
    server = await rpc.start_server([], [WORKER], "127.0.0.1", 0, max_message_bytes=1024)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await _check(f"127.0.0.1:{server.port}", "x" * 4096)
        assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        await server.stop(0)
