"""The built-in code task: every completion runs in the sandbox under RollPacker's adaptive
timeout; crashes and timeouts are recorded failures with a reason; the anchors survive a
checkpoint."""

from __future__ import annotations

import time

import pytest
import torch
from pydantic import ValidationError

from rlharvest.services.trainer.backend import OptimConfig, TorchBackend
from rlharvest.services.trainer.checkpoint import TrainerState, load_latest, save_checkpoint
from rlharvest.services.trainer.code_task import (
    PASSED_REWARD,
    RAN_REWARD,
    CodeTask,
    CodeTaskConfig,
    program,
)
from rlharvest.services.trainer.config import TrainerConfig
from rlharvest.services.trainer.rewards.adaptive_timeout import TimeoutPolicy
from rlharvest.services.trainer.rewards.pool import RewardFailure, RewardPool, RewardRequest
from rlharvest.services.trainer.tasks import DatasetState, TaskDataset

# T_min well above interpreter start-up on a loaded 2-core box; T_max short enough to wait for.
POLICY = TimeoutPolicy(t_min_s=1.0, t_max_s=4.0, slack=1.5)
HANG = "__import__('time').sleep(60)"


def task() -> CodeTask:
    return CodeTask(seed=0, config=CodeTaskConfig(timeouts=POLICY))


def test_items_ask_for_an_expression_printing_a_one_digit_target() -> None:
    items = [task().item(i) for i in range(20)]
    assert items == [task().item(i) for i in range(20)]  # a pure function of (seed, index)
    assert all(i.prompt == f"{i.answer}==" and i.answer.isdigit() for i in items)
    assert program(" 3+4 ") == "print(3+4)\n"


async def test_a_correct_expression_earns_the_full_reward_and_anchors_the_timeout() -> None:
    code = task()
    assert code.timeout_for("7==") == POLICY.t_max_s  # no correct run yet: the most is allowed
    assert await code.score("7==", "3+4", "7") == PASSED_REWARD
    anchor = code.checkpoint_state()["timeout_anchors"]["7=="]
    assert code.timeout_for("7==") == POLICY.timeout(anchor) < POLICY.t_max_s


async def test_a_wrong_expression_earns_only_the_ran_reward_and_moves_no_anchor() -> None:
    code = task()
    assert await code.score("7==", "3+3", "7") == RAN_REWARD
    assert await code.score("7==", "  ", "7") == 0.0  # print() runs, but answers nothing
    assert code.checkpoint_state() == {"timeout_anchors": {}}


async def test_a_crashing_expression_is_a_recorded_failure_with_the_error() -> None:
    pool = RewardPool(task().score, max_concurrency=2, timeout_s=10.0)
    outcome = await pool.score(RewardRequest("s1-g0-r0", "7==", "1/0", "7"))
    assert not outcome.ok and outcome.reward == 0.0
    assert outcome.error.startswith("runtime_error") and "ZeroDivisionError" in outcome.error
    with pytest.raises(RewardFailure, match="runtime_error"):
        await task().score("7==", "7 +", "7")  # a syntax error crashes too


async def test_a_hanging_expression_is_cut_off_at_the_adaptive_timeout() -> None:
    code = task()
    pool = RewardPool(code.score, max_concurrency=2, timeout_s=10.0)
    start = time.perf_counter()
    outcome = await pool.score(RewardRequest("s1-g0-r1", "7==", HANG, "7"))
    assert not outcome.ok and outcome.error.startswith("timeout")
    assert POLICY.t_max_s <= time.perf_counter() - start < 8  # no anchor yet: cut at T_max

    assert (await pool.score(RewardRequest("s1-g0-r2", "7==", "7", "7"))).ok
    cut_at = code.timeout_for("7==")
    assert cut_at < POLICY.t_max_s
    start = time.perf_counter()
    outcome = await pool.score(RewardRequest("s1-g0-r3", "7==", HANG, "7"))
    # With a correct run to compare against, a doomed run fails at lambda * T_anchor.
    assert not outcome.ok and outcome.error.startswith("timeout")
    assert cut_at <= time.perf_counter() - start < POLICY.t_max_s


async def test_timeout_anchors_survive_a_checkpoint(tmp_path) -> None:
    code = task()
    assert await code.score("3==", "1+2", "3") == PASSED_REWARD
    backend = TorchBackend(torch.nn.Linear(2, 2), OptimConfig(optimizer="sgd"))
    save_checkpoint(tmp_path, TrainerState(1, 1, {}, extra={"task": code.checkpoint_state()}),
                    backend.save)

    resumed = task()
    resumed.restore_state(load_latest(tmp_path, backend.load).extra["task"])
    assert resumed.checkpoint_state() == code.checkpoint_state() != {"timeout_anchors": {}}
    assert resumed.timeout_for("3==") == code.timeout_for("3==") < POLICY.t_max_s


def test_a_data_position_resumes_only_on_its_own_task() -> None:
    data = TaskDataset(seed=2, task_factory=lambda seed: CodeTask(seed))
    data.next_batch(3)
    state = data.state()
    assert state == DatasetState(seed=2, position=3, task="code")
    resumed = TaskDataset.from_state(state, lambda seed: CodeTask(seed))
    assert resumed.next_batch(1) == data.next_batch(1)
    with pytest.raises(ValueError, match="resume with --task code"):
        TaskDataset.from_state(state)  # the addition task's positions are another sequence


def test_the_code_task_is_a_config_choice_whose_pool_outlasts_the_sandbox() -> None:
    assert TrainerConfig(task="code").task == "code"
    with pytest.raises(ValidationError, match="must exceed sandbox_t_max_s"):
        TrainerConfig(task="code", reward_timeout_s=5.0, sandbox_t_max_s=5.0)
    with pytest.raises(ValidationError, match="sandbox_t_min_s"):
        TrainerConfig(sandbox_t_min_s=6.0, sandbox_t_max_s=5.0)


async def test_sandbox_runs_use_one_thread_each_up_to_the_reward_concurrency():
    """Four hanging programs on four sandbox threads time out together at T_max, instead of
    queueing for threads (which would eat into the reward timeout)."""
    import asyncio

    quick = TimeoutPolicy(t_min_s=1.0, t_max_s=1.0, slack=1.5)
    code = CodeTask(seed=0, config=CodeTaskConfig(timeouts=quick, workers=4))
    started = time.monotonic()
    outcomes = await asyncio.gather(*(code.score(f"{i}==", HANG, str(i)) for i in range(4)),
                                    return_exceptions=True)
    assert all(isinstance(o, RewardFailure) and "timeout" in str(o) for o in outcomes)
    assert time.monotonic() - started < 3.5  # one wall limit, not four in a row
    with pytest.raises(ValueError, match="workers"):
        CodeTask(seed=0, config=CodeTaskConfig(workers=0))
