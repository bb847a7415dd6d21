"""etcd's peer port, attacked as a process on the same host would: etcd 3.4 serves its whole v3
API there, so under TLS it must take nothing but etcd's own peer certificate. Plaintext, no
certificate, another CA's and a service's certificate of the right CA are all refused a read and
a write there, while the same service certificate reads on the client port and etcd's peer
certificate gets the peer API's answer."""

from __future__ import annotations

import ssl
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import aetcd.rpc
import grpc
import pytest

from rlharvest.common.local_etcd import LocalEtcd, free_ports
from rlharvest.common.tls import LocalCA, issue_certificates

pytestmark = pytest.mark.integration
KEY = b"/rlharvest/v1/members/rollout_worker/planted"


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    ca = LocalCA(tmp_path_factory.mktemp("pki"))
    with LocalEtcd(ca=ca) as etcd:
        yield etcd, ca, tmp_path_factory.mktemp("rogue")


def _credentials(ca_pem: bytes, cert: tuple | None) -> grpc.ChannelCredentials:
    if cert is None:
        return grpc.ssl_channel_credentials(root_certificates=ca_pem)
    cert_path, key_path = cert
    return grpc.ssl_channel_credentials(root_certificates=ca_pem,
                                        private_key=key_path.read_bytes(),
                                        certificate_chain=cert_path.read_bytes())


async def _read_and_write(target: str, credentials: grpc.ChannelCredentials | None) -> None:
    """A read, then a write of KEY, on etcd's KV API at ``target``; raises what etcd says."""
    channel = grpc.aio.insecure_channel(target) if credentials is None else \
        grpc.aio.secure_channel(target, credentials)
    async with channel:
        kv = aetcd.rpc.KVStub(channel)
        await kv.Range(aetcd.rpc.RangeRequest(key=b"/rlharvest/", range_end=b"/rlharvest0"),
                       timeout=5)
        await kv.Put(aetcd.rpc.PutRequest(key=KEY, value=b"{}"), timeout=5)


def _rogue_ca_certificate(directory) -> tuple:
    """A certificate of another CA, with the very name etcd's peers carry."""
    return LocalCA(directory).issue("etcd-peer", "etcd")


@pytest.mark.parametrize("caller", ["plaintext", "no certificate", "another CA's etcd-peer",
                                    "a worker's certificate of the CA"])
async def test_the_peer_port_refuses_every_caller_but_etcds_own_peers(etcd, caller) -> None:
    server, ca, rogue_dir = etcd
    ca_pem = ca.ca_path.read_bytes()
    credentials = {
        "plaintext": None,
        "no certificate": _credentials(ca_pem, None),
        "another CA's etcd-peer": _credentials(ca_pem, _rogue_ca_certificate(rogue_dir)),
        "a worker's certificate of the CA": _credentials(ca_pem, ca.issue("worker-0",
                                                                          "worker")),
    }[caller]
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await _read_and_write(f"127.0.0.1:{server.peer_port}", credentials)
    assert refused.value.code() in (grpc.StatusCode.UNAVAILABLE,
                                    grpc.StatusCode.PERMISSION_DENIED), refused.value
    # Nothing was written: the client port, with the operator's certificate, sees no key.
    operator = _credentials(ca_pem, ca.issue("operator", "operator"))
    async with grpc.aio.secure_channel(f"127.0.0.1:{server.client_port}", operator) as channel:
        found = await aetcd.rpc.KVStub(channel).Range(aetcd.rpc.RangeRequest(key=KEY), timeout=5)
    assert found.count == 0


async def test_the_same_worker_certificate_reads_and_writes_on_the_client_port(etcd) -> None:
    """The control: the refusals above are the peer port's, not a broken certificate."""
    server, ca, _ = etcd
    credentials = _credentials(ca.ca_path.read_bytes(), ca.issue("worker-1", "worker"))
    await _read_and_write(f"127.0.0.1:{server.client_port}", credentials)
    assert server.peer_url.startswith("https://")


@pytest.mark.parametrize("holder, answered", [("etcd-peer", True), ("worker-2", False)])
def test_the_peer_api_answers_etcds_peer_certificate_only(etcd, holder, answered) -> None:
    """The peer API itself (GET /members, what another member asks): the peer certificate gets
    the member list, a worker's certificate of the same CA the handshake's refusal."""
    server, ca, _ = etcd
    # etcd's own peer certificate, as LocalEtcd issued it; a worker's, issued now.
    cert, key = (ca.directory / "etcd-peer.pem", ca.directory / "etcd-peer.key") \
        if holder == "etcd-peer" else ca.issue(holder, "worker")
    context = ssl.create_default_context(cafile=str(ca.ca_path))
    context.load_cert_chain(str(cert), str(key))
    try:
        with urllib.request.urlopen(f"{server.peer_url}/members", context=context,
                                    timeout=5) as reply:
            got = reply.status == 200 and b"peerURLs" in reply.read()
    except ssl.SSLError as refused:
        assert "BAD_CERTIFICATE" in str(refused)
        got = False
    assert got is answered


def test_the_shipped_etcd_config_serves_tls_and_its_peer_port_refuses_a_services_certificate(
        tmp_path) -> None:
    """deploy/etcd/etcd.conf.yml as shipped, its paths and ports moved under tmp_path: etcd
    starts on it, answers a service's certificate on the client port, and its peer port (a CA
    of the peers' own) refuses that certificate and answers the peer certificate."""
    client_port, peer_port = free_ports(2)
    text = (Path(__file__).parents[2] / "deploy/etcd/etcd.conf.yml").read_text()
    text = text.replace("/etc/rlharvest", str(tmp_path)).replace(
        "/var/lib/etcd/rlharvest", str(tmp_path / "data")).replace(
        ":2379", f":{client_port}").replace(":2380", f":{peer_port}")
    config = tmp_path / "etcd.conf.yml"
    config.write_text(text)
    services = issue_certificates(tmp_path / "pki", ["etcd", "worker-0"],
                                  roles={"worker-0": "worker"})
    peers = issue_certificates(tmp_path / "etcd-peer", ["etcd-peer"])
    etcd = subprocess.Popen(["etcd", "--config-file", str(config)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        worker = _context(tmp_path / "pki" / "ca.pem", services["worker-0"])
        assert _get(f"https://127.0.0.1:{client_port}/health", worker, wait_s=20)
        peer_ca = tmp_path / "etcd-peer" / "ca.pem"
        assert _get(f"https://127.0.0.1:{peer_port}/members", _context(peer_ca, peers["etcd-peer"]))
        assert not _get(f"https://127.0.0.1:{peer_port}/members",
                        _context(peer_ca, services["worker-0"]))
    finally:
        etcd.terminate()
        etcd.wait(10)


def _context(ca: Path, cert: tuple[Path, Path]) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(ca))
    context.load_cert_chain(str(cert[0]), str(cert[1]))
    return context


def _get(url: str, context: ssl.SSLContext, wait_s: float = 0.0) -> bool:
    """Whether ``url`` answers 200 with this identity; retried for ``wait_s`` (etcd starting)
    only while nothing listens yet."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            with urllib.request.urlopen(url, context=context, timeout=5) as reply:
                return reply.status == 200
        except (ssl.SSLError, ConnectionResetError):
            return False  # the handshake refused: a verdict, not etcd starting
        except urllib.error.URLError as exc:
            if isinstance(exc.reason, ssl.SSLError | ConnectionResetError):
                return False
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
