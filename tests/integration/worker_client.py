"""Test-side helpers: start real worker processes and talk to them over a real Session stream."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rlharvest.common import rpc
from rlharvest.common.local_etcd import free_port
from rlharvest.common.pb import common_pb2, rollout_worker_pb2 as pb, rollout_worker_pb2_grpc
from rlharvest.services.launcher import LocalStack, ServiceProcess


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


def wait_serving(handle: WorkerHandle, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(handle.endpoint) as chan:
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


def add(request_id: str, prompt: list[int], max_tokens: int = 16, seed: int = 0,
        temperature: float = 1.0, version: int = 0, generated: list[int] | None = None,
        **sampling) -> pb.WorkerCommand:
    return pb.WorkerCommand(add=pb.AddRequest(
        request_id=request_id, prompt_token_ids=prompt, generated_token_ids=generated or [],
        weight_version=version,
        sampling=common_pb2.SamplingParams(temperature=temperature, max_tokens=max_tokens,
                                           seed=seed, **sampling)))


def abort(*request_ids: str) -> pb.WorkerCommand:
    return pb.WorkerCommand(abort=pb.AbortRequest(request_ids=list(request_ids)))


@dataclass
class Completion:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: set[int] = field(default_factory=set)
    finish_reason: str = ""
    deltas: int = 0


@dataclass
class Collected:
    completions: dict[str, Completion] = field(default_factory=dict)
    errors: dict[str, tuple[grpc.StatusCode, str]] = field(default_factory=dict)
    step_messages: int = 0
    max_deltas_per_message: int = 0
    loads: list[common_pb2.Load] = field(default_factory=list)
    draining: bool = False


class WorkerSession:
    """One manager-like Session stream to a worker."""

    def __init__(self, endpoint: str):
        self.channel = rpc.channel(endpoint)
        self.stub = rollout_worker_pb2_grpc.RolloutWorkerStub(self.channel)
        self.call = self.stub.Session()
        self.collected = Collected()

    def expect_resume(self, request_id: str, generated: list[int]) -> None:
        """A resumed request's deltas start at len(generated): seed the completion with them."""
        self.collected.completions[request_id] = Completion(tokens=list(generated))

    async def send(self, *commands: pb.WorkerCommand) -> None:
        for command in commands:
            await self.call.write(command)

    async def read_until(self, done, timeout: float = 60.0) -> Collected:
        """Read events until ``done(collected)`` holds."""
        async def loop():
            while not done(self.collected):
                event = await self.call.read()
                if event is grpc.aio.EOF:
                    return
                self._absorb(event)
        await asyncio.wait_for(loop(), timeout)
        return self.collected

    async def finish(self, request_ids, timeout: float = 60.0) -> Collected:
        ids = set(request_ids)

        def all_done(c: Collected) -> bool:
            return all((r in c.completions and c.completions[r].finish_reason) or r in c.errors
                       for r in ids)
        return await self.read_until(all_done, timeout)

    def _absorb(self, event: pb.WorkerEvent) -> None:
        which = event.WhichOneof("event")
        c = self.collected
        if which == "step":
            c.step_messages += 1
            c.max_deltas_per_message = max(c.max_deltas_per_message, len(event.step.deltas))
            c.loads.append(event.step.load)
            for d in event.step.deltas:
                comp = c.completions.setdefault(d.request_id, Completion())
                assert d.position == len(comp.tokens), \
                    f"{d.request_id}: gap or duplicate at {d.position} (have {len(comp.tokens)})"
                comp.tokens.extend(d.token_ids)
                comp.logprobs.extend(d.logprobs)
                comp.versions.add(d.weight_version)
                comp.deltas += 1
                if d.finished:
                    comp.finish_reason = d.finish_reason
        elif which == "load":
            c.loads.append(event.load)
        elif which == "error":
            c.errors[event.error.request_id] = (grpc.StatusCode[_code_name(event.error.code)],
                                                event.error.message)
        elif which == "draining":
            c.draining = True

    async def close(self) -> None:
        self.call.cancel()
        await self.channel.close()


def _code_name(value: int) -> str:
    return next(code.name for code in grpc.StatusCode if code.value[0] == value)
