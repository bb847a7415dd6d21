"""The manager's service shell in-process: SubmitStep driven as gRPC drives it (its generator,
closed when the client goes away), the worker side as a worker link's read loop drives it
(``_on_worker_event``) and the tick loop's commands as it carries them out (``execute``). What
a client leaving releases, and what a step or a lost worker leaves behind."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from typing import cast

from rlharvest.common import delta_batch
from rlharvest.common.pb import rollout_manager_pb2 as mpb, rollout_worker_pb2 as wpb
from rlharvest.services.rollout_manager import metrics
from rlharvest.services.rollout_manager.control_loop import ControlConfig, RolloutControl
from rlharvest.services.rollout_manager.failure import FailureConfig
from rlharvest.services.rollout_manager.reattach import Reattach
from rlharvest.services.rollout_manager.service import ManagerService
from tests.builders import Clock, FlakyEtcd, step, submit_step


class PlainContext:
    """A servicer context without TLS: nobody's certificate to check."""

    def auth_context(self) -> dict:
        return {}


def manager(client_queue: int = 8, reattach_grace_s: float = 0.0, clock: Clock | None = None
            ) -> tuple[RolloutControl, ManagerService]:
    control = RolloutControl(ControlConfig(job="j"), clock or Clock())
    control.worker_joined("w", 0, capacity=8, kind="k")
    observers = [Reattach(reattach_grace_s)] if reattach_grace_s > 0 else []
    return control, ManagerService(control, FlakyEtcd(), job="j", max_message_bytes=1 << 20,
                                   client_queue=client_queue, tick_interval_s=1.0,
                                   observers=observers)


def outputs(control: RolloutControl, request_id: str, position: int, tokens: list[int],
            finish: str = "") -> wpb.WorkerEvent:
    """One engine step of worker "w" for one request, as its Session stream carries it."""
    handle = control.tracker.get(request_id).handle
    event = wpb.WorkerEvent()
    delta_batch.encode(delta_batch.build(
        [(handle, position, tokens, [0.0] * len(tokens), finish)], 0), event.step.batch)
    event.step.batch.job = "j"  # the manager's job: its weights made them
    return event


async def dispatched(control: RolloutControl, client: AsyncIterator[mpb.StepEvent]
                     ) -> asyncio.Task:
    """The client waiting for its first event, and its step's requests on worker "w"."""
    first = asyncio.create_task(anext(client))  # type: ignore[arg-type]
    await asyncio.sleep(0.01)  # the step is added and the client waits in take()
    control.tick()  # the Dispatch commands are applied to the core; no worker link to send to
    return first


async def test_a_worker_waiting_for_a_slow_clients_room_goes_on_when_that_client_leaves():
    control, service = manager(client_queue=1)  # not journaled: the step ends with its client
    client = service.SubmitStep(submit_step(step(1, max_tokens=100)), PlainContext())
    first = await dispatched(control, client)
    await service._on_worker_event("w", outputs(control, "r0", 0, [5]))
    await asyncio.wait_for(first, 1.0)  # the client read one event, and reads no more
    await service._on_worker_event("w", outputs(control, "r0", 1, [6]))  # the one it may lag by
    blocked = asyncio.create_task(service._on_worker_event("w", outputs(control, "r0", 2, [7])))
    await asyncio.sleep(0.05)
    assert not blocked.done()  # backpressure: the worker's read loop waits for the client
    await client.aclose()  # the client goes away (gRPC closes its stream's generator)
    await asyncio.wait_for(blocked, 1.0)  # before this fix: until the stall timeout lost "w"
    assert "r0" not in control.tracker


async def test_a_re_attach_to_a_step_that_already_ended_leaves_no_stream_behind():
    control, service = manager(reattach_grace_s=0.05)
    request = submit_step(step(1, max_tokens=1))
    client = service.SubmitStep(request, PlainContext())
    first = await dispatched(control, client)
    await service._on_worker_event("w", outputs(control, "r0", 0, [5], finish="length"))
    events = [await asyncio.wait_for(first, 1.0)] + [e async for e in client]
    assert [c.request_id for e in events for c in e.completions] == ["r0"]
    # The trainer died while training on the step and, restarted, submits it again.
    replayed = [e async for e in service.SubmitStep(request, PlainContext())]
    assert [c.request_id for e in replayed for c in e.completions] == ["r0"]
    assert service._step_streams == {}


