"""Every built-in ManagerObserver (observer.py) follows a step from its start to its end the way
the shell drives them, and does what its feature is for at that end."""

from __future__ import annotations

from rlharvest.common import delta_batch
from rlharvest.common.pb import rollout_worker_pb2 as wpb
from rlharvest.services.rollout_manager.client_stream import ClientStream
from rlharvest.services.rollout_manager.commands import Command
from rlharvest.services.rollout_manager.control_loop import ControlConfig, RolloutControl
from rlharvest.services.rollout_manager.observer import ManagerObserver, Submission
from rlharvest.services.rollout_manager.reattach import Reattach
from rlharvest.services.rollout_manager.seed_window import SeedWindowObserver
from rlharvest.services.rollout_manager.step import Step
from rlharvest.services.rollout_manager.stream_scaler import ScalingObserver, StreamScaler
from rlharvest.services.rollout_manager.tp_planner import TpPlanner
from rlharvest.services.rollout_manager.tp_publisher import TpPlanning, TpPublisher
from tests.builders import Clock, FlakyEtcd, step, submit_step


class FakeShell:
    """The shell as an observer sees it (observer.Shell)."""

    def __init__(self, control: RolloutControl) -> None:
        self.control = control
        self.executed: list[Command] = []
        self.abandoned: list[ClientStream] = []

    def execute(self, commands) -> None:
        self.executed += commands

    def wake(self) -> None:
        pass

    def open_stream(self, step: Step) -> ClientStream:
        return ClientStream(step, 8)

    def abandon(self, stream: ClientStream) -> None:
        self.abandoned.append(stream)


def finish_all(control: RolloutControl, step: Step, observers: list[ManagerObserver]) -> None:
    """Worker "w" finishes every request of ``step`` in one engine step, as the shell passes
    it on: each delivery, then the step's end."""
    control.tick()
    event = wpb.WorkerEvent()
    delta_batch.encode(delta_batch.build(
        [(control.tracker.get(rid).handle, 0, [5, 6, 7], [0.0] * 3, "stop")
         for rid in step.request_ids], 0), event.step.batch)
    event.step.batch.job = "j"
    for delivery in control.worker_event("w", event).deliveries:
        for observer in observers:
            observer.delivered(delivery)
    for observer in observers:
        observer.step_ended(step, None)


async def test_every_built_in_observer_follows_a_step_from_start_to_end():
    control = RolloutControl(ControlConfig(job="j"), Clock())
    control.worker_joined("w", 0, capacity=8, kind="k")
    shell = FakeShell(control)
    tp = TpPlanning(TpPublisher(FlakyEtcd(), TpPlanner(8, 1), job="j", manager_id="m"))
    scaling = ScalingObserver(StreamScaler(control))
    reattach = Reattach(10.0, Clock())
    observers: list[ManagerObserver] = [tp, scaling, SeedWindowObserver(), reattach]
    for observer in observers:
        observer.bind(shell)
    request = submit_step(step(4))
    submission = Submission.of_step(request)
    assert all(o.claim(submission) is None for o in observers)  # nothing to re-attach to
    started = control.add_step("s", submission.new_requests(), 0)
    stream = shell.open_stream(started)
    for observer in observers:
        observer.step_started(started, stream, submission)
        assert observer.before_tick() == []
    finish_all(control, started, observers)
    for observer in observers:
        observer.after_tick()
        observer.refresh_gauges()
    assert tp.publisher.steps == 1  # the planner observed the finished step
    assert scaling.scaler.history == [3, 3, 3, 3]  # the next step's history
    journal = reattach.journals.get(started.key)
    assert journal is not None and journal.ended and len(journal.completions) == 4
    assert reattach.client_left(stream)  # kept for a re-attach, not abandoned now
    assert not shell.abandoned and not shell.executed
