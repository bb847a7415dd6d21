"""One client's stream of a step's output (``ClientStream``): rows go in, in the order the
tracker accepted them, whenever they are put; a producer waits for room only after its rows are
in (backpressure), so neither a wait nor its cancellation reorders or drops them."""

from __future__ import annotations

import asyncio

from rlharvest.common import delta_batch
from rlharvest.common.pb import rollout_manager_pb2 as mpb
from rlharvest.services.rollout_manager.client_stream import ClientStream
from rlharvest.services.rollout_manager.step import Step
from rlharvest.services.rollout_manager.step_policy import PlainStep


def stream(max_events: int = 1) -> ClientStream:
    return ClientStream(Step(1, "s", 0, ["r0", "r1"], PlainStep(), True, 0.0), max_events)


def row(position: int, token: int, request: int = 0) -> delta_batch.Rows:
    return delta_batch.build([(request, position, [token], [0.0], "")], 0)


def positions(events: list[mpb.StepEvent]) -> list[tuple[int, int]]:
    return [(r.request, r.position) for e in events if e.batch.requests
            for r in delta_batch.decode(e.batch).iter()]


async def drain(s: ClientStream) -> list[mpb.StepEvent]:
    s.end()
    return [e async for e in _events(s)]


async def waiting_for_room(s: ClientStream) -> asyncio.Task:
    """A producer of ``s``, whose client is a full event behind, waiting in ``room``."""
    waiting = asyncio.create_task(s.room())
    await asyncio.sleep(0.01)
    assert not waiting.done()  # backpressure onto the worker's stream
    return waiting


async def _events(s: ClientStream):
    while (event := await s.take()) is not None:
        yield event


async def test_rows_put_while_the_client_is_behind_reach_it_in_the_order_they_were_put():
    s = stream(max_events=1)
    assert s.put_rows(row(0, 5)) is False  # room: the producer reads on
    assert s.put_rows(row(1, 6)) is True  # one event waits: this producer waits next ...
    # ... but its rows are in already: a migrated request's next worker, or a producer that
    # comes between room made and the waiter waking, queues after them.
    assert s.put_rows(row(2, 7)) is True
    assert positions(await drain(s)) == [(0, 0), (0, 1), (0, 2)]


async def test_a_producer_waits_for_room_until_the_client_takes_an_event():
    s = stream(max_events=1)
    s.put_rows(row(0, 5))
    waiting = await waiting_for_room(s)
    await s.take()
    await asyncio.wait_for(waiting, 1.0)
    assert s.put_rows(row(1, 6)) is False


async def test_rows_of_a_producer_cancelled_while_it_waits_for_room_still_reach_the_client():
    # A worker lost while its read loop waits (its link closes, cancelling the loop): the
    # tracker holds these rows and the request's next worker resumes after them.
    s = stream(max_events=1)
    s.put_rows(row(0, 5))
    assert s.put_rows(row(1, 6))
    (await waiting_for_room(s)).cancel()
    s.put_rows(row(2, 8))  # the next worker's row
    assert positions(await drain(s)) == [(0, 0), (0, 1), (0, 2)]


async def test_a_producer_waiting_for_room_goes_on_when_the_client_leaves():
    s = stream(max_events=1)
    s.put_rows(row(0, 5))
    waiting = await waiting_for_room(s)
    s.detach()
    await asyncio.wait_for(waiting, 1.0)
    assert s.put_rows(row(1, 6)) is False  # dropped: nobody reads
    assert await drain(s) == []


async def test_a_completion_after_rows_in_the_same_event_follows_them():
    s = stream(max_events=1)
    s.put_rows(row(0, 5))
    s.put_rows(row(1, 6))
    s.put_completion(mpb.Completion(request_id="r0", token_ids=[5, 6]))
    events = await drain(s)
    assert positions(events) == [(0, 0), (0, 1)]
    assert [c.request_id for e in events for c in e.completions] == ["r0"]