def series(gauge) -> set[str]:
    """The worker labels a per-worker gauge exports."""
    return {sample.labels["worker"] for metric in gauge.collect() for sample in metric.samples}


async def test_a_forgotten_worker_leaves_the_status_and_its_metric_series():
    clock = Clock()
    control, service = manager(clock=clock)
    control.worker_joined("spot-1234", 0, capacity=8, kind="spot")
    service.workers.endpoints["spot-1234"] = {"endpoint": "10.0.0.7:5000"}
    service.refresh_gauges()  # a scrape
    assert {"w", "spot-1234"} <= series(metrics.ASSIGNED) & series(metrics.PENDING)
    service.workers.lose("spot-1234", "etcd lease expired or worker deregistered")
    clock.advance(FailureConfig().forget_lost_after_s)
    service.execute(control.tick())  # one round of the service's tick loop
    service.refresh_gauges()
    status = await service.GetStatus(mpb.GetStatusRequest(), PlainContext())
    assert [w.worker_id for w in status.workers] == ["w"]
    assert "spot-1234" not in series(metrics.ASSIGNED) | series(metrics.PENDING)
    assert "spot-1234" not in service.workers.endpoints


def open_step(service: ManagerService, request: mpb.SubmitStepRequest
              ) -> AsyncGenerator[mpb.StepEvent, None]:
    """SubmitStep as gRPC drives it: an async generator, closed when its client goes away."""
    return cast(AsyncGenerator[mpb.StepEvent, None],
                service.SubmitStep(request, PlainContext()))


def rows_of(events: list[mpb.StepEvent]) -> list[tuple[int, int, list[int]]]:
    """The (request index, position, tokens) rows the client read, in the order it read them."""
    return [(row.request, row.position, row.token_ids) for e in events if e.batch.requests
            for row in delta_batch.decode(e.batch).iter()]


def gapless(rows: list[tuple[int, int, list[int]]]) -> dict[int, list[int]]:
    """Each request's tokens as the trainer assembles them (``step_plan._Partial``): a row must
    start where the tokens so far end; a gap breaks the record."""
    tokens: dict[int, list[int]] = {}
    for request, position, ids in rows:
        so_far = tokens.setdefault(request, [])
        assert position == len(so_far), f"request {request}: row at {position} after " \
                                        f"{len(so_far)} tokens ({rows})"
        so_far.extend(ids)
    return tokens


async def test_rows_after_a_migration_under_backpressure_reach_the_client_in_position_order():
    # Two steps on worker "w"; step a's client is behind, so w's read loop waits on a's stream
    # with the rows of both steps accepted by the tracker. Meanwhile b's request is migrated to
    # "w2" with those tokens (drain, stream scaling: tokens kept), and w2 continues after them.
    control, service = manager(client_queue=1)
    slow = open_step(service, submit_step(step(1, prefix="a", max_tokens=100), "sa"))
    reader = open_step(service, submit_step(step(1, prefix="b", max_tokens=100), "sb"))
    first_a = asyncio.create_task(anext(slow))
    first_b = asyncio.create_task(anext(reader))
    await asyncio.sleep(0.01)
    control.tick()  # a0 and b0 on "w"
    await service._on_worker_event("w", outputs(control, "a0", 0, [5]))
    await asyncio.wait_for(first_a, 1.0)  # a's client reads one event, and no more for a while
    await service._on_worker_event("w", outputs(control, "a0", 1, [6]))  # what it may lag by
    both = wpb.WorkerEvent()  # one engine step of "w": a0's and b0's next tokens
    delta_batch.encode(delta_batch.build(
        [(control.tracker.get("a0").handle, 2, [7], [0.0], ""),
         (control.tracker.get("b0").handle, 0, [50], [0.0], "")], 0), both.step.batch)
    both.step.batch.job = "j"
    blocked = asyncio.create_task(service._on_worker_event("w", both))
    await asyncio.sleep(0.05)
    assert not blocked.done()  # backpressure: w's read loop waits for a's client
    control.worker_joined("w2", 0, capacity=8, kind="k")
    control.worker_draining("w", deadline=1e9)  # b0 (and a0) go on on "w2", tokens kept
    assert control.tracker.get("b0").worker_id == "w2"
    await service._on_worker_event("w2", outputs(control, "b0", 1, [51]))
    events = [await asyncio.wait_for(first_b, 1.0)]
    await anext(slow)  # a's client catches up: w's read loop goes on
    await asyncio.wait_for(blocked, 1.0)
    events.append(await asyncio.wait_for(anext(reader), 1.0))
    assert gapless(rows_of(events)) == {0: [50, 51]}
    await slow.aclose()
    await reader.aclose()


