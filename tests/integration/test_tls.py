"""Mutual TLS (``common/tls.py``) on real processes: a manager and a worker started with a CA's
certificates talk to each other over TLS and run a step; a client with a certificate from the
same CA gets in, and one without a certificate, with only the CA, or with a certificate from
another CA is refused at the handshake."""

from __future__ import annotations

import grpc
import pytest

from rlharvest.common import tls
from rlharvest.common.local_etcd import free_port
from rlharvest.common.pb import rollout_manager_pb2 as mpb, rollout_manager_pb2_grpc
from rlharvest.services.rollout_manager.status_client import wait_workers

from .test_manager import run_step, step_request
from .worker_client import launch_worker

pytestmark = pytest.mark.integration


def tls_flags(certs: dict, name: str, ca) -> list[str]:
    cert, key = certs[name]
    return ["--tls-cert", str(cert), "--tls-key", str(key), "--tls-ca", str(ca)]


@pytest.fixture
def as_client(tmp_path):
    """The test process's own channels (rpc.channel) dial with a client certificate; plaintext
    again afterwards, for the tests that follow."""
    certs = tls.issue_certificates(tmp_path / "pki", ["manager", "worker", "client"])
    cert, key = certs["client"]
    tls.configure(str(cert), str(key), str(tmp_path / "pki" / "ca.pem"))
    yield certs, tmp_path / "pki" / "ca.pem"
    tls.configure("", "", "")


async def refused(endpoint: str, credentials: grpc.ChannelCredentials | None) -> grpc.StatusCode:
    chan = grpc.aio.insecure_channel(endpoint) if credentials is None else \
        grpc.aio.secure_channel(endpoint, credentials)
    async with chan:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await rollout_manager_pb2_grpc.RolloutManagerStub(chan).GetStatus(
                mpb.GetStatusRequest(), timeout=5)
    return err.value.code()


async def test_with_mutual_tls_only_peers_holding_a_certificate_of_the_ca_get_in(
        stack, as_client, tmp_path):
    certs, ca = as_client
    launch_worker(stack, "tls-worker", "--max-running", "4", *tls_flags(certs, "worker", ca))
    port = free_port()
    stack.start("rollout_manager", "manager", ["--port", str(port), "--metrics-port",
                                               str(free_port()), "--lease-ttl", "2",
                                               *tls_flags(certs, "manager", ca)])
    endpoint = f"127.0.0.1:{port}"
    # The manager dialled the worker's session over TLS with its own certificate...
    await wait_workers(endpoint, names=["tls-worker"], timeout=120)
    done = await run_step(endpoint, step_request(4, 8))  # ...and a step runs through both
    assert len(done) == 4 and all(not c.failed and c.token_ids for c in done.values())

    ca_pem = ca.read_bytes()
    rogue = tls.issue_certificates(tmp_path / "rogue", ["client"])["client"]
    for credentials in (
            None,  # plaintext
            grpc.ssl_channel_credentials(root_certificates=ca_pem),  # no client certificate
            grpc.ssl_channel_credentials(root_certificates=ca_pem,  # another CA's certificate
                                         private_key=rogue[1].read_bytes(),
                                         certificate_chain=rogue[0].read_bytes())):
        assert await refused(endpoint, credentials) == grpc.StatusCode.UNAVAILABLE
