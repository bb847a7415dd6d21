"""The one interface the manager's optional features plug in behind.

Stream-trainer scaling (stream_scaler.py), the TP planner (tp_publisher.py), the seeding window
(seed_window.py) and trainer re-attach (reattach.py) each watch the manager's steps and workers
through a ``ManagerObserver``; the shell (service.py) calls every observer it was given, in the
order given, at the moments below, and never knows which features run. Each hook does nothing
unless a feature overrides it. Like Ray Serve's state managers: each keeps its own state, and
what it decides reaches the core through ``Shell.execute`` (commands) or the next tick.
Lending co-executors to the job (lender.py) needs none of these: it only claims co-executors in
etcd, and they join as workers.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Protocol

from rlharvest.common.pb import rollout_manager_pb2 as mpb
from rlharvest.services.rollout_manager.client_stream import ClientStream
from rlharvest.services.rollout_manager.commands import Command
from rlharvest.services.rollout_manager.control_loop import RolloutControl
from rlharvest.services.rollout_manager.outcome import Delivery
from rlharvest.services.rollout_manager.step import Step
from rlharvest.services.rollout_manager.submission import Submission

__all__ = ["ManagerObserver", "Shell", "Submission"]


class Shell(Protocol):
    """What an observer may ask of the manager's shell."""

    @property
    def control(self) -> RolloutControl: ...

    def execute(self, commands: Sequence[Command]) -> None:
        """Carry out commands the observer had the core decide (they are applied already)."""

    def wake(self) -> None:
        """Run the tick soon."""

    def open_stream(self, step: Step) -> ClientStream:
        """A new client stream for ``step``, which gets the step's output from now on."""
        ...

    def abandon(self, stream: ClientStream) -> None:
        """The step's client is gone for good: the core drops what it still had of it."""


class ManagerObserver:
    """Hooks on the manager's steps and workers; override the ones a feature needs."""

    def bind(self, shell: Shell) -> None:
        """Once, before any other hook: the shell this observer serves."""

    def claim(self, submission: Submission) -> ClientStream | None:
        """A step submitted again that this observer can serve from what it kept: the stream
        the client reads from now on (the step is not started again). None: start it."""
        return None

    def step_started(self, step: Step, stream: ClientStream, submission: Submission) -> None:
        """The core admitted the step; ``stream`` is its client's."""

    def delivered(self, delivery: Delivery) -> None:
        """A completion of a step is in its stream (``delivery.ended``: the step's last)."""

    def step_ended(self, step: Step, remote: mpb.RemoteTimings | None) -> None:
        """The step ended once: finished (``remote``: its remote timings, for the client) or
        abandoned (``step.outcome`` says which)."""

    def client_left(self, stream: ClientStream) -> bool:
        """The stream's client went away. True: this observer keeps the step running (it
        abandons it itself later, through the shell); False: the shell abandons it now."""
        return False

    def worker_joined(self, worker_id: str, kind: str) -> None:
        """A worker joined the core (``kind``: as it registered)."""

    def worker_lost(self, worker_id: str) -> None:
        """A worker was lost; its requests went elsewhere or wait."""

    def before_tick(self) -> list[Command]:
        """Commands due now, applied already; carried out before the core's tick."""
        return []

    def after_tick(self) -> None:
        """The core's tick ran and its commands were carried out."""

    def scope_opened(self, key: Hashable, window_s: float) -> list[str]:
        """An agentic step's scope (HoldSeedWindow) opened: the workers it holds for it."""
        return []

    def scope_closed(self, key: Hashable) -> None:
        """The scope ended (also when its client went away)."""

    def refresh_gauges(self) -> None:
        """/metrics is scraped."""
