"""A GRPO step's groups, streaming (RLBoost §4.1, RollPacker §4.4): one SubmitStep of R0 samples
of each of the step's P0 prompts. Each completion is rewarded in the bounded pool as it arrives;
a group whose R0 rewards are in is ready, and every group ready when the update is free trains
together as one micro-batch. ``--pipeline sync`` is the veRL-like baseline: rewards after the
rollout, training after the rewards, m_b groups at a time."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from collections.abc import Callable
from typing import Any

from rlharvest.common.aio import wait_event
from rlharvest.common.pb import rollout_manager_pb2 as mpb
from rlharvest.models.model_tokenizer import ModelTokenizer
from rlharvest.services.rollout_manager.client import ManagerAt
from rlharvest.services.rollout_manager.shard_client import JobStepStream
from rlharvest.services.trainer import metrics
from rlharvest.services.trainer.compute import ComputeThread
from rlharvest.services.trainer.config import TrainerConfig
from rlharvest.services.trainer.load_model import LengthModel
from rlharvest.services.trainer.rewards.pool import RewardPool, RewardRequest
from rlharvest.services.trainer.rollout_source import (
    RolloutOutcome, SeedWindow, StepRun, Trainee, first_failure)
from rlharvest.services.trainer.status import RunStatus
from rlharvest.services.trainer.step_plan import GroupAssembler, ReadyGroup, submit_request
from rlharvest.services.trainer.stream_trainer import Completion, RewardedGroup
from rlharvest.services.trainer.task_setup import TaskSetup

if sys.version_info >= (3, 11):
    from asyncio import TaskGroup
else:  # Python 3.10: the backports of the 3.11 structured-concurrency API
    from exceptiongroup import BaseExceptionGroup
    from taskgroup import TaskGroup

log = logging.getLogger(__name__)


class GrpoSource:
    def __init__(self, cfg: TrainerConfig, etcd: Any, tok: ModelTokenizer, setup: TaskSetup,
                 rewards: RewardPool, *, compute: ComputeThread,
                 window: SeedWindow, status: RunStatus, lengths: LengthModel | None,
                 clock: Callable[[], float]) -> None:
        self.cfg = cfg
        self.etcd = etcd
        self.tok = tok
        self.setup = setup
        self.rewards = rewards
        self.compute = compute
        self._window = window
        self.status = status
        self._lengths = lengths  # benchmarks only: modelled response lengths
        self.clock = clock

    async def roll_out(self, run: StepRun, trainee: Trainee) -> RolloutOutcome:
        cfg = self.cfg
        window_s = await self._window.next_s()
        request = submit_request(run.spec, max_new_tokens=cfg.max_new_tokens,
                                 temperature=cfg.temperature, top_p=cfg.top_p,
                                 stop_token_ids=list(self.tok.stop_ids),
                                 data_seed=cfg.data_seed,
                                 no_worker_deadline_s=cfg.no_worker_deadline_s,
                                 lengths=self._lengths, seed_window_s=window_s)
        self.compute.step_id = request.step_id
        run.progress.phase = "rollout"
        step = _GrpoStep(self, run, request)
        try:
            async with TaskGroup() as tasks:
                step.tasks = tasks
                tasks.create_task(step.rollout())
                await step.train(trainee, window_s)
        except BaseExceptionGroup as failed:
            raise first_failure(failed) from None
        return step.outcome()


class _GrpoStep:
    """One step of a ``GrpoSource``: the stream read into groups, rewarded, trained."""

    tasks: TaskGroup  # the step's rollout and rewards run in it

    def __init__(self, source: GrpoSource, run: StepRun, request: mpb.SubmitStepRequest
                 ) -> None:
        self.source = source
        self.cfg = source.cfg
        self.run = run
        self.spec = run.spec
        self.request = request
        self.clock = source.clock
        self.assembler = GroupAssembler(run.spec)
        self.sync = self.cfg.pipeline == "sync"  # one stage after the other
        self.held: list[tuple[int, int, mpb.Completion]] = []  # sync: rewarded after rollout
        self.ready: asyncio.Queue[ReadyGroup] = asyncio.Queue()
        self.rewarding: dict[int, list[asyncio.Task]] = {}  # by group: a deferred one's cancel
        self.remote: mpb.RemoteTimings | None = None  # the manager's half of Algorithm 1's inputs
        self.rollout_done = asyncio.Event()
        self.measured = RolloutOutcome()
        self.stream = JobStepStream(source.etcd, self.cfg.job, run.manager,
                                 max_message_bytes=self.cfg.max_message_bytes,
                                 resume_wait_s=self.cfg.resume_wait_s, clock=self.clock)

    # ---- generate ------------------------------------------------------------------------

    async def rollout(self) -> None:
        reporter = self.run.permits.report_tail(
            self.tasks, lambda: self.stream.manager.endpoint, len(self.request.requests),
            lambda: self.assembler.completions)
        # A short round's acceptance state dies with its manager: it is retried whole.
        await self.stream.run(self.request, self, may_fail_over=self.spec.accept is None)
        if reporter is not None:
            reporter.cancel()
        self.assembler.check_complete()
        self.measured.rollout_s = self.clock() - self.run.started
        self.rollout_done.set()
        await self.run.permits.end_rollout()  # rewards may still be scoring
        for group, sample, completion in self.held:  # sync: the reward stage starts now
            if group not in self.assembler.deferred:
                self.tasks.create_task(self.reward(group, sample, completion))

    def take(self, event: mpb.StepEvent, request_ids: list[str]) -> None:
        if event.HasField("remote"):
            self.remote = event.remote
        self.assembler.rows(event.batch, request_ids)
        for completion in event.completions:
            self.complete(completion)
        for verdict in event.verdicts:  # after the completions that decided them
            if (done := self.assembler.verdict(verdict.group_id, verdict.accepted)) is not None:
                self.ready.put_nowait(done)
            if not verdict.accepted:
                for task in self.rewarding.pop(self.assembler.group_of(verdict.group_id), []):
                    task.cancel()  # its tokens are discarded; so is its reward
        self.run.progress.completions = self.assembler.completions
        self.run.progress.tokens_generated = self.assembler.tokens_generated

    def resume(self, of: mpb.SubmitStepRequest | None = None) -> mpb.SubmitStepRequest:
        submit, finished = self.assembler.resume(self.request if of is None else of)
        for completion in finished:
            self.complete(completion)
        return submit

    def failed_over(self, successor: ManagerAt) -> None:
        # A resumed step borrows no lent workers: a dead manager's "lent" record would match
        # the step id for ever.
        self.source.compute.step_id = None
        metrics.STEP_RESUMES.inc()

    def complete(self, completion: mpb.Completion) -> None:
        if (place := self.assembler.completion(completion)) is None:
            return
        if self.sync:
            self.held.append((*place, completion))
        else:
            self.rewarding.setdefault(place[0], []).append(
                self.tasks.create_task(self.reward(*place, completion)))

    # ---- reward --------------------------------------------------------------------------

    async def reward(self, group: int, sample: int, completion: mpb.Completion) -> None:
        source, item = self.source, self.spec.items[group]
        text = source.tok.decode(completion.token_ids)
        try:
            outcome = await source.rewards.score(RewardRequest(
                completion.request_id, item.prompt, text, item.answer,
                reward_fn=source.setup.reward_of(item),
                timeout_s=self.cfg.reward_timeout_of(source.setup.kind_of(item))))
        except asyncio.CancelledError:
            metrics.REWARDS.labels("cancelled").inc()
            raise
        metrics.REWARDS.labels("scored" if outcome.ok else "failed").inc()
        if not outcome.ok:
            source.status.reward_failed(self.spec.step, outcome)
        if group == 0 and sample == 0:  # one sample per step, to read what the policy writes
            log.info("sample of step %d: reward %.3f for completion %s (reference %s)",
                     self.spec.step, outcome.reward, json.dumps(text), json.dumps(item.answer))
        done = self.assembler.reward(group, sample, outcome.reward)
        self.measured.rewards_s = self.clock() - self.run.started
        if done is not None:
            self.ready.put_nowait(done)

    # ---- train ---------------------------------------------------------------------------

    async def train(self, trainee: Trainee, window_s: float) -> None:
        """Train on groups as they come, until the step's groups all trained."""
        progress = self.run.progress
        if window_s:  # the trainer's engine rolls out: training waits for the window
            progress.phase = "seeding"
            await wait_event(self.rollout_done, window_s)
            progress.phase = "rollout"
        micro_batch = min(self.cfg.micro_batch_groups, self.spec.train_groups)
        while trainee.groups_received < self.spec.train_groups:
            groups = await self._ready_groups()
            await self.run.permits.train_after(self.rollout_done)
            cut = micro_batch if self.sync else len(groups)
            for first in range(0, len(groups), cut):
                await trainee.train([self._rewarded(g) for g in groups[first:first + cut]])

    async def _ready_groups(self) -> list[ReadyGroup]:
        """The groups ready now (at least one; sync: all of the step's)."""
        idle_since = self.clock()
        groups = [await self.ready.get()]
        if self.sync:  # train after every group is rewarded, m_b groups at a time
            groups += [await self.ready.get() for _ in range(self.spec.train_groups - 1)]
        wait = self.clock() - idle_since
        self.measured.waited_s += wait
        metrics.MICRO_BATCH_WAIT.observe(wait)
        # Groups rewarded while the last micro-batch computed are ready at once: the core
        # trains them together (RLBoost §4.1) instead of m_b at a time.
        while not self.ready.empty():
            groups.append(self.ready.get_nowait())
        return groups

    def _rewarded(self, group: ReadyGroup) -> RewardedGroup:
        prompt = self.spec.prompts[group.group]
        return RewardedGroup(group.group, [
            Completion(prompt, list(c.token_ids), list(c.logprobs)) for c in group.completions],
            list(group.rewards))

    def outcome(self) -> RolloutOutcome:
        out, assembler = self.measured, self.assembler
        out.accepted, out.deferred = list(assembler.accepted), list(assembler.deferred)
        out.remote = self.remote
        out.migrations = assembler.migrations
        out.tokens_discarded = assembler.tokens_discarded
        out.digest = assembler.digest()
        return out
