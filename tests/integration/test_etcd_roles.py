"""etcd's users and roles under TLS (``etcd_roles.py``), on a real etcd and real services: a
whole job trains with every service writing as its certificate's etcd user, while a worker's
certificate, tried as an attacker would, may read everything and write its own membership and
pairing but not a manager's election, a lending claim, the placement state, another service's
membership or a job's records; a certificate of the CA that names no user writes nothing."""

from __future__ import annotations

import asyncio

import aetcd.rpc
import grpc
import pytest

from rlharvest.common import etcd_roles, keys, tls
from rlharvest.cli.launcher import LocalStack

from .test_trainer import start_job, start_trainer, wait_trainer

pytestmark = pytest.mark.integration
OPERATOR = "test-operator"


def _roles_stack(directory, fork_server=None):
    """A stack of its own: its etcd under TLS with the roles installed, this process acting on
    it as an operator (etcd's root role)."""
    ca = tls.LocalCA(directory / "pki")
    cert, key = ca.issue(OPERATOR, "operator")
    tls.configure(str(cert), str(key), str(ca.ca_path))
    local = LocalStack(directory / "logs", ca=ca, fork_server=fork_server, etcd_roles=True,
                       etcd_admin=OPERATOR)
    try:
        local.start_etcd()
        yield local
    finally:
        local.stop()
        tls.configure("", "", "")


@pytest.fixture
def stack(fork_server, tmp_path):
    yield from _roles_stack(tmp_path, fork_server)


@pytest.fixture(scope="module")
def etcd_alone(tmp_path_factory):
    """The same, with no service: what the attacks below hit."""
    yield from _roles_stack(tmp_path_factory.mktemp("roles"))


async def test_a_job_trains_with_every_service_writing_as_its_etcd_user(stack) -> None:
    await start_job(stack, 1)
    trainer, _ = await start_trainer(stack, "trainer", "--steps", "2", "--backend", "torch")
    status = await wait_trainer(trainer, lambda s: s.state in ("done", "failed"))
    assert status.state == "done" and status.weight_version == 2, status.error


def _as(stack: LocalStack, name: str, role: str, user: bool = True) -> grpc.ChannelCredentials:
    """A certificate of the CA for ``name`` in ``role``; with ``user``, ``name`` is also an etcd
    user of that role, as LocalStack makes each service it starts."""
    assert stack.ca is not None
    cert, key = stack.ca.issue(name, role)
    if user:
        stack.add_etcd_user(name, role)
    return grpc.ssl_channel_credentials(stack.ca.ca_path.read_bytes(), key.read_bytes(),
                                        cert.read_bytes())


async def _put(stack: LocalStack, credentials: grpc.ChannelCredentials, key: str) -> None:
    assert stack.etcd is not None
    async with grpc.aio.secure_channel(f"127.0.0.1:{stack.etcd.client_port}",
                                       credentials) as channel:
        await aetcd.rpc.KVStub(channel).Put(aetcd.rpc.PutRequest(key=key.encode(), value=b"{}"),
                                            timeout=5)


async def _count(stack: LocalStack, credentials: grpc.ChannelCredentials) -> int:
    assert stack.etcd is not None
    root = (keys.ROOT + "/").encode()
    async with grpc.aio.secure_channel(f"127.0.0.1:{stack.etcd.client_port}",
                                       credentials) as channel:
        reply = await aetcd.rpc.KVStub(channel).Range(aetcd.rpc.RangeRequest(
            key=root, range_end=etcd_roles.prefix_end(root), count_only=True), timeout=5)
    return reply.count


FORBIDDEN_TO_A_WORKER = [
    keys.election_prefix(keys.manager_election("default")) + "7f00",
    keys.election_prefix(keys.PLACEMENT_ELECTION) + "7f00",
    keys.lending_key("coexec-0"),
    keys.placement_state_key("meta"),
    keys.member_key("rollout_manager", "manager-0"),
    keys.member_key("transfer_agent", "agent-0"),
    keys.instance_cap_key("default"),
    keys.start_weights_key("default"),
    keys.weights_announced_key("default"),
]


@pytest.mark.parametrize("key", FORBIDDEN_TO_A_WORKER)
async def test_a_workers_certificate_may_not_write_another_roles_keys(etcd_alone, key) -> None:
    worker = _as(etcd_alone, "worker-x", "worker")
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await _put(etcd_alone, worker, key)
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED, refused.value


async def test_a_workers_certificate_reads_all_and_writes_its_membership_and_pairing(
        etcd_alone) -> None:
    worker = _as(etcd_alone, "worker-y", "worker")
    await _put(etcd_alone, worker, keys.member_key("rollout_worker", "worker-y"))
    await _put(etcd_alone, worker, keys.pairing_key("worker-y"))
    assert await _count(etcd_alone, worker) >= 2


async def test_a_certificate_of_the_ca_naming_no_user_writes_nothing(etcd_alone) -> None:
    stranger = _as(etcd_alone, "stranger", "worker", user=False)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await _put(etcd_alone, stranger, keys.member_key("rollout_worker", "stranger"))
    assert refused.value.code() in (grpc.StatusCode.PERMISSION_DENIED,
                                    grpc.StatusCode.INVALID_ARGUMENT), refused.value


def test_the_etcd_roles_command_installs_the_roles_on_a_plain_tls_etcd(tmp_path) -> None:
    """`rlharvest etcd-roles`, as an operator runs it on a production etcd: after it, the
    users it named write their own keys only, and a bad --user is refused before any call."""
    import subprocess
    import sys

    from rlharvest.common.local_etcd import LocalEtcd

    ca = tls.LocalCA(tmp_path)
    op_cert, op_key = ca.issue("operator", "operator")
    cli = [sys.executable, "-m", "rlharvest.cli.main", "etcd-roles", "--tls-cert", str(op_cert),
           "--tls-key", str(op_key), "--tls-ca", str(ca.ca_path)]
    with LocalEtcd(ca=ca) as etcd:
        bad = subprocess.run([*cli, "--etcd", etcd.endpoint, "--user", "w=wizard"],
                             capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and "NAME=ROLE" in bad.stderr
        done = subprocess.run([*cli, "--etcd", etcd.endpoint, "--install", "--admin",
                               "operator", "--user", "worker-z=worker"],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        stack = LocalStack(tmp_path / "logs", etcd=etcd, ca=ca)
        worker = _as(stack, "worker-z", "worker", user=False)  # the command made the user
        asyncio.run(_put(stack, worker, keys.member_key("rollout_worker", "worker-z")))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            asyncio.run(_put(stack, worker, keys.lending_key("coexec-0")))
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
