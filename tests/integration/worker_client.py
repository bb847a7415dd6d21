"""Test-side helpers: start real worker processes and talk to them over a real Session stream
(commands and what came back: ``tests/worker_sessions.py``)."""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rlharvest.common import rpc, tls
from rlharvest.common.local_etcd import free_port
from rlharvest.common.pb import rollout_worker_pb2 as pb, rollout_worker_pb2_grpc
from rlharvest.cli.launcher import LocalStack, ServiceProcess
from rlharvest.common.engine_types import SESSION_JOB_METADATA
from tests.worker_sessions import DEFAULT_JOB, Collected, read_until


@dataclass
class WorkerHandle:
    process: ServiceProcess
    endpoint: str
    metrics_port: int


def launch_worker(stack: LocalStack, name: str, *extra: str) -> WorkerHandle:
    """Start a worker process without waiting for it (start several, then wait_serving each)."""
    port, metrics_port = free_port(), free_port()
    proc = stack.start("rollout_worker", name, [
        "--worker-id", name, "--port", str(port), "--metrics-port", str(metrics_port),
        "--lease-ttl", "2", "--torch-threads", "1", "--json-logs", *extra])
    return WorkerHandle(proc, f"127.0.0.1:{port}", metrics_port)


def start_worker(stack: LocalStack, name: str, *extra: str, ready_timeout: float = 90) -> WorkerHandle:
    handle = launch_worker(stack, name, *extra)
    wait_serving(handle, ready_timeout)
    return handle


def start_workers(stack: LocalStack, names: list[str], *extra: str,
                  ready_timeout: float = 120) -> list[WorkerHandle]:
    """Start workers in parallel: their imports overlap instead of adding up."""
    handles = [launch_worker(stack, name, *extra) for name in names]
    for handle in handles:
        wait_serving(handle, ready_timeout)
    return handles


# gRPC's default reconnect backoff (1 s, growing 1.6x) would have the poll below notice a
# process that took 5 s to start some 4 s late (one that took 19 s, 9 s late): retry every
# 0.1-0.2 s instead, as the poll does.
_RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100),
                      ("grpc.min_reconnect_backoff_ms", 100),
                      ("grpc.max_reconnect_backoff_ms", 200)]


def wait_serving(handle: WorkerHandle, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    with _sync_channel(handle.endpoint) as chan:
        stub = health_pb2_grpc.HealthStub(chan)
        while time.monotonic() < deadline:
            assert handle.process.alive(), "worker exited:\n" + handle.process.log_tail()
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == \
                        health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise TimeoutError(f"worker {handle.endpoint} not serving:\n{handle.process.log_tail()}")


def _sync_channel(endpoint: str) -> grpc.Channel:
    credentials = tls.channel_credentials()  # a test running the stack with mutual TLS
    if credentials is None:
        return grpc.insecure_channel(endpoint, options=_RECONNECT_OPTIONS)
    return grpc.secure_channel(endpoint, credentials, options=_RECONNECT_OPTIONS)


def health_status(endpoint: str) -> str:
    """The gRPC health status a process reports, by name (SERVING, NOT_SERVING)."""
    with _sync_channel(endpoint) as chan:
        reply = health_pb2_grpc.HealthStub(chan).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


class WorkerSession:
    """One manager-like Session stream to a worker."""

    def __init__(self, endpoint: str, job: str = DEFAULT_JOB):
        self.channel = rpc.channel(endpoint)
        self.stub = rollout_worker_pb2_grpc.RolloutWorkerStub(self.channel)
        self.call = self.stub.Session(metadata=((SESSION_JOB_METADATA, job),))
        self.collected = Collected()

    async def send(self, *commands: pb.WorkerCommand) -> None:
        for command in commands:
            await self.call.write(command)

    async def next_event(self) -> pb.WorkerEvent | None:
        event = await self.call.read()
        return None if event is grpc.aio.EOF else event

    async def read_until(self, done, timeout: float = 60.0) -> Collected:
        """Read events until ``done(collected)`` holds."""
        return await read_until(self.collected, self.next_event, done, timeout)

    async def finish(self, request_ids, timeout: float = 60.0) -> Collected:
        ids = set(request_ids)
        return await self.read_until(lambda c: c.finished(ids), timeout)

    async def close(self) -> None:
        self.call.cancel()
        await self.channel.close()


def listening(endpoint: str) -> bool:
    """Whether something accepts TCP connections at ``host:port`` (a server left behind)."""
    host, port = endpoint.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=1):
            return True
    except OSError:
        return False