async def _worker_lost_while_waiting(end: str = ""):
    """r0 on worker "w" sends tokens 5 and 6, then 7 (with ``end``) while the client is one
    event behind: w's read loop waits for room, and w is lost meanwhile (stalled: its link
    closes, cancelling the read loop). Returns the control, the client and its events so far."""
    control, service = manager(client_queue=1)
    client = open_step(service, submit_step(step(1, max_tokens=100)))
    first = await dispatched(control, client)
    await service._on_worker_event("w", outputs(control, "r0", 0, [5]))
    events = [await asyncio.wait_for(first, 1.0)]
    await service._on_worker_event("w", outputs(control, "r0", 1, [6]))
    blocked = asyncio.create_task(service._on_worker_event(
        "w", outputs(control, "r0", 2, [7], end)))
    await asyncio.sleep(0.05)
    assert not blocked.done()
    service.workers.lose("w", "no token for 30.0s while it had requests")
    blocked.cancel()  # what closing its link does to its read loop (rollout_worker/client.py)
    return control, service, client, events


async def test_rows_of_a_worker_lost_while_waiting_for_a_slow_client_still_reach_it():
    # The tracker took w's rows before w's read loop waited for the client; r0 resumes on "w2"
    # after those rows. The client must still get them, or it sees a gap.
    control, service, client, events = await _worker_lost_while_waiting()
    control.worker_joined("w2", 0, capacity=8, kind="k")
    control.tick()  # r0 re-dispatched to "w2" with its 3 tokens
    assert control.tracker.get("r0").worker_id == "w2"
    w2 = asyncio.create_task(service._on_worker_event("w2", outputs(control, "r0", 3, [8])))
    while not any(position == 3 for _, position, _ in rows_of(events)):  # until w2's row
        events.append(await asyncio.wait_for(anext(client), 1.0))
    await asyncio.wait_for(w2, 1.0)
    assert gapless(rows_of(events)) == {0: [5, 6, 7, 8]}
    await client.aclose()


async def test_a_completion_whose_worker_is_lost_while_waiting_for_a_slow_client_still_reaches_it():
    # r0's last token and its end come in one event: the tracker finishes r0 at once, before
    # the wait. Nothing would deliver r0's completion again, so it must be queued before the
    # wait, or the client never gets it and the step never ends.
    _, _, client, events = await _worker_lost_while_waiting(end="stop")
    while not any(e.completions for e in events):
        try:
            events.append(await asyncio.wait_for(anext(client), 1.0))
        except asyncio.TimeoutError:
            raise AssertionError(f"no completion after rows {rows_of(events)}") from None
    assert gapless(rows_of(events)) == {0: [5, 6, 7]}
    await client.aclose()


class Refused(Exception):
    pass


class RefusingContext(PlainContext):
    """Records the status an RPC ends with (``context.abort`` raises, as grpc's does)."""

    async def abort(self, code, details: str):
        raise Refused(code, details)


async def test_a_step_with_a_bad_seeding_window_is_refused_before_etcd_is_read():
    control, service = manager()
    cast(FlakyEtcd, service.workers._etcd).down = True  # a read would wait it out first
    request = submit_step(step(1))
    request.seed_window_s = -1.0
    try:
        await asyncio.wait_for(anext(service.SubmitStep(request, RefusingContext())), 1.0)
    except Refused as refused:
        code, details = refused.args
        assert code.name == "INVALID_ARGUMENT" and "seeding window" in details
    else:
        raise AssertionError("a negative seeding window was taken")
    assert not control.steps.live()
