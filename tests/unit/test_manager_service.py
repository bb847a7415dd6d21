"""The manager's service shell in-process: SubmitStep driven as gRPC drives it (its generator,
closed when the client goes away), the worker side as a worker link's read loop drives it
(``_on_worker_event``) and the tick loop's commands as it executes them. What a client leaving
releases, and what a step or a lost worker leaves behind."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from rlharvest.common import delta_batch
from rlharvest.common.pb import rollout_manager_pb2 as mpb, rollout_worker_pb2 as wpb
from rlharvest.services.rollout_manager import metrics
from rlharvest.services.rollout_manager.control_loop import ControlConfig, RolloutControl
from rlharvest.services.rollout_manager.failure import FailureConfig
from rlharvest.services.rollout_manager.service import ManagerService
from tests.builders import Clock, step, submit_step


class PlainContext:
    """A servicer context without TLS: nobody's certificate to check."""

    def auth_context(self) -> dict:
        return {}


def manager(client_queue: int = 8, reattach_grace_s: float = 0.0, clock: Clock | None = None
            ) -> tuple[RolloutControl, ManagerService]:
    control = RolloutControl(ControlConfig(), clock or Clock())
    control.worker_joined("w", 0, capacity=8, kind="k")
    return control, ManagerService(control, None, job="j", max_message_bytes=1 << 20,
                                   client_queue=client_queue, tick_interval_s=1.0,
                                   reattach_grace_s=reattach_grace_s)


def outputs(control: RolloutControl, request_id: str, position: int, tokens: list[int],
            finish: str = "") -> wpb.WorkerEvent:
    """One engine step of worker "w" for one request, as its Session stream carries it."""
    handle = control.tracker.get(request_id).handle
    event = wpb.WorkerEvent()
    delta_batch.encode(delta_batch.build(
        [(handle, position, tokens, [0.0] * len(tokens), finish)], 0), event.step.batch)
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
    service._endpoints["spot-1234"] = {"endpoint": "10.0.0.7:5000"}
    service.refresh_gauges()  # a scrape
    assert {"w", "spot-1234"} <= series(metrics.ASSIGNED) & series(metrics.PENDING)
    service._lose("spot-1234", "etcd lease expired or worker deregistered")
    clock.advance(FailureConfig().forget_lost_after_s)
    service._execute(control.tick())  # one round of the service's tick loop
    service.refresh_gauges()
    status = await service.GetStatus(mpb.GetStatusRequest(), PlainContext())
    assert [w.worker_id for w in status.workers] == ["w"]
    assert "spot-1234" not in series(metrics.ASSIGNED) | series(metrics.PENDING)
    assert "spot-1234" not in service._endpoints
