"""One RL step, as in the papers' pseudo-code: generate -> reward -> train -> publish.

The step's version is out first (workers roll out only on it); the rollout source generates
and rewards the step's groups, handing each to the streaming update as soon as it may train;
then the one optimizer step, Algorithm 1's update of the instance cap, and the new version's
publish, which goes on in the background while the next step starts."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlharvest.common.pb import trainer_pb2 as tpb
from rlharvest.services.rollout_manager.client import ManagerAt, locate_manager
from rlharvest.services.trainer import metrics
from rlharvest.services.trainer.compute import ComputeThread
from rlharvest.services.trainer.config import TrainerConfig
from rlharvest.services.trainer.instance_cap import InstanceCap
from rlharvest.services.trainer.permits import NoPermits, PermitGate
from rlharvest.services.trainer.publishing import Publishing
from rlharvest.services.trainer.rollout_source import (
    RolloutOutcome, RolloutSource, StepRun, Trainee)
from rlharvest.services.trainer.status import Progress, RunStatus
from rlharvest.services.trainer.step_plan import StepSpec
from rlharvest.services.trainer.step_prompts import StepPrompts
from rlharvest.services.trainer.stream_trainer import StepStats, StreamingStep

log = logging.getLogger(__name__)


@dataclass
class Applied:
    """What the trainer's weights are: the steps applied and the version they carry."""

    step: int = 0
    version: int = 0
    applying: bool = False  # an optimizer step is under way (its failure may leave it half)


class TrainerStep:
    def __init__(self, cfg: TrainerConfig, etcd: Any, *, applied: Applied, status: RunStatus,
                 source: RolloutSource, prompts: StepPrompts, publishing: Publishing,
                 compute: ComputeThread, instance_cap: InstanceCap | None,
                 update: Callable[[StepSpec], StreamingStep],
                 clock: Callable[[], float]) -> None:
        self._cfg = cfg
        self._etcd = etcd
        self._applied = applied
        self._status = status
        self._source = source
        self._prompts = prompts
        self._publishing = publishing
        self._compute = compute
        self._instance_cap = instance_cap
        self._update = update  # the step's streaming GRPO update
        self._clock = clock
        self.permits: PermitGate = NoPermits()

    async def run(self, spec: StepSpec) -> tpb.StepSummary:
        try:
            return await self._run(spec)
        finally:
            self._compute.step_id = None  # a lent record of this step no longer lends anything

    async def _run(self, spec: StepSpec) -> tpb.StepSummary:
        started = self._clock()
        progress = self._status.current = Progress(
            step=spec.step, weight_version=spec.weight_version, samples=spec.samples,
            phase="waiting_version")
        await self._version_out()  # the step's version must be out before workers can hold it
        manager = await self._rollout_manager(progress)
        update = self._update(spec)
        # Generate and reward; every group trains as soon as the source hands it over.
        rollout = await self._source.roll_out(
            StepRun(spec, manager, progress, started, self.permits),
            Trainee(update, self._compute, progress))
        progress.phase = "optimizer"
        stats = await self._apply(spec, update, rollout)
        n_prem = await self._tune_instance_cap(stats, rollout)
        elapsed = self._clock() - started
        if self._publishing.enabled:
            await self._publishing.start(self._applied.version)
        await self.permits.done()
        return self._summary(spec, stats, rollout, elapsed, n_prem)

    async def _version_out(self) -> None:
        """The last version's publish ended, and its version is held somewhere: one published
        to an agent that died before any worker pulled it is published again from the trainer's
        own weights, which are still exactly that version (the next optimizer step has not run).
        A step retried because no worker got the version comes here again."""
        await self.await_publish()
        version = self._applied.version
        if not await self._publishing.lost(version):
            return
        log.warning("version %d is held by no agent and no worker (its agent died before the "
                    "workers pulled it): publishing it again", version)
        metrics.REPUBLISHED.inc()
        await self._publishing.start(version)
        await self.await_publish()

    async def await_publish(self) -> None:
        """The last version's publish, once it ended; its step's summary says how it went."""
        if not self._publishing.in_flight:
            return
        self._status.current.phase = "publish"
        published = await self._publishing.wait()
        if published is not None:
            self._status.published(self._applied.version, *published)

    async def _rollout_manager(self, progress: Progress) -> ManagerAt:
        """The job's manager, under the rollout permit; discovered through etcd unless
        configured (its incarnation tells its successor from it)."""
        await self.permits.rollout(progress)
        manager = await locate_manager(self._etcd, self._cfg.job, self._cfg.manager)
        await self.permits.worker_joined(manager.endpoint, progress)
        return manager

    async def _apply(self, spec: StepSpec, update: StreamingStep,
                     rollout: RolloutOutcome) -> StepStats:
        """The one optimizer step of this RL step. Once the optimizer runs it finishes even if
        the step is cancelled (SIGTERM), and the bookkeeping with it: a goodbye checkpoint then
        holds the updated weights with their step, queue and version, never the old ones."""
        task = asyncio.ensure_future(self._optimizer_step(spec, update, rollout))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            await asyncio.wait([task])
            raise

    async def _optimizer_step(self, spec: StepSpec, update: StreamingStep,
                              rollout: RolloutOutcome) -> StepStats:
        """The update, and with it the step count, the round and the weights' version."""
        applied = self._applied
        applied.applying = True  # until the optimizer step returns: a failure leaves it half
        stats = await self._compute.run(update.finish)
        applied.applying = False
        if self._cfg.bench_train_delay_s:  # a benchmark's slower training node
            await asyncio.sleep(self._cfg.bench_train_delay_s)
        applied.step = spec.step
        # With the step: a retried one never commits its prompts.
        self._prompts.commit(spec, rollout.accepted, rollout.deferred)
        if self._publishing.enabled:
            applied.version += 1
        return stats

    async def _tune_instance_cap(self, stats: StepStats, rollout: RolloutOutcome) -> int:
        """RLBoost's Algorithm 1 on the step's timings: the next N_prem (0 without the cap)."""
        if self._instance_cap is None:
            return 0
        self._instance_cap.rollout_measured(rollout.rollout_s)
        return await self._instance_cap.after_step(stats.compute_s, rollout.waited_s,
                                                   rollout.remote) or 0

    def _summary(self, spec: StepSpec, stats: StepStats, rollout: RolloutOutcome,
                 elapsed: float, n_prem: int) -> tpb.StepSummary:
        cap = self._instance_cap
        return tpb.StepSummary(
            step=spec.step, weight_version=spec.weight_version, mean_reward=stats.mean_reward,
            step_time_s=elapsed, tokens=stats.num_tokens,
            tokens_per_second=stats.num_tokens / max(elapsed, 1e-9),
            migrations=rollout.migrations, micro_batches=stats.micro_batches,
            micro_batch_wait_s=rollout.waited_s, loss=stats.loss, grad_norm=stats.grad_norm,
            train_compute_s=stats.compute_s, n_prem=n_prem,
            t_seed_s=cap.window.schedule.t_seed if cap is not None else 0.0,
            published_version=self._applied.version if self._publishing.enabled else 0,
            round=spec.round, prompts_launched=len(spec.items),
            prompts_deferred=len(rollout.deferred), tokens_discarded=rollout.tokens_discarded,
            rollout_s=rollout.rollout_s, rewards_s=rollout.rewards_s,
            rollout_digest=rollout.digest)
