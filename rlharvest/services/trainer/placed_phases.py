"""``--placement-scheduler``: the trainer runs each step's phases under WEAVE's permits (§5.1).

A step is one meta-iteration of the job: its rollout (from submitting the step until the last
token streamed) holds the permit of the job's rollout nodes, its training (micro-batches, the
optimizer step, the start of the publish) the permit of its training nodes. The scheduler
grants each node to the jobs of its group in round-robin order, so another job's phase fills
this job's bubble: its rollout while this one trains, and the other way round.

What a phase boundary means here, where the paper leaves it to the framework:
- The rollout permit goes back as the last token streams (rewards may still be scoring); the
  training permit is taken before the first micro-batch. Training waits for the rollout to
  end: holding both permits at once would make the nodes' turns wait on each other.
- A step that fails during its rollout keeps the rollout permit and retries under it; one that
  fails after its rollout ends that iteration (its training phase runs empty) and is retried as
  the next: the scheduler's iterations count phases run, not steps applied.
"""

from __future__ import annotations

import asyncio
import logging
import time

from rlharvest.services.placement_scheduler.client import PhaseRun, PlacementJob
from rlharvest.services.placement_scheduler.model import Pool
from rlharvest.services.trainer import metrics

log = logging.getLogger(__name__)


class PlacedPhases:
    """The permits of one job's phases; the trainer calls ``rollout``, ``end_rollout``,
    ``train``, ``done`` (concurrent calls take turns)."""

    def __init__(self, job: PlacementJob) -> None:
        self._job = job
        self._held: PhaseRun | None = None
        self._granted_at = 0.0
        self._lock = asyncio.Lock()

    @property
    def _holding(self) -> PhaseRun | None:
        """The permit held: released only once the job's next phase moved past it (a release
        cancelled mid-call may still have gone through; then nothing is held)."""
        run = self._held
        if run is None or self._job.next_phase != (run.phase, run.iteration):
            return None
        return run

    @property
    def rollout_run(self) -> PhaseRun | None:
        """The rollout permit held now, if any (its progress reports go through it)."""
        run = self._holding
        return run if run is not None and run.phase is Pool.ROLLOUT else None

    async def rollout(self) -> None:
        """Before the step's rollout: hold the rollout permit (kept by a retried rollout)."""
        async with self._lock:
            if (run := self._holding) is not None and run.phase is Pool.ROLLOUT:
                return
            await self._release()  # a step retried from its training phase: that iteration ends
            if self._job.next_phase[0] is Pool.TRAIN:  # failed between the two phases
                await self._acquire(Pool.TRAIN)
                await self._release()
            await self._acquire(Pool.ROLLOUT)

    async def end_rollout(self) -> None:
        """The step's last token streamed: the rollout nodes pass to the next job now, while
        rewards are still being scored."""
        async with self._lock:
            if (run := self._holding) is not None and run.phase is Pool.ROLLOUT:
                await self._release()

    async def train(self) -> None:
        """Once the step's rollout has ended: hold the training permit."""
        async with self._lock:
            if (run := self._holding) is not None and run.phase is Pool.TRAIN:
                return
            await self._release()
            await self._acquire(Pool.TRAIN)

    async def done(self) -> None:
        """Release the permit held, if any: the nodes pass to the next job whose turn it is."""
        async with self._lock:
            await self._release()

    async def _release(self) -> None:
        run = self._holding
        if run is None:
            self._held = None  # nothing held, or a release cancelled mid-call went through
            return
        held = time.monotonic() - self._granted_at
        metrics.PERMIT_HELD_SECONDS.labels(run.phase.value).observe(held)
        # Logged before the call: no other job can be granted these nodes before this line.
        log.info("placement: %s #%d of job %s ends after %.3f s; releasing", run.phase.value,
                 run.iteration, self._job.spec.job_id, held)
        # Shielded: once asked, the release completes (and moves next_phase) even if the step
        # is cancelled meanwhile; _holding then reads it as released.
        await asyncio.shield(self._job.release(run))
        self._held = None

    async def _acquire(self, phase: Pool) -> None:
        asked = time.monotonic()
        self._held = await self._job.acquire(phase)
        self._granted_at = time.monotonic()
        wait = self._granted_at - asked
        metrics.PERMIT_WAIT_SECONDS.labels(phase.value).observe(wait)
        log.info("placement: %s #%d of job %s granted on %s after waiting %.3f s", phase.value,
                 self._held.iteration, self._job.spec.job_id, ",".join(self._held.node_ids),
                 wait)
