"""The service host in-process, against a real etcd and real gRPC/HTTP over loopback: what it
serves, the one teardown order, and what happens to a loop that raises."""

from __future__ import annotations

import asyncio
import logging
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from rlharvest.common import keys, registry, rpc
from rlharvest.common.config import ServiceConfig
from rlharvest.common.pb import trainer_pb2, trainer_pb2_grpc
from rlharvest.common.retry import Backoff
from rlharvest.common.service_host import Host, Loop, Parts, Servicer, ServiceSpec, StopReason

from .slow_build_service import HostedConfig
from .worker_client import listening

pytestmark = pytest.mark.integration
NAME = trainer_pb2.DESCRIPTOR.services_by_name["Trainer"].full_name
FAST = Backoff(first_s=0.01, max_s=0.05)


class DemoConfig(HostedConfig):
    demo_id: str = "demo-0"


class DemoService(trainer_pb2_grpc.TrainerServicer):
    async def GetStatus(self, request, context) -> trainer_pb2.TrainerStatus:
        return trainer_pb2.TrainerStatus(trainer_id="demo-0", state="ok")


def spec(loops: Callable[[Host], list[Loop]] = lambda host: [], **parts: Any) -> ServiceSpec:
    async def build(host: Host[DemoConfig]) -> Parts:
        return Parts(member_id=host.config.demo_id, member_info={"role": "demo"},
                     servicers=[Servicer(DemoService(),
                                         trainer_pb2_grpc.add_TrainerServicer_to_server, NAME)],
                     health=lambda: {"status": "ok"}, loops=loops(host), **parts)

    return ServiceSpec("demo", DemoConfig, build)


class Running:
    """A host running in a task of the test's event loop; ``signal()`` is what SIGTERM does."""

    def __init__(self, service: ServiceSpec, etcd_endpoint: str) -> None:
        self.signalled = asyncio.Event()
        self.host = Host(service, DemoConfig(etcd=etcd_endpoint))
        self.task = asyncio.create_task(self.host.run(self.signalled))

    async def member(self, etcd, timeout: float = 10.0) -> dict:
        key = keys.member_key("demo", "demo-0")
        deadline = asyncio.get_running_loop().time() + timeout
        while key not in (members := await registry.list_members(etcd, "demo")):
            assert not self.task.done(), f"host ended early: {self.task.result()}"
            assert asyncio.get_running_loop().time() < deadline, "host did not register"
            await asyncio.sleep(0.05)
        return members[key]

    def signal(self) -> None:
        self.signalled.set()

    async def exit_code(self, timeout: float = 20.0) -> int:
        return await asyncio.wait_for(self.task, timeout)


async def health_of(endpoint: str) -> int:
    async with rpc.channel(endpoint) as chan:
        reply = await health_pb2_grpc.HealthStub(chan).Check(health_pb2.HealthCheckRequest(),
                                                             timeout=2)
    return reply.status


async def answers(endpoint: str) -> bool:
    try:
        async with rpc.channel(endpoint) as chan:
            await trainer_pb2_grpc.TrainerStub(chan).GetStatus(trainer_pb2.TrainerStatusRequest(),
                                                               timeout=1)
        return True
    except grpc.aio.AioRpcError:
        return False



async def test_a_hosted_service_serves_health_reflection_and_http_and_registers(
        etcd_client, etcd_endpoint):
    running = Running(spec(), etcd_endpoint)
    info = await running.member(etcd_client)
    assert info["role"] == "demo" and info["endpoint"] == running.host.endpoint
    assert await health_of(info["endpoint"]) == health_pb2.HealthCheckResponse.SERVING
    async with rpc.channel(info["endpoint"]) as chan:
        stub = reflection_pb2_grpc.ServerReflectionStub(chan)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        async for reply in stub.ServerReflectionInfo(iter([request])):
            listed = {s.name for s in reply.list_services_response.service}
    assert {NAME, "grpc.health.v1.Health"} <= listed
    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://{info['metrics']}/healthz") as resp:
            assert resp.status == 200 and (await resp.json()) == {"status": "ok"}
        async with http.get(f"http://{info['metrics']}/metrics") as resp:
            assert resp.status == 200
    running.signal()
    assert await running.exit_code() == 0
    assert await registry.list_members(etcd_client, "demo") == {}
    assert not listening(info["endpoint"]) and not listening(info["metrics"])


