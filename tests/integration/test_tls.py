"""Mutual TLS (``rlharvest/common/tls.py``) and roles (``rlharvest/common/authorization.py``) on real processes: a
whole job — agent, manager, worker, trainer — started with a CA's certificates trains over TLS
(the trainer submits and publishes, the manager runs the worker's session, the worker pulls
over the agent's HTTPS data path); a peer of another role may read the status but not submit a
step (PERMISSION_DENIED naming the role); one without a certificate, with only the CA, or with
a certificate from another CA is refused at the handshake; the metrics want a client
certificate too, the health endpoint (a kubelet probe's) does not, and Prometheus scrapes with
one. Another job's trainer may neither submit steps to this job's manager nor publish its
weights."""

from __future__ import annotations

import asyncio
import ssl
import time
import urllib.error
import urllib.request

import grpc
import pytest

import torch

from rlharvest.common import registry, tls
from rlharvest.common.local_etcd import free_port
from rlharvest.cli.prometheus_stack import LocalPrometheus, TlsFiles
from rlharvest.services.transfer_agent import client as agent_client
from rlharvest.common.pb import rollout_manager_pb2 as mpb, rollout_manager_pb2_grpc

from .test_manager import step_request
from .test_trainer import start_job, start_trainer, wait_trainer, worker_versions

pytestmark = pytest.mark.integration


@pytest.fixture
def ca(stack, tmp_path):
    """The stack's services get certificates of this CA for their roles (as `rlharvest up
    --tls` does); the test process's own channels (rpc.channel) dial as a trainer, and are
    plaintext again afterwards, for the tests that follow."""
    stack.ca = tls.LocalCA(tmp_path / "pki")
    cert, key = stack.ca.issue("test-trainer", "trainer")
    tls.configure(str(cert), str(key), str(stack.ca.ca_path))
    yield stack.ca
    tls.configure("", "", "")


async def refused(endpoint: str, credentials: grpc.ChannelCredentials | None) -> grpc.StatusCode:
    chan = grpc.aio.insecure_channel(endpoint) if credentials is None else \
        grpc.aio.secure_channel(endpoint, credentials)
    async with chan:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await rollout_manager_pb2_grpc.RolloutManagerStub(chan).GetStatus(
                mpb.GetStatusRequest(), timeout=5)
    return err.value.code()


async def test_with_mutual_tls_a_job_trains_and_only_peers_of_the_ca_in_their_role_get_in(
        stack, ca, etcd_client, etcd_endpoint, tmp_path):
    manager = await start_job(stack, 1)
    trainer, _ = await start_trainer(stack, "trainer", "--steps", "2", "--backend", "torch")
    st = await wait_trainer(trainer, lambda s: s.state == "done")
    assert [s.step for s in st.steps] == [1, 2] and st.weight_version == 2
    deadline = time.monotonic() + 60  # the worker pulled each version over HTTPS
    while (await worker_versions(etcd_client)).get("w0") != 2:
        assert time.monotonic() < deadline, await worker_versions(etcd_client)
        await asyncio.sleep(0.2)

    endpoint = manager.endpoint
    ca_pem = ca.ca_path.read_bytes()
    worker_cert, worker_key = ca.issue("test-worker", "worker")
    as_worker = grpc.ssl_channel_credentials(root_certificates=ca_pem,
                                             private_key=worker_key.read_bytes(),
                                             certificate_chain=worker_cert.read_bytes())
    async with grpc.aio.secure_channel(endpoint, as_worker) as chan:
        stub = rollout_manager_pb2_grpc.RolloutManagerStub(chan)
        assert (await stub.GetStatus(mpb.GetStatusRequest(), timeout=5)).workers  # open to all
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in stub.SubmitStep(step_request(1, 4, prefix="w"), timeout=10):
                pass
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "role 'trainer'" in err.value.details() and "'worker'" in err.value.details()

    # Another job's trainer: its role may submit steps and publish, but not for this job.
    other_cert, other_key = ca.issue("other-trainer", "trainer", ["other"])
    as_other = grpc.ssl_channel_credentials(root_certificates=ca_pem,
                                            private_key=other_key.read_bytes(),
                                            certificate_chain=other_cert.read_bytes())
    async with grpc.aio.secure_channel(endpoint, as_other) as chan:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in rollout_manager_pb2_grpc.RolloutManagerStub(chan).SubmitStep(
                    step_request(1, 4, prefix="o"), timeout=10):
                pass
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "urn:rlharvest:job:default" in err.value.details(), err.value.details()
    tls.configure(str(other_cert), str(other_key), str(ca.ca_path))
    agent = (await registry.list_members(etcd_client, "transfer_agent"))
    agent_endpoint = next(iter(agent.values()))["endpoint"]
    with pytest.raises(agent_client.PublishError) as publish_err:
        await agent_client.publish(agent_endpoint, "default", 99,
                                   {"w": torch.zeros(4)}, bucket_bytes=1 << 20)
    assert publish_err.value.code == grpc.StatusCode.PERMISSION_DENIED
    assert "urn:rlharvest:job:default" in str(publish_err.value)
    tls.configure(*(str(p) for p in ca.issue("test-trainer-again", "trainer")),
                  str(ca.ca_path))

    rogue = tls.issue_certificates(tmp_path / "rogue", ["client"])["client"]
    for credentials in (
            None,  # plaintext
            grpc.ssl_channel_credentials(root_certificates=ca_pem),  # no client certificate
            grpc.ssl_channel_credentials(root_certificates=ca_pem,  # another CA's certificate
                                         private_key=rogue[1].read_bytes(),
                                         certificate_chain=rogue[0].read_bytes())):
        assert await refused(endpoint, credentials) == grpc.StatusCode.UNAVAILABLE

    # The HTTP side is HTTPS: /metrics wants a client certificate of the CA; /healthz, which
    # a kubelet probe reads, does not.
    base = f"https://127.0.0.1:{manager.metrics_port}"
    with urllib.request.urlopen(f"{base}/metrics", context=tls.client_ssl_context(),
                                timeout=5) as reply:
        assert b"rlh_manager_tokens_total" in reply.read()
    without_cert = ssl.create_default_context(cafile=str(ca.ca_path))
    with pytest.raises(urllib.error.HTTPError) as refused_http:
        urllib.request.urlopen(f"{base}/metrics", context=without_cert, timeout=5)
    assert refused_http.value.code == 403
    with urllib.request.urlopen(f"{base}/healthz", context=without_cert, timeout=5) as reply:
        assert reply.status == 200
    with urllib.request.urlopen(f"{base}/readyz", context=without_cert, timeout=5) as reply:
        assert reply.status == 200  # the leader: ready, and a probe needs no certificate
    with pytest.raises((urllib.error.URLError, ConnectionError)):  # plaintext: no answer
        urllib.request.urlopen(f"http://127.0.0.1:{manager.metrics_port}/healthz", timeout=5)

    # Prometheus scrapes the TLS stack with a certificate of the CA (rlharvest up --tls
    # --prometheus does the same).
    cert, key = ca.issue("prometheus", "metrics")
    scraper = LocalPrometheus(etcd_endpoint, tmp_path / "prometheus", port=free_port(),
                              tls=TlsFiles(cert, key, ca.ca_path)).start()
    try:
        deadline = time.monotonic() + 60
        while not scraper.query('up{service="rollout_manager"} == 1'):
            assert time.monotonic() < deadline, scraper.query("up")
            await asyncio.sleep(0.5)
    finally:
        scraper.stop()
