"""Membership, lease expiry after SIGKILL, watch events and election failover on a real etcd."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlharvest.common import keys, registry
from rlharvest.common.local_etcd import LocalEtcd

pytestmark = pytest.mark.integration
HELPER = Path(__file__).with_name("member_process.py")


def _spawn(endpoint: str, mode: str, name: str, ttl: int = 2) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, str(HELPER), endpoint, mode, name, str(ttl)],
                            stdout=subprocess.PIPE, text=True)
    return proc


async def _ready(proc: subprocess.Popen) -> None:
    line = await asyncio.to_thread(proc.stdout.readline)
    assert line.strip() == "ready", f"helper process did not start: {line!r}"


async def test_member_key_disappears_within_ttl_after_sigkill(etcd_client, etcd_endpoint):
    proc = _spawn(etcd_endpoint, "member", "victim", ttl=2)
    try:
        await _ready(proc)
        key = keys.member_key("rollout_worker", "victim")
        assert key in await registry.list_members(etcd_client, "rollout_worker")
        await asyncio.sleep(3)  # longer than the TTL: keepalives must hold the key
        assert key in await registry.list_members(etcd_client, "rollout_worker")
        proc.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        while key in await registry.list_members(etcd_client, "rollout_worker"):
            # The bound is the claim (the 2 s TTL), plus 3 s for etcd's expiry sweep and a busy
            # machine: a key whose lease did not expire would outlive it by far.
            assert time.monotonic() - killed_at < 2 + 3, "key outlived its lease"
            await asyncio.sleep(0.1)
    finally:
        proc.kill()
        proc.wait()


async def test_watch_reports_join_update_and_leave(etcd_client):
    before = await registry.register(etcd_client, "rollout_worker", "early", {"v": 0}, ttl=5)
    events: list[registry.MemberEvent] = []

    async def consume():
        async for event in registry.watch_members(etcd_client, "rollout_worker"):
            events.append(event)

    task = asyncio.create_task(consume())
    try:
        later = await registry.register(etcd_client, "rollout_worker", "late", {"v": 0}, ttl=5)
        await later.update(v=1)
        await before.close()
        await _until(lambda: len(events) >= 4, timeout=30)
        summary = [(e.kind, e.member_id, e.info.get("v")) for e in events]
        assert summary == [("join", "early", 0), ("join", "late", 0), ("update", "late", 1),
                           ("leave", "early", None)]
        await later.close()
    finally:
        task.cancel()


async def test_a_broken_member_record_is_skipped_and_discovery_of_the_others_goes_on(
        etcd_client):
    """A record some other writer broke (no JSON object) is ignored with a warning, in a
    listing and in a watch, instead of ending everyone's discovery."""
    broken = keys.member_key("co_executor", "broken")
    good = await registry.register(etcd_client, "co_executor", "good", {"v": 0}, ttl=5)
    events: list[registry.MemberEvent] = []

    async def consume():
        async for event in registry.watch_members(etcd_client, "co_executor"):
            events.append(event)

    try:
        await etcd_client.put(broken.encode(), b"{half a rec")
        assert list(await registry.list_members(etcd_client, "co_executor")) == [good.key]
        task = asyncio.create_task(consume())
        await _until(lambda: events, timeout=30)  # listed: what follows comes as changes
        await etcd_client.put(broken.encode(), b"[1, 2]")  # JSON, but no record either
        later = await registry.register(etcd_client, "co_executor", "later", {"v": 1}, ttl=5)
        await _until(lambda: len(events) >= 2, timeout=30)
        assert [(e.kind, e.member_id) for e in events] == [("join", "good"), ("join", "later")]
        assert not task.done()  # the watch goes on
        task.cancel()
        await later.close()
    finally:
        await etcd_client.delete(broken.encode())
        await good.close()


async def test_election_fails_over_when_leader_is_sigkilled(etcd_client, etcd_endpoint):
    leader = _spawn(etcd_endpoint, "elect", "first", ttl=2)
    try:
        await _ready(leader)
        election = registry.Election(etcd_client, "test-election", "second", ttl=2)
        campaign = asyncio.create_task(election.campaign())
        await asyncio.sleep(1.0)
        assert not campaign.done(), "two leaders at once"
        assert await election.leader() == "first"
        leader.send_signal(signal.SIGKILL)
        await asyncio.wait_for(campaign, timeout=10)
        assert await election.leader() == "second"
        await election.resign()
    finally:
        leader.kill()
        leader.wait()


