"""etcd maintenance on a real etcd (``etcd_maintenance.EtcdMaintainer``, its clock injected):
old revisions are compacted away, a mostly free file is defragmented to its size in use, two
maintainers of one etcd do no harm, compaction goes on across SIGKILLs of etcd, a service's
etcd role may compact but not defragment (why the maintainer runs as an admin), and
``rlharvest etcd-maintain`` does it as a process of its own."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
from functools import partial

import aetcd
import aetcd.rpc
import grpc
import pytest

from rlharvest.common import observability, registry, tls
from rlharvest.common.etcd_outage import with_etcd
from rlharvest.common.etcd_maintenance import (
    EtcdMaintainer, MaintenanceConfig, etcd_status, already_compacted)
from rlharvest.common.local_etcd import LocalEtcd, free_port
from rlharvest.cli.launcher import LocalStack

pytestmark = pytest.mark.integration
CONFIG = MaintenanceConfig(retention_s=100, compact_every_s=10, defrag_free_share=0.5,
                           defrag_min_free_bytes=256 * 1024, defrag_every_s=0)


class StepClock:
    """Each reading 50 s after the last: every round of the maintainer is a minute apart."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 50.0
        return self.now


@pytest.fixture
def etcd():
    with LocalEtcd() as server:  # its own: compacting the session's would hurt other tests
        yield server


async def _write(client: aetcd.Client, count: int, size: int = 10_000) -> int:
    """``count`` revisions of one key; returns the last revision."""
    for i in range(count):
        await client.put(b"/maintenance-test/key", bytes([i % 256]) * size)
    return (await etcd_status(client, 0)).revision


async def test_old_revisions_are_compacted_and_a_mostly_free_file_defragmented(etcd) -> None:
    client = await registry.connect(etcd.endpoint)
    try:
        maintainer = EtcdMaintainer(partial(registry.connect, etcd.endpoint), CONFIG,
                                    clock=StepClock())
        old = await _write(client, 300)  # 300 revisions of 10 kB: ~3 MB of history
        await maintainer.round()  # sampled at 50 s
        await maintainer.round()  # 100 s: nothing old enough yet
        before = await etcd_status(client, 0)
        await maintainer.round()  # 150 s: compacts to the revision sampled at 50 s
        for _ in range(3):  # etcd counts the freed pages free after its next writes
            await asyncio.sleep(0.3)
            await client.put(b"/maintenance-test/other", b"x")
        await maintainer.round()  # 200 s: the file is mostly free: defragment
        after = await etcd_status(client, 0)
        assert maintainer.policy.compacted == old and maintainer.compactions == 1
        with pytest.raises(grpc.aio.AioRpcError, match="compacted"):
            await client.kvstub.Range(aetcd.rpc.RangeRequest(key=b"/maintenance-test/key",
                                                             revision=old - 1))
        assert maintainer.defrags == 1 and after.db_bytes < before.db_bytes / 2
    finally:
        await client.close()


async def test_two_maintainers_of_one_etcd_do_no_harm(etcd) -> None:
    connect = partial(registry.connect, etcd.endpoint)
    first, second = (EtcdMaintainer(connect, CONFIG, clock=StepClock()) for _ in range(2))
    client = await connect()
    try:
        for _ in range(4):
            await _write(client, 5)
            await first.round()
            await second.round()  # the same revision, already compacted: refused, harmless
        assert first.policy.compacted == second.policy.compacted > 0
        with pytest.raises(aetcd.ClientError) as refused:
            await client.compact(first.policy.compacted)
        assert already_compacted(refused.value)
    finally:
        await client.close()


async def test_compaction_goes_on_while_etcd_is_sigkilled_between_rounds(etcd) -> None:
    """etcd's own periodic compactor restarts its clock with etcd; this one keeps its own."""
    maintainer = EtcdMaintainer(partial(registry.connect, etcd.endpoint), CONFIG, period_s=0.1,
                                clock=StepClock())
    task = asyncio.create_task(maintainer.run())
    try:
        for _ in range(4):
            # A restarted etcd may refuse a moment more under load: waited out, as services do.
            client = await with_etcd(partial(registry.connect, etcd.endpoint), "connecting",
                                     deadline_s=30)
            await _write(client, 5)
            await client.close()
            await asyncio.to_thread(etcd.restart, crash=True, down_s=1.0)
            await asyncio.sleep(0.5)
        while maintainer.compactions < 3:
            await asyncio.sleep(0.1)
    finally:
        task.cancel()


async def test_a_service_role_may_compact_but_only_the_root_role_defragment(tmp_path) -> None:
    ca = tls.LocalCA(tmp_path / "pki")
    cert, key = ca.issue("test-operator", "operator")
    tls.configure(str(cert), str(key), str(ca.ca_path))
    stack = LocalStack(tmp_path / "logs", ca=ca, etcd_roles=True, etcd_admin="test-operator")
    try:
        await asyncio.to_thread(stack.start_etcd)
        worker_cert, worker_key = ca.issue("worker-x", "worker")
        await asyncio.to_thread(stack.add_etcd_user, "worker-x", "worker")
        assert stack.etcd is not None
        credentials = grpc.ssl_channel_credentials(
            ca.ca_path.read_bytes(), worker_key.read_bytes(), worker_cert.read_bytes())
        async with grpc.aio.secure_channel(f"127.0.0.1:{stack.etcd.client_port}",
                                           credentials) as channel:
            status = await aetcd.rpc.MaintenanceStub(channel).Status(aetcd.rpc.StatusRequest())
            await aetcd.rpc.KVStub(channel).Compact(
                aetcd.rpc.CompactionRequest(revision=status.header.revision))
            with pytest.raises(grpc.aio.AioRpcError, match="permission denied"):
                await aetcd.rpc.MaintenanceStub(channel).Defragment(
                    aetcd.rpc.DefragmentRequest())
        admin = await registry.connect(stack.etcd.endpoint)  # the operator: root
        try:
            await admin.defragment()
        finally:
            await admin.close()
    finally:
        stack.stop()
        tls.configure("", "", "")


async def test_rlharvest_etcd_maintain_compacts_serves_its_metrics_and_stops_on_sigterm(
        etcd) -> None:
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "rlharvest.cli.main", "etcd-maintain", "--etcd", etcd.endpoint,
         "--keep-s", "1", "--compact-every-s", "1", "--period-s", "0.2", "--metrics-port",
         str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    client = await registry.connect(etcd.endpoint)
    try:
        compactions = 0.0
        while compactions < 2:
            assert process.poll() is None, process.communicate()[0]
            await _write(client, 2, size=10)
            await asyncio.sleep(0.5)
            with contextlib.suppress(OSError):
                text = await asyncio.to_thread(observability.scrape, f"127.0.0.1:{port}", 1)
                compactions = observability.sample(text, "rlh_etcd_compactions_total")
                assert observability.sample(text, "rlh_etcd_db_bytes") > 0
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0, process.communicate()[0]
    finally:
        await client.close()
        if process.poll() is None:
            process.kill()
