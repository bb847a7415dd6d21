"""The worker core's per-session outbox and the spot-notice parser: pure pieces of the worker."""

from __future__ import annotations

import asyncio

import pytest

from rlharvest.common.worker_core.outbox import Outbox
from rlharvest.services.rollout_worker.preemption_notice import is_notice


async def test_put_waits_for_room_and_keeps_order():
    box: Outbox[str] = Outbox(2)
    await box.put("a")
    await box.put("b")
    blocked = asyncio.create_task(box.put("c"))
    await asyncio.sleep(0.01)
    assert not blocked.done() and len(box) == 2  # backpressure: the writer waits
    assert await box.get() == "a"
    await asyncio.wait_for(blocked, 1)
    assert [await box.get(), await box.get()] == ["b", "c"]


async def test_control_events_go_past_the_bound_and_heartbeats_do_not():
    box: Outbox[str] = Outbox(1)
    assert box.offer("load-1")
    assert not box.offer("load-2")  # dropped: the session is backed up
    box.push("error")
    box.push("abort-confirmation")
    assert len(box) == 3
    assert [await box.get() for _ in range(3)] == ["load-1", "error", "abort-confirmation"]
    assert box.offer("load-3")


async def test_get_waits_for_an_item_and_clear_releases_writers():
    box: Outbox[int] = Outbox(1)
    reader = asyncio.create_task(box.get())
    await asyncio.sleep(0.01)
    assert not reader.done()
    box.push(7)
    assert await asyncio.wait_for(reader, 1) == 7
    await box.put(1)
    writer = asyncio.create_task(box.put(2))
    await asyncio.sleep(0.01)
    box.clear()  # the session is gone: an engine loop blocked on it must go on
    await asyncio.wait_for(writer, 1)


def test_outbox_needs_room_for_one():
    with pytest.raises(ValueError, match=">= 1"):
        Outbox(0)


@pytest.mark.parametrize(("status", "body", "expected"), [
    (404, "", False),                                              # AWS: nothing scheduled
    (200, '{"action": "terminate", "time": "2026-11-23T12:00:00Z"}', True),  # AWS notice
    (200, "FALSE", False), (200, "false\n", False),                # GCP: not preempted
    (200, "TRUE", True),                                           # GCP: preempted
    (200, "   ", False), (500, "TRUE", False),                     # junk is not a notice
])
def test_notice_formats_of_both_clouds(status, body, expected):
    assert is_notice(status, body) is expected
