"""Built-in code task: write a Python expression whose printed value is a target number.

The prompt ``"7=="`` asks for an expression (``7``, ``3+4``, ``14//2``) that the sandbox runs
as ``print(<expression>)``; the test case passes when it prints ``7``. Every completion really
runs in a limited subprocess (``rewards/sandbox.py``) whose wall-clock limit is RollPacker's
adaptive timeout (§4.3): per test case, 1.5x the slowest correct run, within [T_min, T_max].
The anchors are what the task learns while training, so they travel in checkpoints.

Small enough that a char-level tiny model finds passing answers from a random init (a single
digit is a valid program); every sample costs an interpreter start, so this is the task for the
reward path (sandbox, timeouts, failures), not for the few-minute demo.
"""

from __future__ import annotations

import asyncio
import random
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from rlharvest.services.trainer.rewards.adaptive_timeout import AdaptiveTimeout, TimeoutPolicy
from rlharvest.services.trainer.rewards.pool import RewardFailure
from rlharvest.services.trainer.rewards.sandbox import CaseResult, SandboxLimits, StdioCase, run_case
from rlharvest.services.trainer.tasks import TaskItem

# A program that ran and printed the wrong thing earns a little: the format (a valid
# expression, then stop) is what a random init learns first, as in the addition task.
RAN_REWARD = 0.2
PASSED_REWARD = 1.0


@dataclass(frozen=True)
class CodeTaskConfig:
    timeouts: TimeoutPolicy = TimeoutPolicy()
    limits: SandboxLimits = SandboxLimits()  # wall_s and cpu_s are replaced per run
    max_target: int = 9
    # Sandbox runs at once: the trainer's reward concurrency, so a run never queues for a
    # thread and its reward timeout covers only the run (T_max plus interpreter start).
    workers: int = 8


def program(completion: str) -> str:
    """The program a completion stands for."""
    return f"print({completion.strip()})\n"


def grade(result: CaseResult) -> float:
    """A sandbox run's reward; a run that crashed or hit a limit raises RewardFailure so the
    sample is recorded as a failure with the reason, not silently scored 0."""
    if result.passed:
        return PASSED_REWARD
    if result.status == "wrong_answer":
        return RAN_REWARD
    raise RewardFailure(f"{result.status} after {result.elapsed_s:.2f}s: {result.detail}".strip())


class CodeTask:
    name = "code"

    def __init__(self, seed: int = 0, config: CodeTaskConfig = CodeTaskConfig()) -> None:
        if not 0 <= config.max_target <= 9:
            raise ValueError(f"max_target must be in 0..9 (one-digit answers), got "
                             f"{config.max_target}")
        if config.workers < 1:
            raise ValueError(f"workers must be >= 1, got {config.workers}")
        self._seed = seed
        self._config = config
        self._timeouts = AdaptiveTimeout(config.timeouts)
        # Its own threads, not asyncio's default executor: a slow sandbox run must not delay
        # the trainer's other to_thread work, nor wait behind it.
        self._pool: ThreadPoolExecutor | None = None

    def item(self, index: int) -> TaskItem:
        rng = random.Random(self._seed * 1_000_003 + index)
        target = rng.randint(0, self._config.max_target)
        return TaskItem(index=index, prompt=f"{target}==", answer=str(target))

    def timeout_for(self, prompt: str) -> float:
        """The wall-clock limit the next run of this prompt's test case gets."""
        return self._timeouts.timeout_for(prompt)

    async def score(self, prompt: str, completion: str, answer: str) -> float:
        if not completion.strip():
            return 0.0  # print() would "run": an empty answer must not earn RAN_REWARD
        # The prompt names the test case: all prompts asking for one target share it.
        case = StdioCase(case_id=prompt, stdin="", expected_stdout=answer)
        wall = self._timeouts.timeout_for(case.case_id)
        limits = replace(self._config.limits, wall_s=wall, cpu_s=wall)
        # The subprocess waits on a thread; anchors change only here, on the event loop.
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._config.workers, thread_name_prefix="sandbox")
        result = await asyncio.get_running_loop().run_in_executor(
            self._pool, run_case, program(completion), case, limits)
        self._timeouts.observe(case.case_id, result.elapsed_s, result.passed)
        return grade(result)

    def checkpoint_state(self) -> dict[str, Any]:
        return {"timeout_anchors": self._timeouts.snapshot()}

    def restore_state(self, state: dict[str, Any]) -> None:
        self._timeouts.restore(state.get("timeout_anchors", {}))
