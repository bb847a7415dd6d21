"""etcd with authentication enabled (a real etcd of its own): a service given ``etcd_username``
and ``etcd_password`` (RLH_ env) registers and serves, and goes on through an etcd restart (which
drops every auth token) on renewed tokens; one with a wrong password stops at start saying etcd
refused the user; a client without credentials may write nothing."""

from __future__ import annotations

import asyncio
import time

import aetcd
import aetcd.rpc
import pytest

from rlharvest.common import keys, registry
from rlharvest.common.local_etcd import LocalEtcd, free_port
from rlharvest.cli.launcher import LocalStack
from rlharvest.services.rollout_manager.client import wait_workers

pytestmark = pytest.mark.integration
PASSWORD = "s3cret-for-tests"


async def enable_auth(endpoint: str) -> None:
    target = registry.parse_endpoint(endpoint)
    client = aetcd.Client(host=target.host, port=target.port)
    await client.connect()
    try:
        auth = aetcd.rpc.AuthStub(client.channel)
        await auth.UserAdd(aetcd.rpc.AuthUserAddRequest(name="root", password=PASSWORD))
        await auth.UserGrantRole(aetcd.rpc.AuthUserGrantRoleRequest(user="root", role="root"))
        await auth.AuthEnable(aetcd.rpc.AuthEnableRequest())
    finally:
        await client.close()


@pytest.fixture
def authed_etcd():
    with LocalEtcd() as server:
        asyncio.run(enable_auth(server.endpoint))
        yield server
    registry.use_credentials("", "")


async def test_services_authenticate_to_etcd_and_a_wrong_password_stops_at_start(
        authed_etcd, fork_server, tmp_path):
    stack = LocalStack(tmp_path / "logs", etcd=authed_etcd, fork_server=fork_server)
    try:
        credentials = {"RLH_ETCD_USERNAME": "root", "RLH_ETCD_PASSWORD": PASSWORD,
                       "RLH_ETCD_TOKEN_RENEW_S": "0.5"}
        port = free_port()
        good = stack.start("rollout_manager", "manager-ok",
                           ["--manager-id", "manager-ok", "--port", str(port)], env=credentials)
        bad = stack.start("rollout_manager", "manager-bad", ["--manager-id", "manager-bad"],
                          env={"RLH_ETCD_USERNAME": "root", "RLH_ETCD_PASSWORD": "wrong"})
        registry.use_credentials("root", PASSWORD)
        client = await registry.connect(authed_etcd.endpoint)
        try:
            key = keys.member_key("rollout_manager", "manager-ok")
            deadline = time.monotonic() + 60
            while key not in await registry.list_members(client):
                assert good.alive(), good.log_tail()
                assert time.monotonic() < deadline, "the manager never registered"
                await asyncio.sleep(0.2)
            # The wrong password must meet a running etcd: wait for it to stop before the restart,
            # or its refusal races the restart and reads as "etcd did not answer".
            assert await asyncio.to_thread(bad.process.wait, 60) != 0
            assert "refused user 'root'" in bad.log_path.read_text()
            # etcd restarts and forgets every auth token; the manager's worker watch breaks and
            # it lists again: it sees a worker that joins afterwards only with a renewed token.
            await asyncio.to_thread(authed_etcd.restart)
            stack.start("rollout_worker", "w0", ["--worker-id", "w0", "--torch-threads", "1"],
                        env=credentials)
            await wait_workers(f"127.0.0.1:{port}", names=["w0"], timeout=60)
            assert good.alive(), good.log_tail()
        finally:
            await client.close()
        registry.use_credentials("", "")
        anonymous = await registry.connect(authed_etcd.endpoint)
        try:
            with pytest.raises(aetcd.exceptions.InvalidArgumentError, match="user name is empty"):
                await anonymous.put(b"/rlharvest/x", b"1")
        finally:
            await anonymous.close()
    finally:
        stack.stop(timeout=10)
