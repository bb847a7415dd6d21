"""An agentic step's groups (``--env``): each prompt item is one episode (its reset seed follows
from the item's index, so a resumed run replays the same episodes), played by a GRPO group of
``samples_per_prompt`` trajectories through the manager turn by turn (environments/runner.py).
A group trains as soon as it is played. The model's tokens train; the environment's
observations are context only (loss mask). A trajectory the environment failed scores 0 and
trains nothing; the step goes on.

Placed (WEAVE): one phase at a time, so the groups train once the rollout phase ended and the
training permit is held. Tail batching's short round (RollPacker): every episode of the round
plays R trajectories; the first P0 groups to end R0 of them train, and the rest (the tail) are
cancelled and deferred to a long round. Otherwise every group trains whole."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import uuid
from collections.abc import Callable

from rlharvest.models.model_tokenizer import ModelTokenizer
from rlharvest.services.rollout_manager.client import StepScope, hold_agentic_step
from rlharvest.services.trainer import metrics
from rlharvest.services.trainer.config import TrainerConfig
from rlharvest.services.trainer.environments.catalog import load_environment
from rlharvest.services.trainer.environments.interface import takes_task
from rlharvest.services.trainer.environments.runner import (
    Generate,
    PlayConfig,
    Trajectory,
    manager_generator,
    play_group,
    rewarded_group,
)
from rlharvest.services.trainer.rollout_source import RolloutOutcome, SeedWindow, StepRun, Trainee
from rlharvest.services.trainer.status import Progress
from rlharvest.services.trainer.step_plan import StepSpec, sample_seed
from rlharvest.services.trainer.stream_trainer import RewardedGroup

if sys.version_info >= (3, 11):
    from asyncio import TaskGroup
else:  # Python 3.10: the backport of the 3.11 structured-concurrency API
    from taskgroup import TaskGroup

log = logging.getLogger(__name__)


class AgenticSource:
    def __init__(self, cfg: TrainerConfig, tok: ModelTokenizer, *, window: SeedWindow, hold_steps: bool, clock: Callable[[], float]) -> None:
        assert cfg.env, "an agentic source plays an environment (--env)"
        self._cfg = cfg
        self._tok = tok
        self._env: type = load_environment(cfg.env)
        # It plays the step's dataset items (reset(seed, task)), or episodes of its own.
        self._takes_task = takes_task(self._env)
        self._window = window
        self._hold_steps = hold_steps
        self._clock = clock

    async def roll_out(self, run: StepRun, trainee: Trainee) -> RolloutOutcome:
        play_cfg = self._play_config(run.spec)
        run.progress.phase = "rollout"
        endpoint = run.manager.endpoint
        outcome = RolloutOutcome()
        async with self._hold(endpoint, run.spec, await self._window.next_s()) as scope, \
                manager_generator(endpoint, play_cfg) as generate, TaskGroup() as tasks:
            held = await self._play(run, generate, play_cfg, tasks, trainee, outcome)
        outcome.rollout_s = self._clock() - run.started
        await run.permits.end_rollout()
        await run.permits.train()
        if held:
            await trainee.train(held)
        outcome.deferred = sorted(set(range(len(run.spec.items))) - set(outcome.accepted))
        outcome.accepted.sort()
        outcome.remote = scope.remote if scope is not None else None
        return outcome

    async def _play(self, run: StepRun, generate: Generate, play_cfg: PlayConfig,
                    tasks: TaskGroup, trainee: Trainee, outcome: RolloutOutcome
                    ) -> list[RewardedGroup]:
        """Every group's episodes until the step's groups are played; returns those that train
        after the rollout: all when placed, else the last (after the step's scope ends, so the
        manager's timings measure the rollout, as a SubmitStep step's do)."""
        spec, progress = run.spec, run.progress
        reporter = run.permits.report_tail(tasks, lambda: run.manager.endpoint, spec.samples,
                                             lambda: progress.completions)
        playing = [tasks.create_task(self._group(generate, play_cfg, spec, g))
                   for g in range(len(spec.items))]
        held: list[RewardedGroup] = []
        for played in asyncio.as_completed(playing):
            idle_since = self._clock()
            g, trajectories = await played
            outcome.waited_s += self._clock() - idle_since
            outcome.accepted.append(g)
            _count_played(spec, trajectories, progress)
            last = len(outcome.accepted) == spec.train_groups
            if run.permits.phased or last:
                held.append(rewarded_group(g, trajectories))
            else:
                await trainee.train([rewarded_group(g, trajectories)])
            if last:
                break
        for tail in playing:  # a short round's tail (none otherwise)
            tail.cancel()
        if reporter is not None:
            reporter.cancel()
        return held

    async def _group(self, generate: Generate, play_cfg: PlayConfig, spec: StepSpec,
                     g: int) -> tuple[int, list[Trajectory]]:
        item = spec.items[g]
        seed = sample_seed(self._cfg.data_seed, 0, item.index, 0)
        return g, await play_group(generate, self._env, f"s{spec.step}-g{g}", seed,
                                   spec.samples_per_prompt, play_cfg, keep=spec.group_size,
                                   tokenizer=self._tok,
                                   task=item if self._takes_task else None)

    def _play_config(self, spec: StepSpec) -> PlayConfig:
        cfg = self._cfg
        return PlayConfig(weight_version=spec.weight_version, max_turns=cfg.env_max_turns,
                          max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                          top_p=cfg.top_p, context=cfg.env_context,
                          env_timeout_s=cfg.env_timeout_s,
                          no_worker_deadline_s=cfg.no_worker_deadline_s,
                          stop_token_ids=tuple(self._tok.stop_ids))

    def _hold(self, endpoint: str, spec: StepSpec, window_s: float
              ) -> contextlib.AbstractAsyncContextManager[StepScope | None]:
        """With the instance cap on: the step's turns are many Generate calls, not one
        SubmitStep that carries the seeding window and comes back with the step's remote
        timings, so the step is held open on the manager while they play
        (``hold_agentic_step``). With --seed-role the seed engine takes turns for T_seed, then
        its running turns move with their tokens to the remote workers; either way the
        manager's timings of the step feed Algorithm 1. Nothing without the cap."""
        if not self._hold_steps:
            return contextlib.nullcontext()
        # Unique per attempt: a retried step's window must not be ended by its predecessor's.
        step_id = f"{self._cfg.job}-s{spec.step}-{uuid.uuid4().hex[:8]}"
        return hold_agentic_step(endpoint, step_id, window_s)


def _count_played(spec: StepSpec, trajectories: list[Trajectory], progress: Progress) -> None:
    for t in trajectories:
        metrics.TRAJECTORIES.labels("failed" if t.failed else "played").inc()
        if t.failed:
            log.warning("step %d: trajectory %s failed: %s", spec.step, t.trajectory_id,
                        t.failed)
        progress.completions += 1
        progress.tokens_generated += sum(t.trained)
