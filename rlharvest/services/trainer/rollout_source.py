"""Where a step's rewarded groups come from. A source generates the step's samples on the job's
workers and rewards them, handing each group to the step's update as soon as it may train:
``GrpoSource`` streams one SubmitStep and scores its completions (grpo_source.py),
``AgenticSource`` plays multi-turn episodes in an environment (agentic_source.py)."""

from __future__ import annotations

import asyncio
import sys
from dataclasses import dataclass, field
from typing import Any, Protocol

from rlharvest.common.pb import rollout_manager_pb2 as mpb
from rlharvest.services.rollout_manager.client import ManagerAt
from rlharvest.services.trainer.compute import ComputeThread
from rlharvest.services.trainer.instance_cap import InstanceCap
from rlharvest.services.trainer.permits import PermitGate
from rlharvest.services.trainer.seed_role import SeedRole
from rlharvest.services.trainer.status import Progress
from rlharvest.services.trainer.step_plan import StepSpec
from rlharvest.services.trainer.stream_trainer import RewardedGroup, StreamingStep

if sys.version_info < (3, 11):  # Python 3.10: the backport of the 3.11 exception groups
    from exceptiongroup import BaseExceptionGroup


@dataclass(frozen=True)
class StepRun:
    """A step about to roll out: what it runs, on which manager, since when, under which
    permits."""

    spec: StepSpec
    manager: ManagerAt
    progress: Progress
    started: float
    permits: PermitGate


@dataclass
class RolloutOutcome:
    """What the rollout of a step measured, for its summary and Algorithm 1."""

    accepted: list[int] = field(default_factory=list)  # groups trained (a short round's)
    deferred: list[int] = field(default_factory=list)  # groups left to a long round
    waited_s: float = 0.0  # training idle, waiting for groups
    rollout_s: float = 0.0  # from the step's start until its last token
    rewards_s: float = 0.0  # from the step's start until its last reward
    remote: mpb.RemoteTimings | None = None  # the manager's timings of the step
    migrations: int = 0
    tokens_discarded: int = 0
    digest: str = ""


class Trainee:
    """The step's update, fed group by group on the training thread."""

    def __init__(self, step: StreamingStep, compute: ComputeThread, progress: Progress) -> None:
        self._step = step
        self._compute = compute
        self._progress = progress

    @property
    def groups_received(self) -> int:
        return self._step.groups_received

    async def train(self, groups: list[RewardedGroup]) -> None:
        await self._compute.run(self._step.add_groups, groups)
        self._progress.groups_trained = self._step.groups_received


class RolloutSource(Protocol):
    async def roll_out(self, run: StepRun, trainee: Trainee) -> RolloutOutcome:
        """Generate and reward the step's groups, each into ``trainee`` as it may train."""


class SeedWindow:
    """The next step's seeding window T_seed (RLBoost Algorithm 1): 0 without the seed role."""

    def __init__(self, seed: SeedRole | None, cap: InstanceCap | None) -> None:
        self._seed = seed
        self._cap = cap

    async def next_s(self) -> float:
        """T_seed, once a manager holds a session with the seed engine (else it idles)."""
        if self._seed is None or self._cap is None:
            return 0.0
        window_s = self._cap.window.schedule.t_seed
        if window_s:
            await self._seed.wait_connected()
        return window_s


def first_failure(failed: BaseExceptionGroup[Any]) -> BaseException:
    """A rollout and its rewards fail for one reason at a time: that one, not the group."""
    return next((e for e in failed.exceptions if not isinstance(e, asyncio.CancelledError)),
                failed)

