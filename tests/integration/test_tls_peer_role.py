"""Under mutual TLS a client checks the role of the server it dials, not only that the CA
signed its certificate: a weight holder whose certificate is not an agent's (here a worker's,
of the same CA, whose process registered as a transfer agent and holds weights of its own) is
refused in the handshake by a trainer's publish, a pull, the HTTP data path, a worker's puller
(which goes on to a genuine agent) and a relaying agent; a channel dialing any other role
(``rpc.channel(peer_role=)``: the manager's worker sessions, a trainer's manager) does the same.
Certificates name their role as the DNS name ``<role>.role.rlharvest`` for this
(``tls.LocalCA``)."""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rlharvest.common import registry, rpc, tls
from rlharvest.common.local_etcd import free_port
from rlharvest.cli.launcher import LocalStack
from rlharvest.services.rollout_worker.puller import Puller
from rlharvest.services.transfer_agent import client as agent_client
from rlharvest.services.transfer_agent.client import (
    plan_pull,
    publish,
    pull,
    pull_request,
)
from rlharvest.services.transfer_agent.http_data import DataPathError, RangeFetcher

from .test_agent_idle_jobs import held_by, weights
from .test_puller_failover import Engine, exact, loaded
from .test_transfer_agent import wait_for

pytestmark = pytest.mark.integration

ROLE_CHECK_FAILED = "agent.role.rlharvest"  # what the refusals name


@pytest.fixture(scope="module")
def ca(tmp_path_factory) -> tls.LocalCA:
    return tls.LocalCA(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def as_trainer(ca):
    """The test process dials as a trainer of every job (plaintext again afterwards)."""
    cert, key = ca.issue("test-trainer", "trainer", ["*"])
    tls.configure(str(cert), str(key), str(ca.ca_path))
    yield
    tls.configure("", "", "")


@pytest.fixture
async def etcd(etcd_endpoint):
    client = await registry.connect(etcd_endpoint)  # no wipe: the module's agents keep their keys
    yield client
    await client.close()


def start_agent(stack: LocalStack, ca: tls.LocalCA, name: str, role: str, *extra: str) -> str:
    """A transfer agent process whose certificate is of ``role`` (the stack issues none: its
    etcd stays plaintext); its gRPC endpoint once its HTTPS health endpoint answers."""
    port, metrics_port = free_port(), free_port()
    proc = stack.start("transfer_agent", name, [
        "--agent-id", name, "--node", f"node-{name}", "--port", str(port),
        "--metrics-port", str(metrics_port), "--lease-ttl", "2", "--json-logs",
        *ca.flags(name, role), *extra])
    probe = ssl.create_default_context(cafile=str(ca.ca_path))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.alive(), "agent exited:\n" + proc.log_tail()
        try:
            urllib.request.urlopen(f"https://127.0.0.1:{metrics_port}/healthz", context=probe,
                                   timeout=1)
            return f"127.0.0.1:{port}"
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"agent {name} not up:\n{proc.log_tail()}")


@dataclass(frozen=True)
class Holders:
    rogue_id: str
    rogue: str  # a transfer agent process with a worker's certificate
    genuine_id: str
    genuine: str  # one with an agent's


@pytest.fixture(scope="module")
def holders(module_stack, ca) -> Holders:
    """The rogue sorts first by id, so a fresh worker pairs with it and asks it first."""
    suffix = uuid.uuid4().hex[:6]
    rogue_id, genuine_id = f"a-rogue-{suffix}", f"b-agent-{suffix}"
    return Holders(rogue_id, start_agent(module_stack, ca, rogue_id, "worker"),
                   genuine_id, start_agent(module_stack, ca, genuine_id, "agent"))


def _unchecked_agent_channel(endpoint: str) -> grpc.aio.Channel:
    """What the rogue holder's operator dials it with: no role asked of it."""
    return rpc.channel(endpoint, [agent_client.SERVICE_NAME],
                       max_message_bytes=agent_client.MAX_MESSAGE_BYTES)


async def plant(monkeypatch, endpoint: str, job: str, version: int,
                tensors: dict[str, torch.Tensor]) -> None:
    """Weights of the rogue's own on it (the attacker loads them however it likes)."""
    with monkeypatch.context() as patched:
        patched.setattr(agent_client, "agent_channel", _unchecked_agent_channel)
        await publish(endpoint, job, version, tensors)


