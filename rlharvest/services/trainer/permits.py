"""The permits a step's phases run under: none (``NoPermits``, every call returns at once), or
WEAVE's placement scheduler's (``PlacedPermits``, --placement-scheduler: placed_phases.py).

A step takes the rollout permit before it submits, gives it back as its last token streams,
takes the training permit before its first micro-batch and gives that back once the optimizer
step ran and the publish started."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from typing import Any, Protocol

from rlharvest.services.rollout_manager.client import wait_workers
from rlharvest.services.trainer import tail_reports
from rlharvest.services.trainer.placed_phases import PlacedPhases
from rlharvest.services.trainer.status import Progress
from rlharvest.services.trainer.step_plan import RolloutFailed

if sys.version_info >= (3, 11):
    from asyncio import TaskGroup
else:  # Python 3.10: the backport of the 3.11 structured-concurrency API
    from taskgroup import TaskGroup


class PermitGate(Protocol):
    @property
    def phased(self) -> bool:
        """Whether training waits for the rollout to end (one phase at a time)."""

    async def rollout(self, progress: Progress) -> None:
        """Before the step's rollout: hold the rollout permit."""

    async def worker_joined(self, manager: str, progress: Progress) -> None:
        """Under the rollout permit: a worker of its nodes joined the job's manager."""

    async def end_rollout(self) -> None:
        """The step's last token streamed."""

    async def train(self) -> None:
        """Once the step's rollout ended: hold the training permit."""

    async def train_after(self, rollout_done: asyncio.Event) -> None:
        """Before a micro-batch trains while the rollout may still run: ``train`` once it
        ended (when ``phased``)."""

    async def done(self) -> None:
        """The step trained and its publish started."""

    def report_tail(self, tasks: TaskGroup, manager: Callable[[], str], total: int,
                    finished: Callable[[], int]) -> asyncio.Task | None:
        """Reports of the rollout's progress, for the scheduler's long-tail migration (None:
        none)."""


class NoPermits:
    """No scheduler: every phase runs when the step gets to it."""

    phased = False

    async def rollout(self, progress: Progress) -> None:
        pass

    async def worker_joined(self, manager: str, progress: Progress) -> None:
        pass

    async def end_rollout(self) -> None:
        pass

    async def train(self) -> None:
        pass

    async def train_after(self, rollout_done: asyncio.Event) -> None:
        pass

    async def done(self) -> None:
        pass

    def report_tail(self, tasks: TaskGroup, manager: Callable[[], str], total: int,
                    finished: Callable[[], int]) -> asyncio.Task | None:
        return None


class PlacedPermits:
    """WEAVE's permits (§5.1): one phase at a time, each on the nodes its permit grants."""

    phased = True

    def __init__(self, phases: PlacedPhases, etcd: Any, *, no_worker_deadline_s: float,
                 progress_s: float) -> None:
        self._phases = phases
        self._etcd = etcd
        self._no_worker_deadline_s = no_worker_deadline_s
        self._progress_s = progress_s

    async def rollout(self, progress: Progress) -> None:
        progress.phase = "waiting_permit"
        await self._phases.rollout()

    async def worker_joined(self, manager: str, progress: Progress) -> None:
        # The permit's node switches its worker to this job now.
        try:
            await wait_workers(manager, 1, timeout=self._no_worker_deadline_s, poll_s=0.01)
        except TimeoutError as exc:  # retried under the rollout permit it holds
            raise RolloutFailed(f"no worker joined the job's manager under its rollout "
                                f"permit: {exc}") from exc
        progress.phase = "rollout"

    async def end_rollout(self) -> None:
        # The rollout nodes go to the next job's rollout now.
        await self._phases.end_rollout()

    async def train(self) -> None:
        await self._phases.train()

    async def train_after(self, rollout_done: asyncio.Event) -> None:
        await rollout_done.wait()
        await self._phases.train()

    async def done(self) -> None:
        await self._phases.done()

    def report_tail(self, tasks: TaskGroup, manager: Callable[[], str], total: int,
                    finished: Callable[[], int]) -> asyncio.Task | None:
        """Until the rollout's tail migrates (tail_reports.py); None when reports are off."""
        run = self._phases.rollout_run
        if run is None or not self._progress_s:
            return None
        return tasks.create_task(tail_reports.report_until_migrated(
            run, self._etcd, manager, total, finished, self._progress_s))