async def test_readyz_answers_as_grpc_health_does_while_healthz_says_alive(
        etcd_client, etcd_endpoint):
    """A standby leader (serving=False until it leads) is alive but not ready: a probe that
    cannot speak gRPC health (kubelet's, under TLS) must not route traffic to it."""
    running = Running(spec(serving=False), etcd_endpoint)
    info = await running.member(etcd_client)

    async def statuses() -> tuple[int, int]:
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://{info['metrics']}/healthz") as alive, \
                    http.get(f"http://{info['metrics']}/readyz") as ready:
                return alive.status, ready.status

    assert await health_of(info["endpoint"]) == health_pb2.HealthCheckResponse.NOT_SERVING
    assert await statuses() == (200, 503)
    await running.host.set_serving(True)  # it leads now
    assert await statuses() == (200, 200)
    running.signal()
    assert await running.exit_code() == 0


async def test_teardown_runs_once_in_order_after_a_signal(etcd_client, etcd_endpoint):
    seen: list[tuple] = []
    holder: dict[str, Host] = {}
    key = keys.member_key("demo", "demo-0")

    async def registered() -> bool:
        return key in await registry.list_members(etcd_client, "demo")

    def stop_accepting() -> None:
        seen.append(("stop accepting",))

    async def drain(reason: StopReason) -> None:
        endpoint = holder["host"].endpoint
        seen.append(("drain", reason.from_signal, await health_of(endpoint),
                     await answers(endpoint)))

    async def loop() -> None:
        try:
            await asyncio.Event().wait()
        finally:  # cancelled: gRPC is stopped, the member still registered
            seen.append(("loop cancelled", await answers(holder["host"].endpoint),
                         await registered()))

    async def close() -> None:
        metrics = holder["metrics"]
        seen.append(("close", await registered(), listening(metrics)))

    def loops(host: Host) -> list[Loop]:
        holder["host"] = host
        return [Loop("waits", loop)]

    running = Running(spec(loops, stop_accepting=stop_accepting, drain=drain, close=[close]),
                      etcd_endpoint)
    holder["metrics"] = (await running.member(etcd_client))["metrics"]
    running.signal()
    running.signal()  # a second request changes nothing: one teardown
    assert await running.exit_code() == 0
    assert seen == [
        ("stop accepting",),
        ("drain", True, health_pb2.HealthCheckResponse.NOT_SERVING, True),  # still answers
        ("loop cancelled", False, True),  # gRPC stopped before loops, deregistered after
        ("close", False, False),  # after deregistering and closing HTTP
    ]


async def test_a_loop_that_raises_is_logged_with_its_traceback_and_restarted(
        etcd_client, etcd_endpoint, caplog):
    calls = 0
    steady = asyncio.Event()

    async def flaky() -> None:
        nonlocal calls
        calls += 1
        if calls <= 2:
            raise RuntimeError(f"boom {calls}")
        steady.set()
        await asyncio.Event().wait()

    caplog.set_level(logging.INFO, "rlharvest.common.service_host")
    running = Running(spec(lambda host: [Loop("flaky", flaky, on_crash="restart", backoff=FAST)]),
                      etcd_endpoint)
    await running.member(etcd_client)
    await asyncio.wait_for(steady.wait(), 10)
    crashes = [r for r in caplog.records if "crashed" in r.getMessage()]
    assert len(crashes) == 2 and all(r.exc_info for r in crashes)
    assert "boom 2" in caplog.text and "restarting it in" in caplog.text
    assert not running.task.done() and calls == 3
    running.signal()
    assert await running.exit_code() == 0


async def test_a_loop_that_raises_under_the_stop_policy_stops_the_service_with_exit_code_1(
        etcd_client, etcd_endpoint, caplog):
    crash = asyncio.Event()
    drained: list[StopReason] = []

    async def fragile() -> None:
        await crash.wait()
        raise ValueError("the engine broke")

    async def drain(reason: StopReason) -> None:
        drained.append(reason)

    running = Running(spec(lambda host: [Loop("engine", fragile)], drain=drain), etcd_endpoint)
    await running.member(etcd_client)
    crash.set()
    assert await running.exit_code() == 1
    assert drained[0].exit_code == 1 and "the engine broke" in drained[0].message
    assert "Traceback" in caplog.text and "ValueError: the engine broke" in caplog.text
    assert await registry.list_members(etcd_client, "demo") == {}


async def test_a_loop_that_stops_the_host_ends_it_with_its_exit_code(etcd_client, etcd_endpoint):
    async def deposed(host: Host) -> None:
        host.stop("lost leadership", exit_code=1)

    running = Running(spec(lambda host: [Loop("lead", lambda: deposed(host))]), etcd_endpoint)
    assert await running.exit_code() == 1
    assert running.host.reason == StopReason("lost leadership", 1)


