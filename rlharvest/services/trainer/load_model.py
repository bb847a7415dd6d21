"""Modelled load a run can be told to add (the ``--bench-*`` flags): response lengths from a
model instead of from the policy, and slower rewards. Benchmarks set them; a production run
leaves them off, and then nothing here changes what it does.

A tiny policy on a CPU stops when it samples EOS, which neither has the long tail RL workloads
have (RollPacker §2: max/median response length ~20x) nor stays put while it learns. With
``--bench-length-median`` each request runs exactly a modelled number of tokens (no stop
tokens): a per-prompt difficulty that persists across the prompt's attempts (log-normal around
the median) times per-response noise (log-normal), capped at ``max_new_tokens`` — the model of
``bench/tail_batching.py``. The tokens trained are real.
``--bench-reward-delay-s`` makes each reward take that much longer (``delayed``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import math
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rlharvest.services.trainer.rewards.pool import RewardFn

if TYPE_CHECKING:  # stays as light as the step plan that imports it
    from rlharvest.services.trainer.task_setup import TaskSetup


@dataclass(frozen=True)
class LengthModel:
    median: float
    cap: int
    seed: int = 0
    prompt_sigma: float = 0.9  # spread of prompt difficulty: max/median near 20x at 64 prompts
    response_sigma: float = 0.5

    def tokens(self, prompt_index: int, step: int, sample: int) -> int:
        """Length of one response: the prompt's difficulty x this response's noise."""
        difficulty = random.Random(f"{self.seed}-p{prompt_index}").lognormvariate(
            math.log(self.median), self.prompt_sigma)
        noise = random.Random(f"{self.seed}-p{prompt_index}-s{step}-r{sample}").lognormvariate(
            0.0, self.response_sigma)
        return max(2, min(self.cap, round(difficulty * noise)))


def delayed(fn: RewardFn, delay_s: float) -> RewardFn:
    """``fn`` that first waits ``delay_s`` (a verifier's latency), inside the reward pool's slot
    like real verification work, so the pool's concurrency bounds it; ``fn`` itself at 0."""
    if not delay_s:
        return fn

    async def slow(prompt: str, completion: str, reference: str) -> float:
        await asyncio.sleep(delay_s)
        if inspect.iscoroutinefunction(fn):
            return await fn(prompt, completion, reference)
        return await asyncio.to_thread(fn, prompt, completion, reference)  # type: ignore[arg-type]

    return slow


def delay_rewards(setup: TaskSetup, delay_s: float) -> TaskSetup:
    """``setup`` with each of its rewards ``delayed``; unchanged at 0."""
    if not delay_s:
        return setup
    return dataclasses.replace(
        setup, reward_fn=setup.reward_fn and delayed(setup.reward_fn, delay_s),
        by_source={source: delayed(fn, delay_s) for source, fn in setup.by_source.items()})
