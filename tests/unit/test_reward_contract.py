"""Every built-in reward keeps the contract of docs/rewards.md when run through the real reward
pool: a finite number in [0, 1] (never a bool), the same for the same arguments, a missing answer
scores 0, and garbage in never escapes the pool as an exception. A user function loaded by import
path goes through the same checks."""

from __future__ import annotations

import math

import pytest

from rlharvest.services.trainer.rewards.builtin import BUILTIN_REWARDS, resolve_reward
from rlharvest.services.trainer.rewards.pool import RewardPool, RewardRequest

# (reference, a completion that earns full marks) per built-in.
RIGHT = {
    "math": ("42", "6 * 7 = 42\n#### 42"),
    "exact": ("Paris", "Paris"),
    "code": ('{"inputs": ["2\\n"], "outputs": ["4\\n"]}', "print(int(input()) * 2)"),
}
GARBAGE = ["", " ", "\x00\x01\x02", "\u2603" * 50, "```python\n", "\\boxed{", "####",
           "x" * 200_000, "None", "nan", "-inf", "1/0", "#### 1/0"]


@pytest.fixture
def pool_for():
    def make(fn):
        return RewardPool(fn, max_concurrency=4, timeout_s=30.0)
    return make


def test_every_built_in_is_covered():
    assert set(RIGHT) == set(BUILTIN_REWARDS)


@pytest.mark.parametrize("name", sorted(BUILTIN_REWARDS))
async def test_a_built_in_returns_a_finite_reward_in_0_1_deterministically(name, pool_for):
    reference, right = RIGHT[name]
    pool = pool_for(BUILTIN_REWARDS[name])
    outcomes = await pool.score_all([RewardRequest(f"s{i}", "prompt", text, reference)
                                     for i, text in enumerate([right, right, "no answer here"])])
    assert [o.ok for o in outcomes] == [True, True, True], outcomes
    assert [o.reward for o in outcomes] == [1.0, 1.0, 0.0]
    direct = BUILTIN_REWARDS[name]("prompt", right, reference)
    assert type(direct) is float and math.isfinite(direct)  # a float, never a bool


@pytest.mark.parametrize("name", sorted(BUILTIN_REWARDS))
async def test_garbage_completions_score_without_escaping_the_pool(name, pool_for):
    reference, _ = RIGHT[name]
    pool = pool_for(BUILTIN_REWARDS[name])
    outcomes = await pool.score_all([RewardRequest(f"g{i}", "", text, reference)
                                     for i, text in enumerate(GARBAGE)])
    for text, outcome in zip(GARBAGE, outcomes):
        assert 0.0 <= outcome.reward <= 1.0 and math.isfinite(outcome.reward), (text[:20], outcome)
        # A verdict with a reason is allowed (a program that crashed); a bug is not.
        assert outcome.ok or not outcome.error.split(":")[0].endswith("Error"), outcome


async def test_a_user_function_by_import_path_is_held_to_the_same_contract(pool_for):
    fn = resolve_reward("rlharvest.services.trainer.rewards.verifier:math_reward")
    outcome = await pool_for(fn).score(RewardRequest("u", "", "#### 7", "7"))
    assert outcome.ok and outcome.reward == 1.0