async def test_versioned_record_only_moves_forward(etcd_client):
    key = keys.versioned_key("weights-demo")
    await registry.put_versioned(etcd_client, key, 1, {"by": "a"})
    await registry.put_versioned(etcd_client, key, 3, {"by": "b"})
    with pytest.raises(registry.StaleVersionError, match="not newer than 3"):
        await registry.put_versioned(etcd_client, key, 2, {"by": "c"})
    assert await registry.get_versioned(etcd_client, key) == {"by": "b", "version": 3}


async def test_concurrent_versioned_writers_keep_the_highest(etcd_client):
    key = keys.versioned_key("race")

    async def write(v: int) -> None:
        try:
            await registry.put_versioned(etcd_client, key, v, {})
        except registry.StaleVersionError:
            pass

    await asyncio.gather(*(write(v) for v in range(1, 21)))
    assert (await registry.get_versioned(etcd_client, key))["version"] == 20


async def test_unreachable_etcd_is_a_clear_error():
    with pytest.raises(ConnectionError, match="did not answer"):
        await registry.connect("127.0.0.1:1", timeout=1)


async def test_list_and_watch_lists_then_streams_changes_in_order(etcd_client):
    prefix = "/rlharvest/v1/test-watch/"
    await etcd_client.put(f"{prefix}a".encode(), b"1")
    seen: list = []

    async def consume():
        async for item in registry.list_and_watch(etcd_client, prefix):
            seen.append(item)

    task = asyncio.create_task(consume())
    try:
        await _until(lambda: len(seen) >= 1)
        await etcd_client.put(f"{prefix}b".encode(), b"2")
        await etcd_client.delete(f"{prefix}a".encode())
        await etcd_client.put("/rlharvest/v1/test-watch-other".encode(), b"not under it")
        await _until(lambda: len(seen) >= 3)
    finally:
        task.cancel()
    listing, put, deleted = seen[:3]
    assert isinstance(listing, registry.Listing) and listing.values == {f"{prefix}a": b"1"}
    assert (put.key, put.value) == (f"{prefix}b", b"2")
    assert (deleted.key, deleted.value) == (f"{prefix}a", None)
    assert listing.revision < put.revision < deleted.revision and len(seen) == 3


async def test_list_and_watch_lists_again_after_etcd_is_sigkilled_and_comes_back():
    etcd = await asyncio.to_thread(LocalEtcd().start)
    client = await registry.connect(etcd.endpoint)
    seen: list = []

    async def consume():
        async for item in registry.list_and_watch(client, "/k/", retry_delay=0.2):
            seen.append(item)

    task = asyncio.create_task(consume())
    try:
        await _until(lambda: len(seen) >= 1)  # listed
        await client.put(b"/k/before", b"1")
        await _until(lambda: getattr(seen[-1], "key", "") == "/k/before")
        etcd.process.kill()  # SIGKILL; it comes back empty on the same port
        await asyncio.to_thread(etcd.process.wait)
        etcd.stop()
        await asyncio.to_thread(etcd.start)
        await _until(lambda: isinstance(seen[-1], registry.Listing), timeout=30)
        assert seen[-1].values == {}  # the key that vanished is gone from the new listing
        await client.put(b"/k/after", b"2")
        await _until(lambda: getattr(seen[-1], "key", "") == "/k/after", timeout=30)
    finally:
        task.cancel()
        await client.close()
        etcd.stop()


