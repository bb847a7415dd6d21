"""Rewards: exact-answer verifier, sandbox limits, RollPacker's adaptive timeout (§4.3), and the
async pool that turns failing or hanging reward functions into recorded failures."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rlharvest.services.trainer.rewards.adaptive_timeout import AdaptiveTimeout, TimeoutPolicy
from rlharvest.services.trainer.rewards.pool import RewardPool, RewardRequest, load_reward_fn
from rlharvest.services.trainer.rewards.sandbox import SandboxLimits, StdioCase, run_case, run_tests
from rlharvest.services.trainer.rewards.verifier import extract_answer, math_reward, verify
from rlharvest.services.trainer.tasks import AdditionTask, DatasetState, TaskDataset

# --- verifier ---------------------------------------------------------------------------------


@pytest.mark.parametrize("completion,reference", [
    ("so the total is \\boxed{42}.", "42"),
    ("\\boxed{\\frac{1}{2}}", "0.5"),
    ("The answer is 1,234.", "1234"),
    ("work...\n#### 7", "7"),
    ("3 apples and then 5 more makes 8", "8"),
    ("Final answer: $x+1$", "x + 1"),
])
def test_verifier_accepts_equivalent_final_answers(completion: str, reference: str) -> None:
    assert verify(completion, reference)


@pytest.mark.parametrize("completion,reference", [
    ("\\boxed{41}", "42"),
    ("42 is wrong, the answer is 43", "42"),  # the final answer counts, not any number
    ("no number here", "1"),
    ("\\boxed{1", "1"),  # cut off mid-answer
])
def test_verifier_rejects_wrong_or_missing_final_answers(completion: str, reference: str) -> None:
    assert not verify(completion, reference)


def test_the_last_boxed_answer_wins_and_nested_braces_survive() -> None:
    assert extract_answer("\\boxed{1} then \\boxed{\\frac{2}{3}}") == "\\frac{2}{3}"
    assert math_reward("", "\\boxed{\\frac{2}{3}}", "4/6") == 1.0


# --- sandbox ----------------------------------------------------------------------------------

ECHO_SUM = "import sys\nprint(sum(map(int, sys.stdin.read().split())))\n"


def test_sandbox_passes_correct_code_and_catches_wrong_output() -> None:
    limits = SandboxLimits(wall_s=10, cpu_s=5)
    assert run_case(ECHO_SUM, StdioCase("a", "2 3", "5"), limits).status == "passed"
    assert run_case(ECHO_SUM, StdioCase("b", "2 3", "6"), limits).status == "wrong_answer"
    crash = run_case("raise SystemExit(3)", StdioCase("c", "", ""), limits)
    assert crash.status == "runtime_error"


def test_sandbox_enforces_the_wall_clock_limit() -> None:
    result = run_case("import time\ntime.sleep(60)", StdioCase("s", "", ""),
                      SandboxLimits(wall_s=0.5, cpu_s=5))
    assert result.status == "timeout"
    assert result.elapsed_s < 5


def test_sandbox_enforces_the_cpu_time_limit() -> None:
    result = run_case("while True:\n    pass", StdioCase("spin", "", ""),
                      SandboxLimits(wall_s=20, cpu_s=1))
    assert result.status == "cpu_limit"
    assert result.elapsed_s < 15


def test_sandbox_enforces_the_memory_limit() -> None:
    code = "blob = bytearray(1024 * 1024 * 1024)\nprint(len(blob))"
    result = run_case(code, StdioCase("m", "", "1073741824"),
                      SandboxLimits(wall_s=10, cpu_s=5, memory_bytes=256 * 2**20))
    assert result.status == "memory_limit"


def test_run_tests_stops_paying_at_the_first_failure() -> None:
    cases = [StdioCase("1", "1 1", "2"), StdioCase("2", "1 1", "3"), StdioCase("3", "2 2", "4")]
    results = run_tests(ECHO_SUM, cases, lambda case: SandboxLimits(wall_s=10, cpu_s=5))
    assert [r.status for r in results] == ["passed", "wrong_answer"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by init) no longer runs.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_sandbox_output_is_capped_on_disk_not_buffered_in_the_trainer() -> None:
    flood = "while True:\n    print('x' * 65536)"
    result = run_case(flood, StdioCase("flood", "", ""),
                      SandboxLimits(wall_s=20, cpu_s=10, file_bytes=4 * 2**20))
    assert result.status == "runtime_error" and result.elapsed_s < 15  # SIGXFSZ, not the wall


def test_sandbox_kills_what_the_candidate_started_when_it_exits() -> None:
    code = ("import subprocess\n"
            "print(subprocess.Popen(['sleep', '1000']).pid)")
    result = run_case(code, StdioCase("bg", "", ""), SandboxLimits(wall_s=10, cpu_s=5))
    assert result.status == "wrong_answer"  # it printed the pid
    pid = int(result.detail.split("'")[1])
    deadline = time.monotonic() + 5
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid)


def test_an_escaped_grandchild_holding_stdout_does_not_hang_the_reward() -> None:
    code = ("import os, time\n"
            "if os.fork() == 0:\n"
            "    os.setsid()\n"
            "    print(os.getpid(), flush=True)\n"
            "    time.sleep(1000)\n"
            "time.sleep(0.5)")
    started = time.monotonic()
    result = run_case(code, StdioCase("escape", "", ""), SandboxLimits(wall_s=5, cpu_s=5))
    assert time.monotonic() - started < 4 and result.status == "wrong_answer"
    os.kill(int(result.detail.split("'")[1]), signal.SIGKILL)  # outside the group: ours to clean


def test_invalid_utf8_output_is_a_wrong_answer_not_a_crash() -> None:
    code = "import sys\nsys.stdout.buffer.write(b'\\xff\\xfe')"
    assert run_case(code, StdioCase("bytes", "", "ok"),
                    SandboxLimits(wall_s=10, cpu_s=5)).status == "wrong_answer"


# --- adaptive timeout (RollPacker §4.3) -------------------------------------------------------

policy = TimeoutPolicy(t_min_s=2.0, t_max_s=30.0, slack=1.5)


@given(st.floats(0.0, 100.0, allow_nan=False))
def test_timeout_is_lambda_anchor_clamped_to_t_min_and_t_max(anchor: float) -> None:
    assert policy.timeout(anchor) == min(max(2.0, 1.5 * anchor), 30.0)
    assert 2.0 <= policy.timeout(anchor) <= 30.0


def test_a_case_without_a_correct_run_gets_t_max() -> None:
    timeouts = AdaptiveTimeout(policy)
    timeouts.observe("case", 0.1, correct=False)
    assert timeouts.anchor("case") is None
    assert timeouts.timeout_for("case") == 30.0


def test_anchor_is_the_slowest_correct_run_per_test_case() -> None:
    timeouts = AdaptiveTimeout(policy)
    for elapsed, correct in [(3.0, True), (8.0, True), (5.0, True), (25.0, False)]:
        timeouts.observe("a", elapsed, correct)
    timeouts.observe("b", 1.0, True)
    assert timeouts.anchor("a") == 8.0
    assert timeouts.timeout_for("a") == 12.0  # 1.5 * 8
    assert timeouts.timeout_for("b") == 2.0  # 1.5 * 1 is below T_min


def test_slack_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="lambda"):
        TimeoutPolicy(slack=0.9)


# --- reward pool ------------------------------------------------------------------------------


def _raising(prompt: str, completion: str, reference: str) -> float:
    raise RuntimeError("judge exploded")


async def test_a_raising_reward_function_becomes_a_recorded_failure() -> None:
    pool = RewardPool(_raising, max_concurrency=2, timeout_s=5.0, failure_reward=-1.0)
    outcome = await pool.score(RewardRequest("s1", "p", "c"))
    assert not outcome.ok and outcome.reward == -1.0 and "judge exploded" in outcome.error


async def test_hanging_reward_functions_fail_within_the_timeout_and_never_stall_others() -> None:
    release = threading.Event()

    def maybe_hang(prompt: str, completion: str, reference: str) -> float:
        if completion == "hang":
            release.wait(30)
        return 1.0

    pool = RewardPool(maybe_hang, max_concurrency=2, timeout_s=0.3)
    requests = [RewardRequest(f"h{i}", "p", "hang") for i in range(3)]
    requests += [RewardRequest(f"ok{i}", "p", "fine") for i in range(3)]
    start = time.perf_counter()
    outcomes = await asyncio.wait_for(pool.score_all(requests), timeout=10)
    elapsed = time.perf_counter() - start
    release.set()
    assert [o.ok for o in outcomes] == [False] * 3 + [True] * 3
    assert all("timed out" in o.error for o in outcomes[:3])
    assert pool.abandoned_calls == 3
    # 3 hangs on 2 slots: two timeout rounds, far from the 30 s the functions would take.
    assert elapsed < 5


async def test_async_reward_functions_are_cancelled_at_the_timeout() -> None:
    async def slow(prompt: str, completion: str, reference: str) -> float:
        await asyncio.sleep(30)
        return 1.0

    outcome = await RewardPool(slow, max_concurrency=1, timeout_s=0.1).score(RewardRequest("a", "", ""))
    assert not outcome.ok and "timed out" in outcome.error


async def test_non_numeric_rewards_are_failures_not_crashes() -> None:
    pool = RewardPool(lambda p, c, r: float("nan"), max_concurrency=1, timeout_s=1.0)
    assert not (await pool.score(RewardRequest("n", "", ""))).ok


async def test_a_request_may_carry_its_own_reward_function_sync_or_async() -> None:
    async def half(prompt: str, completion: str, reference: str) -> float:
        return 0.5

    pool = RewardPool(_raising, max_concurrency=2, timeout_s=5.0)
    routed = await pool.score_all([
        RewardRequest("sync", "p", "#### 4", "4", reward_fn=lambda p, c, r: 1.0),
        RewardRequest("async", "p", "c", "r", reward_fn=half),
        RewardRequest("default", "p", "c", "r")])
    assert [(o.ok, o.reward) for o in routed] == [(True, 1.0), (True, 0.5), (False, 0.0)]


async def test_reward_functions_load_by_import_path() -> None:
    fn = load_reward_fn("rlharvest.services.trainer.rewards.verifier:math_reward")
    pool = RewardPool(fn, max_concurrency=1, timeout_s=5.0)
    outcome = await pool.score(RewardRequest("m", "2+2?", "\\boxed{4}", "4"))
    assert outcome.ok and outcome.reward == 1.0
    with pytest.raises(ValueError, match="package.module:function"):
        load_reward_fn("no_colon_here")
    with pytest.raises(ValueError, match="cannot import"):
        load_reward_fn("rlharvest.no_such_module:fn")


# --- built-in task ----------------------------------------------------------------------------


def test_task_reward_prefers_the_exact_answer_then_closer_answers_then_any_number() -> None:
    r = AdditionTask.reward
    assert r("7", "7") == pytest.approx(1.0)
    assert r("7", "7") > r("6", "7") > r("2", "7") > r("x", "7") == 0.0
    assert r("77", "7") < r("7", "7")  # not stopping costs the stop bonus
    assert r("7000", "0") == r("70", "0")  # padding earns nothing


def test_dataset_resumes_exactly_where_it_stopped() -> None:
    straight = TaskDataset(seed=3)
    expected = straight.next_batch(5) + straight.next_batch(7)
    first = TaskDataset(seed=3)
    seen = first.next_batch(5)
    resumed = TaskDataset.from_state(DatasetState(**first.state().__dict__))
    assert seen + resumed.next_batch(7) == expected
    assert all(int(i.answer) == sum(map(int, i.prompt[:-1].split("+"))) for i in expected)


async def test_a_request_carries_its_kinds_timeout_over_the_pools() -> None:
    async def slow(prompt: str, completion: str, reference: str) -> float:
        await asyncio.sleep(0.5)
        return 1.0

    pool = RewardPool(slow, max_concurrency=2, timeout_s=0.1)
    short, long = await pool.score_all([RewardRequest("math", "", ""),
                                        RewardRequest("code", "", "", timeout_s=5.0)])
    assert not short.ok and "timed out after 0.1s" in short.error
    assert long.ok and long.reward == 1.0


def test_reward_timeouts_apply_per_kind_and_bad_entries_are_refused(tmp_path) -> None:
    from rlharvest.common.model_tokenizer import load_tokenizer
    from rlharvest.services.trainer.config import TrainerConfig
    from rlharvest.services.trainer.task_setup import build_task_setup
    from rlharvest.services.trainer.tasks import TaskItem

    data = tmp_path / "mixed.jsonl"
    data.write_text('{"prompt": "1+1=", "reward_model": {"ground_truth": "2"}, '
                    '"data_source": "gsm8k"}\n'
                    '{"prompt": "print 2", "reward_model": {"ground_truth": "2"}, '
                    '"data_source": "apps"}\n')
    cfg = TrainerConfig.model_validate(dict(data=str(data), reward_timeouts="math=2, code=30",
                                            reward_timeout_s=7))
    setup = build_task_setup(cfg, load_tokenizer("tiny"), context_tokens=1024)
    timeouts = [cfg.reward_timeout_of(setup.kind_of(TaskItem(0, "p", "a", data_source=source)))
                for source in ("gsm8k", "apps", "unknown")]
    assert timeouts == [2.0, 30.0, 7.0]
    builtin = TrainerConfig.model_validate(dict(reward_timeouts="addition=3"))
    assert builtin.reward_timeout_of(build_task_setup(builtin, load_tokenizer("tiny"),
                                                      1024).kind_of(TaskItem(0, "p", "a"))) == 3
    for bad in ("math", "poetry=3", "math=-1", "code=x"):
        with pytest.raises(ValueError, match="give kind=seconds"):
            TrainerConfig.model_validate(dict(reward_timeouts=bad))
    with pytest.raises(ValueError, match="code reward's timeout"):
        TrainerConfig.model_validate(dict(task="code", reward_timeouts="code=2"))
