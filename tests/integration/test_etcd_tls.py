"""etcd with mutual TLS (a real etcd of its own, ``LocalEtcd(ca=...)``, as `rlharvest up --tls`
runs it): a client with a certificate of the CA reads and writes over an ``https://``
endpoint; plaintext, no client certificate or another CA's certificate is refused; an
``https://`` endpoint without TLS settings is refused naming them, before any dial; a real
service registers over TLS, and ``rlharvest status`` with ``--tls-*`` lists it."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import aetcd.exceptions
import grpc
import pytest

from rlharvest.common import keys, registry, tls
from rlharvest.common.config import ConfigError
from rlharvest.common.local_etcd import LocalEtcd
from rlharvest.cli.launcher import LocalStack

pytestmark = pytest.mark.integration
CLI = [sys.executable, "-m", "rlharvest.cli.main"]
ENV = {**os.environ, "COLUMNS": "240", "TERM": "dumb", "NO_COLOR": "1"}


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> tls.LocalCA:
    return tls.LocalCA(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def tls_etcd(ca: tls.LocalCA) -> Iterator[LocalEtcd]:
    with LocalEtcd(ca=ca) as server:
        yield server


@pytest.fixture
def operator(ca: tls.LocalCA) -> Iterator[list[str]]:
    """This test process dials as an operator of the CA (plaintext again afterwards, for the
    tests that follow); yields the flags that give `rlharvest status` the same identity."""
    cert, key = ca.issue("test-operator", "operator")
    tls.configure(str(cert), str(key), str(ca.ca_path))
    yield ca.flags_of(cert, key)
    tls.configure("", "", "")


@pytest.fixture
def stack(tls_etcd: LocalEtcd, ca: tls.LocalCA, fork_server, tmp_path: Path) -> Iterator[LocalStack]:
    """Services against the TLS etcd, each with a certificate of the CA for its role (the
    conftest hook shows their logs when a test fails)."""
    local = LocalStack(tmp_path / "logs", etcd=tls_etcd, ca=ca, fork_server=fork_server)
    yield local
    for proc in local.processes:
        proc.kill()


def plaintext() -> None:
    tls.configure("", "", "")


async def test_a_client_with_a_certificate_of_the_ca_reads_and_writes_over_https(
        tls_etcd, operator):
    assert tls_etcd.endpoint.startswith("https://127.0.0.1:")
    client = await registry.connect(tls_etcd.endpoint)
    try:
        await client.put(b"/rlharvest/tls-probe", b"over tls")
        assert (await client.get(b"/rlharvest/tls-probe")).value == b"over tls"
    finally:
        await client.close()


async def test_etcd_refuses_plaintext_no_client_certificate_and_another_cas_certificate(
        tls_etcd, ca, tmp_path):
    plaintext()
    with pytest.raises(ConnectionError, match="did not answer"):
        await registry.connect(tls_etcd.endpoint.removeprefix("https://"), timeout=2)

    target = registry.parse_endpoint(tls_etcd.endpoint)
    no_certificate = registry.AuthenticatingClient(
        host=target.host, port=target.port, timeout=2,
        channel_credentials=grpc.ssl_channel_credentials(root_certificates=ca.ca_path.read_bytes()))
    try:
        with pytest.raises(aetcd.exceptions.ConnectionFailedError):
            await no_certificate.status()
    finally:
        await no_certificate.close()

    rogue_cert, rogue_key = tls.LocalCA(tmp_path / "rogue").issue("rogue", "operator")
    tls.configure(str(rogue_cert), str(rogue_key), str(ca.ca_path))  # trusts etcd, not trusted
    try:
        with pytest.raises(ConnectionError, match="over TLS"):
            await registry.connect(tls_etcd.endpoint, timeout=2)
    finally:
        plaintext()


async def test_an_https_endpoint_without_tls_settings_is_refused_naming_them_before_dialing(
        tls_etcd):
    plaintext()
    with pytest.raises(ConfigError, match="is https: set tls_ca .* tls_cert and tls_key"):
        await registry.connect(tls_etcd.endpoint)
    shown = await asyncio.to_thread(subprocess.run, [*CLI, "status", "--etcd", tls_etcd.endpoint],
                                    capture_output=True, text=True, env=ENV, timeout=60)
    assert shown.returncode == 2, shown.stdout + shown.stderr
    assert "tls_ca" in shown.stderr and "Traceback" not in shown.stderr


async def test_a_service_registers_over_tls_and_status_with_a_certificate_lists_it(
        stack, tls_etcd, operator):
    manager = stack.start("rollout_manager", "manager-tls", ["--manager-id", "manager-tls",
                                                             "--lease-ttl", "2"])
    client = await registry.connect(tls_etcd.endpoint)
    try:
        key = keys.member_key("rollout_manager", "manager-tls")
        deadline = time.monotonic() + 60
        while key not in await registry.list_members(client):
            assert manager.alive(), manager.log_tail()
            assert time.monotonic() < deadline, "the manager never registered"
            await asyncio.sleep(0.2)
    finally:
        await client.close()
    shown = await asyncio.to_thread(
        subprocess.run, [*CLI, "status", "--etcd", tls_etcd.endpoint, *operator],
        capture_output=True, text=True, env=ENV, timeout=60)
    assert shown.returncode == 0, shown.stdout + shown.stderr
    assert "manager-tls" in shown.stdout, shown.stdout