async def test_a_holder_without_an_agent_certificate_gets_no_publish_and_serves_no_pull(
        holders, etcd, as_trainer, monkeypatch):
    job = f"tls-role-{uuid.uuid4().hex[:6]}"
    genuine_weights = weights(1)
    await publish(holders.genuine, job, 1, genuine_weights)
    with pytest.raises(grpc.aio.AioRpcError) as refused:  # the trainer's weights stay home
        await publish(holders.rogue, job, 1, genuine_weights)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert ROLE_CHECK_FAILED in rpc.error_text(refused.value, "agent")

    await plant(monkeypatch, holders.rogue, job, 1, weights(2))
    assert await held_by(etcd, job, holders.rogue_id) == [1]  # etcd names it a holder

    # A pull from it: refused in the handshake.
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await pull(holders.rogue, job, version=1)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE

    # Its HTTP data path (what pulls and scattered relays fetch buckets over): refused too.
    request = pull_request(job, 1)
    async with _unchecked_agent_channel(holders.rogue) as chan:
        plan, data_endpoint = await plan_pull(chan, request)
    assert data_endpoint
    buffers = {0: bytearray(16)}
    async with RangeFetcher(data_endpoint, request, plan.plan_id, buffers, 1) as fetcher:
        with pytest.raises(DataPathError) as http_refused:
            await fetcher.fetch_parts([(0, 0, 16)], lambda part: None)
    assert http_refused.value.code == "UNAVAILABLE"
    assert ROLE_CHECK_FAILED in str(http_refused.value), http_refused.value

    # The genuine agent serves over both paths.
    over_http = await pull(holders.genuine, job, version=1, transport="http",
                           inline_max_bytes=0)
    assert exact(over_http.tensors, genuine_weights)


async def test_a_puller_refuses_a_holder_without_an_agent_certificate_and_loads_from_an_agent(
        holders, etcd, as_trainer, monkeypatch, caplog):
    job = f"tls-puller-{uuid.uuid4().hex[:6]}"
    genuine_weights = weights(3)
    await publish(holders.genuine, job, 1, genuine_weights)
    await plant(monkeypatch, holders.rogue, job, 1, weights(4))
    caplog.set_level(logging.WARNING, logger="rlharvest.services.rollout_worker.puller")
    engine = Engine()
    puller = Puller(etcd, engine, f"worker-{job}", job)
    # It pairs with the rogue (first by id) and asks it first: refused, it goes on.
    assert exact(await loaded(puller, engine, 1), genuine_weights)
    said = [r.getMessage() for r in caplog.records if holders.rogue_id in r.getMessage()]
    assert said and ROLE_CHECK_FAILED in said[0], said


async def test_a_relay_takes_no_version_from_a_holder_without_an_agent_certificate(
        module_stack, ca, holders, etcd, as_trainer, monkeypatch):
    job = f"tls-relay-{uuid.uuid4().hex[:6]}"
    relay_id = f"relay-{job}"
    await plant(monkeypatch, holders.rogue, job, 1, weights(5))
    start_agent(module_stack, ca, relay_id, "agent", "--relay", "--relay-jobs", job)
    relay_log = Path(module_stack.processes[-1].log_path)

    def refused_or_relayed() -> bool:
        text = relay_log.read_text(errors="replace")
        return ROLE_CHECK_FAILED in text or "relayed version 1" in text

    await wait_for(refused_or_relayed, timeout=30, what="the relay's try at the rogue")
    assert ROLE_CHECK_FAILED in relay_log.read_text(errors="replace")
    assert await held_by(etcd, job, relay_id) == []

    # A genuine agent's newer version is relayed.
    await publish(holders.genuine, job, 2, weights(6))

    async def relayed() -> bool:
        return 2 in await held_by(etcd, job, relay_id)

    await wait_for(relayed, timeout=30, what="version 2 relayed from the genuine agent")
    assert 1 not in await held_by(etcd, job, relay_id)


async def test_a_channel_dialing_a_role_takes_only_a_certificate_of_that_role(tmp_path: Path):
    from rlharvest.services.rollout_worker.client import WorkerLink, session_role

    ca = tls.LocalCA(tmp_path / "pki")
    try:
        def identity(role: str) -> None:
            cert, key = ca.issue(role, role)
            tls.configure(str(cert), str(key), str(ca.ca_path))

        identity("agent")
        server = await rpc.start_server([], [])  # it serves with the agent's certificate
        identity("manager")  # and dials as a manager
        target = f"127.0.0.1:{server.port}"

        async def check(peer_role: str | None) -> None:
            async with rpc.channel(target, peer_role=peer_role) as chan:
                await health_pb2_grpc.HealthStub(chan).Check(health_pb2.HealthCheckRequest(),
                                                             timeout=5)

        await check("agent")
        await check(None)  # no role asked: the host's name (127.0.0.1) is checked
        for role in ("worker", "manager", "scheduler"):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await check(role)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            assert f"{role}.role.rlharvest" in rpc.error_text(refused.value, role)

        # The manager's session with a "worker" that holds the agent's certificate breaks at
        # the handshake, and says why.
        broken: asyncio.Future[str] = asyncio.get_running_loop().create_future()

        async def on_event(worker_id, event) -> None:
            raise AssertionError("no event comes from a refused worker")

        link = WorkerLink("w0", target, on_event, lambda _, reason: broken.set_result(reason),
                          1 << 20, session_role("dedicated"))
        try:
            reason = await asyncio.wait_for(broken, 10)
        finally:
            await link.close()
        assert "UNAVAILABLE" in reason and "worker.role.rlharvest" in reason, reason
        assert (session_role("spot"), session_role("serving"), session_role("seed")) == (
            "worker", "coexecutor", "trainer")
        await server.stop(0)
    finally:
        tls.configure("", "", "")
