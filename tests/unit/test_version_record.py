"""An engine host's member record follows the weight version its engine serves, even when a
write is lost to etcd or the version changes before the host registered. etcd's put is stood
in for (the project's Membership writes through it)."""

from __future__ import annotations

import asyncio

from rlharvest.common.registry import Membership
from rlharvest.common.worker_core.version_record import VersionRecord

from ..builders import FlakyEtcd, stub_membership


def membership(etcd: FlakyEtcd) -> Membership:
    return stub_membership(etcd, "/members/rollout_worker/w0", {"weight_version": 0})


async def settle(record: VersionRecord) -> None:
    for _ in range(200):
        if record._task is None or record._task.done():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the version record never settled")


async def test_a_version_whose_write_etcd_lost_reaches_the_record_once_etcd_answers():
    etcd = FlakyEtcd(failures=2)
    member, served = membership(etcd), [0]
    record = VersionRecord(lambda: member, lambda: served[0], lambda: "f0", retry_s=0.01)
    try:
        served[0] = 1
        record.changed(1)
        await settle(record)
        assert etcd.records == [{"weight_version": 1, "start_weights": "f0"}]
    finally:
        await record.close()
        member._keepalive.cancel()


async def test_a_version_loaded_before_the_registration_reaches_the_record_after_it():
    etcd = FlakyEtcd()
    registered: list[Membership] = []
    served = [3]
    record = VersionRecord(lambda: registered[0] if registered else None, lambda: served[0],
                           lambda: "f0")
    try:
        record.changed(3)
        await asyncio.sleep(0.1)  # a standby still pulling: nothing to write to yet
        registered.append(membership(etcd))
        await settle(record)
        assert etcd.records == [{"weight_version": 3, "start_weights": "f0"}]
    finally:
        await record.close()
        for member in registered:
            member._keepalive.cancel()


async def test_versions_swapped_while_one_is_written_end_with_the_newest_in_the_record():
    etcd = FlakyEtcd(failures=1)
    member, served = membership(etcd), [1]
    record = VersionRecord(lambda: member, lambda: served[0], lambda: "f0", retry_s=0.05)
    try:
        record.changed(1)
        while etcd.failures:  # the write of version 1 is lost first
            await asyncio.sleep(0)
        for version in (2, 3):  # while that write waits to try again
            served[0] = version
            record.changed(version)
        await settle(record)
        assert etcd.records[-1] == {"weight_version": 3, "start_weights": "f0"}
        assert len(etcd.records) == 1  # the lost write was not of a stale version
    finally:
        await record.close()
        member._keepalive.cancel()
