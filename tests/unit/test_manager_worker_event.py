"""The manager's core takes a worker's event whole and returns everything its shell must do
(``RolloutControl.worker_event`` -> ``Outcome``): rows by step, completions already delivered
with their step policy's verdicts, the steps that ended, the worker's loss. Commands decided
elsewhere come back the same way (``settle``)."""

from __future__ import annotations

from rlharvest.common import delta_batch
from rlharvest.common.pb import rollout_manager_pb2 as mpb, rollout_worker_pb2 as wpb
from rlharvest.services.rollout_manager.commands import Dispatch, Fail, Release
from rlharvest.services.rollout_manager.control_loop import ControlConfig, RolloutControl
from rlharvest.services.rollout_manager.step import StepOutcome
from tests.builders import Clock, step


def core(*, wall: float = 1000.0) -> RolloutControl:
    control = RolloutControl(ControlConfig(job="j"), Clock(), wall_clock=lambda: wall)
    control.worker_joined("w", 0, capacity=8, kind="k")
    return control


def outputs(control: RolloutControl, rows: list[tuple[str, int, list[int], str]],
            job: str = "j", preemptions: int = 0) -> wpb.WorkerEvent:
    """One engine step of worker "w": (request, position, tokens, finish) per row."""
    event = wpb.WorkerEvent()
    delta_batch.encode(delta_batch.build(
        [(control.tracker.get(rid).handle, pos, tokens, [0.0] * len(tokens), end)
         for rid, pos, tokens, end in rows], 0), event.step.batch)
    event.step.batch.job = job
    event.step.load.preemptions = preemptions
    return event


def test_one_step_event_returns_the_rows_the_completion_and_the_end_of_its_step():
    control = core()
    added = control.add_step("s", step(2), 0)
    control.tick()
    out = control.worker_event("w", outputs(control, [("r0", 0, [5, 6], "length"),
                                                      ("r1", 0, [7], "")]))
    assert out.accepted_tokens == 3 and out.wake
    [(key, rows)] = out.rows
    assert key == added.key and rows.requests.tolist() == [0, 1]  # named by index in the step
    [delivery] = out.deliveries
    assert delivery.completion.request_id == "r0" and list(delivery.completion.token_ids) == [5, 6]
    assert delivery.outcome == "finished" and not delivery.ended and not delivery.verdicts
    assert "r0" not in control.tracker  # delivered: the core forgot it
    last = control.worker_event("w", outputs(control, [("r1", 1, [8], "stop")]))
    assert last.deliveries[0].ended and added.outcome is StepOutcome.FINISHED
    assert added.finished_lengths == [2, 2]


def test_a_short_rounds_verdicts_come_with_the_completion_that_decides_them():
    control = core()
    acceptance = mpb.Acceptance(prompts=1, responses=2)
    control.add_step("s", step(4, group_size=2), 0, acceptance=acceptance)
    control.tick()
    out = control.worker_event("w", outputs(control, [("r2", 0, [5], "stop"),
                                                      ("r3", 0, [6], "stop")]))
    assert [d.verdicts for d in out.deliveries][0] == ()
    # g1 is the one prompt the round needs: accepted, and the round is over, g0 deferred.
    assert [(v.group_id, v.accepted) for v in out.deliveries[1].verdicts] == [
        ("g1", True), ("g0", False)]
    assert control.steps.live()[0].policy.round_kind == "short"


def test_tokens_of_another_jobs_weights_lose_the_worker_and_keep_nothing():
    control = core()
    control.add_step("s", step(1), 0)
    control.tick()
    out = control.worker_event("w", outputs(control, [("r0", 0, [5], "")], job="other"))
    assert out.lost == "sent tokens of job 'other''s weights"
    assert [type(c) for c in out.commands] == [Release] and not out.rows
    assert [(d.reason, d.tokens) for d in out.dropped] == [("other_job", 1)]
    assert control.tracker.get("r0").generated == 0


def test_a_malformed_batch_is_dropped_whole_and_its_load_still_counts():
    control = core()
    control.worker_event("w", outputs(control, [], preemptions=3))  # the baseline
    event = wpb.WorkerEvent()
    event.step.batch.job = "j"
    event.step.batch.token_ids = b"\x01\x02\x03"  # not a whole int32
    event.step.load.preemptions = 5
    out = control.worker_event("w", event)
    assert out.malformed and [d.reason for d in out.dropped] == ["malformed"]
    assert out.preemptions == 2


def test_a_failed_requests_completion_comes_with_the_command_that_fails_it():
    control = core()
    control.add_step("s", step(1), 0)
    dispatched = control.tick()
    assert [type(c) for c in dispatched] == [Dispatch]
    out = control.settle(dispatched)
    assert out.payloads["r0"].request_id == "r0" and not out.deliveries
    control.tracker.fail("r0", "cut")
    cut = control.settle([Fail("r0", "cut", "w", cancelled=True)])
    [delivery] = cut.deliveries
    assert delivery.outcome == "cancelled" and delivery.completion.cancelled and delivery.ended


def test_a_drain_deadline_in_unix_time_becomes_one_on_the_cores_clock():
    control = core(wall=1000.0)
    event = wpb.WorkerEvent()
    event.draining.deadline_unix = 1030.0
    out = control.worker_event("w", event)
    assert out.wake and control.pool.get("w").drain_deadline == 30.0


def test_events_of_a_worker_the_core_does_not_know_change_nothing():
    control = core()
    out = control.worker_event("nobody", outputs(control, []))
    assert not (out.commands or out.rows or out.deliveries or out.lost or out.wake)
