"""The session hub in-process (no engine, no process): ordering, the never-dropping outbox,
backpressure, drain, command errors, and how sessions end."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from rlharvest.common.engine_types import RequestOutput
from rlharvest.common.errors import NotFound, ResourceExhausted
from rlharvest.common.pb import common_pb2, rollout_worker_pb2 as pb
from rlharvest.common.worker_core.engine_pump import EngineStep
from rlharvest.common.worker_core.session_hub import Session, SessionHub
from tests.worker_sessions import Collected, deltas_of, handle_of

LOAD = common_pb2.Load(executing=1, weight_version=3)


def engine_step(number: int, *outputs: RequestOutput, batch_size: int = 0) -> EngineStep:
    stats = pb.EngineStepStats(batch_size=batch_size or len(outputs), duration_s=0.01,
                               decode_tokens=sum(len(o.new_token_ids) for o in outputs))
    return EngineStep(number, list(outputs), 3, LOAD, stats)


def token(rid: str, tok: int, finished: bool = False) -> RequestOutput:
    return RequestOutput(rid, [tok], [-0.5], finished=finished,
                         finish_reason="length" if finished else "")


def aborted(rid: str) -> RequestOutput:
    return RequestOutput(rid, [], [], finished=True, finish_reason="abort")


async def take(session: Session) -> list[pb.WorkerEvent | None]:
    """Everything in the session's outbox right now, in order."""
    return [await session.outbox.get() for _ in range(len(session.outbox))]


async def collect(session: Session) -> Collected:
    """Absorb every queued event (the positions check fails on any reordering)."""
    collected = Collected()
    for event in await take(session):
        if event is not None:
            collected.absorb(event)
    return collected


def opened(hub: SessionHub) -> Session:
    session = hub.open(LOAD)
    session.outbox.clear()  # the hello heartbeat
    return session


async def test_a_new_session_hears_the_load_first():
    hub = SessionHub()
    session = hub.open(LOAD)
    assert [e.WhichOneof("event") for e in await take(session)] == ["load"]


async def test_an_abort_confirmation_never_overtakes_step_outputs_routed_before_it():
    hub = SessionHub()
    session = opened(hub)
    hub.hold(session, "r", next_position=0, weight_version=3, handle=handle_of("r"))
    routed = hub.route(engine_step(1, token("r", 7)))
    hub.end(aborted("r"), 3, LOAD)  # decided between steps, while step 1 is still unsent
    assert len(session.outbox) == 0  # held back behind the unsent step
    await hub.send(routed)
    got = await collect(session)
    assert [deltas_of(s)[0].position for s in got.steps] == [0, 1]
    assert got.completions["r"].tokens == [7]
    assert got.completions["r"].finish_reason == "abort"
    assert hub.holder("r") is None


async def test_a_final_delta_with_no_step_unsent_goes_out_at_once():
    hub = SessionHub()
    session = opened(hub)
    # a resume: 5 tokens came before
    hub.hold(session, "r", next_position=5, weight_version=3, handle=handle_of("r"))
    hub.end(aborted("r"), 3, LOAD)
    (event,) = await take(session)
    assert event is not None
    assert deltas_of(event.step)[0].position == 5 and deltas_of(event.step)[0].finish_reason == "abort"


async def test_step_outputs_go_one_message_per_session_with_the_steps_stats():
    hub = SessionHub()
    first, second = opened(hub), opened(hub)
    for rid, session in (("a", first), ("b", first), ("c", second)):
        hub.hold(session, rid, next_position=0, weight_version=3, handle=handle_of(rid))
    step = engine_step(4, token("a", 1), token("b", 2), token("c", 3, finished=True),
                       token("gone", 4))  # an output nobody holds is not sent
    await hub.send(hub.route(step))
    (to_first,), (to_second,) = await take(first), await take(second)
    assert to_first is not None and to_second is not None
    assert [d.request_id for d in deltas_of(to_first.step)] == ["a", "b"]
    assert [d.request_id for d in deltas_of(to_second.step)] == ["c"]
    assert to_first.step.stats == to_second.step.stats == step.stats
    assert to_first.step.step == 4 and to_first.step.load == LOAD
    assert hub.holder("c") is None and hub.holder("a") is not None  # finished: released


async def test_control_events_survive_a_full_outbox_and_heartbeats_do_not():
    hub = SessionHub(session_queue=1)
    session = opened(hub)
    hub.hold(session, "r", next_position=0, weight_version=3, handle=handle_of("r"))
    await hub.send(hub.route(engine_step(1, token("r", 7))))  # the outbox is now full
    hub.heartbeat(LOAD)  # dropped: the session is backed up
    for i in range(3):
        hub.refuse(session, f"x{i}", ResourceExhausted("full"))
    hub.end(aborted("r"), 3, LOAD)
    kinds = [e.WhichOneof("event") for e in await take(session) if e is not None]
    assert kinds == ["step", "error", "error", "error", "step"]
    hub.heartbeat(LOAD)  # room again: taken
    assert [e.WhichOneof("event") for e in await take(session) if e is not None] == ["load"]