async def _until(condition, timeout: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


async def test_concurrent_member_updates_leave_the_newest_record_in_etcd(etcd_client):
    member = await registry.register(etcd_client, "rollout_worker", "w-racy", {"job": ""}, ttl=5)
    try:
        for _ in range(5):  # unordered puts in flight at once land in either order
            await asyncio.gather(*(member.update(job=f"job-{i}", n=i) for i in range(20)))
            stored = await registry.list_members(etcd_client, "rollout_worker")
            assert stored[keys.member_key("rollout_worker", "w-racy")] == member.info
            assert member.info["n"] == 19
    finally:
        await member.close()


async def _lapse(client, member: registry.Membership) -> int:
    """Make ``member``'s lease lapse now, as etcd does when no keepalive came within the TTL
    (revoking deletes the key the same way); returns the lapsed lease's id."""
    lapsed = member.lease.id
    await client.revoke_lease(lapsed)
    return lapsed


async def test_a_member_whose_lease_lapsed_is_registered_again_within_a_renewal_period(
        etcd_client, caplog):
    member = await registry.register(etcd_client, "rollout_worker", "w-lapse",
                                     {"endpoint": "x:1"}, ttl=3)  # renewed every 1 s
    try:
        lapsed = await _lapse(etcd_client, member)
        key = keys.member_key("rollout_worker", "w-lapse")
        found: dict[str, dict] = {}
        deadline = asyncio.get_running_loop().time() + 1 + 2  # a period, plus a busy machine
        while key not in found:
            assert asyncio.get_running_loop().time() < deadline, "member was not registered again"
            await asyncio.sleep(0.1)
            found = await registry.list_members(etcd_client, "rollout_worker")
        assert found[key] == {"endpoint": "x:1"}
        assert member.lease.id != lapsed
        assert any("lapsed" in r.getMessage() and key in r.getMessage() for r in caplog.records)
        await member.update(weight_version=3)  # on the new lease
        found = await registry.list_members(etcd_client, "rollout_worker")
        assert found[key] == {"endpoint": "x:1", "weight_version": 3}
    finally:
        await member.close()
    assert key not in await registry.list_members(etcd_client, "rollout_worker")


async def test_a_member_stalled_past_its_ttl_is_registered_again(etcd_client):
    member = await registry.register(etcd_client, "rollout_worker", "w-lapse",
                                     {"endpoint": "x:1"}, ttl=2)
    lapsed = member.lease.id
    try:
        time.sleep(2 + 2)  # the event loop blocked past the TTL: etcd expires lease and key
        deadline = asyncio.get_running_loop().time() + 2 / 3 + 2  # a period, plus a busy machine
        while True:
            stored = await etcd_client.get(member.key.encode())
            if stored is not None and stored.lease != lapsed:
                break
            assert asyncio.get_running_loop().time() < deadline, "member was not registered again"
            await asyncio.sleep(0.1)
        assert stored.lease == member.lease.id and json.loads(stored.value) == {"endpoint": "x:1"}
    finally:
        await member.close()


async def test_an_update_after_the_lease_lapsed_registers_again_once_for_all_writers(
        etcd_client, caplog):
    member = await registry.register(etcd_client, "rollout_worker", "w-lapse", {"n": -1}, ttl=5)
    try:
        lapsed = await _lapse(etcd_client, member)
        # Before the keepalive notices: every writer must land, on one new lease.
        with caplog.at_level(logging.WARNING, logger="rlharvest.common.registry"):
            await asyncio.gather(*(member.update(n=i) for i in range(10)))
        again = [r for r in caplog.records if "registering again" in r.getMessage()]
        assert len(again) == 1, [r.getMessage() for r in again]  # one new lease, not ten
        stored = await etcd_client.get(member.key.encode())
        assert stored is not None and json.loads(stored.value) == {"n": 9}
        assert stored.lease not in (0, lapsed) and stored.lease == member.lease.id
        await asyncio.sleep(5 / 3 + 0.5)  # a renewal: the new lease is alive, nothing to redo
        assert (await etcd_client.get(member.key.encode())).lease == member.lease.id
    finally:
        await member.close()


async def test_an_election_key_whose_lease_lapsed_stays_gone_and_the_lapse_is_logged(
        etcd_client, caplog):
    election = registry.Election(etcd_client, "lapse", "candidate-a", ttl=3)
    await election.campaign()
    key = election.key
    assert key is not None and election._membership is not None
    try:
        await etcd_client.revoke_lease(election._membership.lease.id)
        await asyncio.sleep(1 + 1)  # a renewal period, and then some
        # Putting it again would let a deposed leader pass its fence check.
        assert await etcd_client.get(key.encode()) is None
        assert any("lapsed" in r.getMessage() and key in r.getMessage() for r in caplog.records)
    finally:
        await election.resign()



async def test_keep_lease_renews_a_live_lease_and_returns_once_it_lapsed(etcd_client):
    lease = await etcd_client.lease(1)
    await etcd_client.put(b"/rlh-test/kept", b"x", lease=lease)
    kept = asyncio.create_task(registry.keep_lease(lease, 1, "a test lease"))
    try:
        await asyncio.sleep(2.5)  # two and a half TTLs: alive only if renewed
        assert not kept.done() and await etcd_client.get(b"/rlh-test/kept") is not None
        await etcd_client.revoke_lease(lease.id)
        await asyncio.wait_for(kept, 2)  # within a renewal period or so
    finally:
        kept.cancel()