async def test_a_failed_startup_exits_1_and_releases_the_port_it_bound(etcd_endpoint):
    async def build(host: Host[DemoConfig]) -> Parts:
        holder.append(host.endpoint)
        raise RuntimeError("cannot build")

    holder: list[str] = []
    running = Running(ServiceSpec("demo", DemoConfig, build), etcd_endpoint)
    assert await running.exit_code() == 1
    assert "cannot build" in running.host.reason.message
    assert not listening(holder[0])


def test_a_config_without_the_hosted_fields_is_refused_when_declared():
    class Bare(ServiceConfig):
        name: str = "x"

    async def build(host: Host[Bare]) -> Parts:
        raise AssertionError("never built")

    with pytest.raises(TypeError, match="lacks the fields the service host reads: "
                                        "advertise_host, etcd, host"):
        ServiceSpec("bare", Bare, build)


def _start_slow_build(etcd_endpoint: str, tmp_path, mode: str, build_s: float):
    """tests/integration/slow_build_service.py as a real process, once its build has begun."""
    marker = tmp_path / "marker"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.integration.slow_build_service", "--etcd", etcd_endpoint,
         "--build", mode, "--build-s", str(build_s), "--marker", str(marker)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    while not marker.exists():
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() < deadline, "the build never began"
        time.sleep(0.05)
    return proc


async def test_a_sigterm_during_a_slow_build_exits_promptly_with_code_0_unregistered(
        etcd_client, etcd_endpoint, tmp_path):
    """A build that awaits (a model loaded off the event loop) is cancelled by SIGTERM: the
    process exits within seconds, not after the build's 60 s, with the graceful exit code,
    and never served nor registered."""
    proc = _start_slow_build(etcd_endpoint, tmp_path, "async", 60.0)
    try:
        await asyncio.sleep(0.3)  # well inside the build
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        output, _ = await asyncio.to_thread(proc.communicate, timeout=15)
        assert proc.returncode == 0, output
        assert time.monotonic() - signalled < 15
        assert "stopping: shutting down on a signal" in output
        assert "serving on" not in output
        assert not await registry.list_members(etcd_client, "slow_build")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def test_a_sigterm_during_a_build_that_holds_the_event_loop_never_serves_or_registers(
        etcd_client, etcd_endpoint, tmp_path):
    """A build that blocks the event loop (a model loaded on it) cannot be interrupted; the
    signal is seen when it returns, and the service then stops without serving, registering
    (no member record flickers up for clients to find)."""
    proc = _start_slow_build(etcd_endpoint, tmp_path, "blocking", 2.0)
    try:
        proc.send_signal(signal.SIGTERM)
        output, _ = await asyncio.to_thread(proc.communicate, timeout=30)
        assert proc.returncode == 0, output
        assert "stopping: shutting down on a signal" in output
        assert "serving on" not in output
        assert "stopped while it was being built" in output  # before it served anything
        assert "teardown step" not in output  # nothing half-started to undo
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def test_etcd_going_away_between_connecting_and_registering_is_waited_out(tmp_path):
    """etcd SIGKILLed while the service builds (it connected before), back 1.5 s later: the
    registration waits for it instead of failing the start (a chaos soak's co-executor exited
    so)."""
    from rlharvest.common.local_etcd import LocalEtcd

    with LocalEtcd(log_path=tmp_path / "etcd.log") as etcd:
        restarted: list[asyncio.Future] = []

        async def build(host: Host[DemoConfig]) -> Parts:
            restarted.append(asyncio.ensure_future(
                asyncio.to_thread(etcd.restart, crash=True, down_s=1.5)))
            await asyncio.sleep(0.3)  # killed by now; registering comes next
            return Parts(member_id="demo-0", member_info={"role": "demo"},
                         servicers=[Servicer(DemoService(),
                                             trainer_pb2_grpc.add_TrainerServicer_to_server,
                                             NAME)],
                         health=lambda: {"status": "ok"})

        running = Running(ServiceSpec("demo", DemoConfig, build), etcd.endpoint)
        try:
            await asyncio.wait_for(asyncio.shield(_first(restarted)), 30)
            client = await registry.connect(etcd.endpoint)
            try:
                assert (await running.member(client, timeout=30))["role"] == "demo"
            finally:
                await client.close()
        finally:
            running.signal()
            assert await running.exit_code() == 0


async def _first(futures: list[asyncio.Future]) -> None:
    while not futures:
        await asyncio.sleep(0.01)
    await futures[0]