async def test_a_refusal_carries_the_errors_status_and_message():
    hub = SessionHub()
    session = opened(hub)
    hub.refuse(session, "ghost", NotFound("no request 'ghost' of this session on this worker"))
    got = await collect(session)
    assert got.errors["ghost"] == (grpc.StatusCode.NOT_FOUND,
                                   "no request 'ghost' of this session on this worker")


async def test_a_slow_reader_holds_up_send_until_it_reads():
    hub = SessionHub(session_queue=1)
    session = opened(hub)
    hub.hold(session, "r", next_position=0, weight_version=3, handle=handle_of("r"))
    await hub.send(hub.route(engine_step(1, token("r", 1))))
    blocked = asyncio.create_task(hub.send(hub.route(engine_step(2, token("r", 2)))))
    await asyncio.sleep(0.05)
    assert not blocked.done()  # the pump awaiting this send steps no further
    assert (await session.outbox.get()) is not None
    await asyncio.wait_for(blocked, 1)


async def test_closing_a_session_hands_back_its_requests_and_unblocks_the_sender():
    hub = SessionHub(session_queue=1)
    session = opened(hub)
    hub.hold(session, "r", next_position=0, weight_version=3, handle=handle_of("r"))
    hub.hold(session, "s", next_position=0, weight_version=3, handle=handle_of("s"))
    await hub.send(hub.route(engine_step(1, token("r", 1))))
    blocked = asyncio.create_task(hub.send(hub.route(engine_step(2, token("r", 2)))))
    await asyncio.sleep(0.01)
    assert sorted(hub.close(session)) == ["r", "s"]
    await asyncio.wait_for(blocked, 1)
    assert hub.session_count == 0


async def test_a_half_closed_session_ends_after_its_last_request():
    hub = SessionHub()
    session = opened(hub)
    hub.hold(session, "r", next_position=0, weight_version=3, handle=handle_of("r"))
    hub.client_done(session)
    assert len(session.outbox) == 0  # still owes r's outputs
    await hub.send(hub.route(engine_step(1, token("r", 1, finished=True))))
    events = await take(session)
    assert events[-1] is None and events[0] is not None


async def test_a_half_closed_session_ends_after_an_abort_confirmation_held_back():
    hub = SessionHub()
    session = opened(hub)
    hub.hold(session, "r", next_position=0, weight_version=3, handle=handle_of("r"))
    hub.client_done(session)
    routed = hub.route(engine_step(1, token("r", 1)))
    hub.end(aborted("r"), 3, LOAD)
    await hub.send(routed)
    events = await take(session)
    assert [deltas_of(e.step)[0].finish_reason if e else None for e in events] == ["", "abort", None]


async def test_drain_tells_every_session_and_waits_for_the_requests_to_leave():
    hub = SessionHub()
    first, second = opened(hub), opened(hub)
    hub.hold(first, "r", next_position=0, weight_version=3, handle=handle_of("r"))
    drain = asyncio.create_task(hub.drain(timeout=5, reason="spot notice"))
    await asyncio.sleep(0.01)
    assert hub.draining and not drain.done()
    for session in (first, second):
        (event,) = await take(session)
        assert event is not None and event.draining.reason == "spot notice"
    later = hub.open(LOAD)  # a session opened while draining hears it too
    assert [e.WhichOneof("event") for e in await take(later) if e] == ["load", "draining"]
    hub.end(aborted("r"), 3, LOAD)  # the manager migrated it away
    assert await asyncio.wait_for(drain, 1) is True


async def test_a_drain_nobody_answers_ends_at_its_timeout():
    hub = SessionHub()
    hub.hold(opened(hub), "stuck", next_position=0, weight_version=3, handle=handle_of("stuck"))
    assert await hub.drain(timeout=0.1, reason="shutting down") is False


def test_a_hub_needs_room_for_one_message_per_session():
    with pytest.raises(ValueError, match="session_queue"):
        SessionHub(session_queue=0)


def test_the_worker_core_and_the_workers_shell_import_without_torch():
    """The serving co-executor and the control plane's tools compose the core without torch;
    only an engine needs it."""
    modules = ["rlharvest.common.worker_core.session_commands",
               "rlharvest.common.worker_core.engine_pump",
               "rlharvest.services.rollout_worker.admission",
               "rlharvest.services.rollout_worker.service"]
    code = f"import sys; import {', '.join(modules)}; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60,
                   cwd=Path(__file__).resolve().parents[2])
