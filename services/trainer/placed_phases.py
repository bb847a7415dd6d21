"""``--placement-scheduler``: the trainer runs each step's phases under WEAVE's permits (§5.1).

A step is one meta-iteration of the job: its rollout (from submitting the step until the last
token streamed) holds the permit of the job's rollout nodes, its training (micro-batches, the
optimizer step, the start of the publish) the permit of its training nodes. The scheduler
grants each node to the jobs of its group in round-robin order, so another job's phase fills
this job's bubble: its rollout while this one trains, and the other way round.

What a phase boundary means here, where the paper leaves it to the framework:
- Training waits for the rollout to end (the streaming pipeline still scores rewards while
  tokens stream): holding both permits at once would make the nodes' turns wait on each other.
- A step that fails during its rollout keeps the rollout permit and retries under it; one that
  fails after its rollout ends that iteration (its training phase runs empty) and is retried as
  the next: the scheduler's iterations count phases run, not steps applied.
"""

from __future__ import annotations

import logging
import time

from rlharvest.services.placement_scheduler.client import PhaseRun, PlacementJob
from rlharvest.services.placement_scheduler.model import Pool
from rlharvest.services.trainer import metrics

log = logging.getLogger(__name__)


class PlacedPhases:
    """The permits of one job's phases; the trainer calls ``rollout``, ``train``, ``done``."""

    def __init__(self, job: PlacementJob) -> None:
        self._job = job
        self._held: PhaseRun | None = None
        self._granted_at = 0.0

    async def rollout(self) -> None:
        """Before the step's rollout: hold the rollout permit (kept by a retried rollout)."""
        if self._held is not None and self._held.phase is Pool.ROLLOUT:
            return
        await self.done()  # a step retried from its training phase: that iteration ends here
        if self._job.next_phase[0] is Pool.TRAIN:  # failed between the two phases
            await self._acquire(Pool.TRAIN)
            await self.done()
        await self._acquire(Pool.ROLLOUT)

    async def train(self) -> None:
        """Once the step's rollout has ended: trade the rollout permit for the training one."""
        if self._held is not None and self._held.phase is Pool.TRAIN:
            return
        await self.done()
        await self._acquire(Pool.TRAIN)

    async def done(self) -> None:
        """Release the permit held, if any: the nodes pass to the next job whose turn it is."""
        run, self._held = self._held, None
        if run is None:
            return
        await self._job.release(run)
        held = time.monotonic() - self._granted_at
        metrics.PERMIT_HELD_SECONDS.labels(run.phase.value).observe(held)
        log.info("placement: %s #%d of job %s released after %.3f s", run.phase.value,
                 run.iteration, self._job.spec.job_id, held)

    async def _acquire(self, phase: Pool) -> None:
        asked = time.monotonic()
        self._held = await self._job.acquire(phase)
        self._granted_at = time.monotonic()
        wait = self._granted_at - asked
        metrics.PERMIT_WAIT_SECONDS.labels(phase.value).observe(wait)
        log.info("placement: %s #%d of job %s granted on %s after waiting %.3f s", phase.value,
                 self._held.iteration, self._job.spec.job_id, ",".join(self._held.node_ids),
                 wait)
