"""Rewards: exact-answer verifier, sandbox limits, RollPacker's adaptive timeout (§4.3), and the
async pool that turns failing or hanging reward functions into recorded failures."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rlharvest.services.trainer.rewards.adaptive_timeout import AdaptiveTimeout, TimeoutPolicy
from rlharvest.services.trainer.rewards.pool import RewardPool, RewardRequest, load_reward_fn
from rlharvest.services.trainer.rewards import isolation, sandbox
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
ROOMY = SandboxLimits(wall_s=10, cpu_s=5)  # limits a probe program never reaches


def run_probe(code: str, name: str, expected: str = ""):
    """``code`` run as a candidate with no input, its output checked against ``expected``."""
    return run_case(code, StdioCase(name, "", expected), ROOMY)


def test_sandbox_passes_correct_code_and_catches_wrong_output() -> None:
    limits = SandboxLimits(wall_s=10, cpu_s=5)
    assert run_case(ECHO_SUM, StdioCase("a", "2 3", "5"), limits).status == "passed"
    assert run_case(ECHO_SUM, StdioCase("b", "2 3", "6"), limits).status == "wrong_answer"
    crash = run_case("raise SystemExit(3)", StdioCase("c", "", ""), limits)
    assert crash.status == "runtime_error"


@pytest.mark.parametrize("code", [137, 152, 130])
def test_a_candidate_exiting_with_128_plus_n_is_a_runtime_error_not_a_signal(code: int) -> None:
    """Isolated runs report the candidate's exact status through a pipe: exit(137) is not a
    SIGKILL (cpu_limit), exit(152) not a SIGXCPU."""
    assert sandbox._isolated  # the default; this test is about the isolated path
    result = run_case(f"raise SystemExit({code})", StdioCase("x", "", ""),
                      SandboxLimits(wall_s=10, cpu_s=5))
    assert result.status == "runtime_error", result


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
    results = run_tests(ECHO_SUM, cases, lambda case: ROOMY)
    assert [r.status for r in results] == ["passed", "wrong_answer"]


def _running(marker: str) -> bool:
    """Whether a live process on this machine has ``marker`` in its command line. Pids a
    candidate prints are its PID namespace's, not ours: look for what it ran instead."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{entry}/stat") as f:
                zombie = f.read().rsplit(")", 1)[1].split()[0] == "Z"
        except OSError:  # it ended meanwhile
            continue
        if marker.encode() in cmdline and not zombie:
            return True
    return False


def _gone_soon(marker: str, within_s: float = 5.0) -> bool:
    deadline = time.monotonic() + within_s
    while _running(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _running(marker)


def test_sandbox_kills_what_the_candidate_started_when_it_exits() -> None:
    marker = f"{1000 + os.getpid() % 997}.25"  # a sleep no one else runs
    code = ("import subprocess\n"
            f"subprocess.Popen(['sleep', '{marker}'])\n"
            "print('started')")
    result = run_probe(code, "bg")
    assert result.status == "wrong_answer"  # it ran and printed
    assert _gone_soon(marker)


def test_an_escaped_grandchild_holding_stdout_does_not_hang_the_reward_or_outlive_it() -> None:
    marker = f"{2000 + os.getpid() % 997}.5"
    code = ("import os, time\n"
            "if os.fork() == 0:\n"
            "    os.setsid()\n"
            "    print('escaped', flush=True)\n"
            f"    os.execvp('sleep', ['sleep', '{marker}'])\n"
            "time.sleep(0.5)")
    started = time.monotonic()
    result = run_case(code, StdioCase("escape", "", ""), SandboxLimits(wall_s=5, cpu_s=5))
    assert time.monotonic() - started < 4 and result.status == "wrong_answer"
    # Its own session, so the group kill misses it; its PID namespace does not.
    assert _gone_soon(marker)


def test_a_candidate_cannot_open_a_socket_even_to_loopback() -> None:
    code = ("import socket\n"
            "s = socket.socket()\n"
            "s.settimeout(2)\n"
            "try:\n"
            "    s.connect(('127.0.0.1', 1))\n"
            "except OSError as e:\n"
            "    print(e.errno)")
    result = run_probe(code, "net", "101")
    assert result.status == "passed", result.detail  # ENETUNREACH: no interface at all


def test_a_candidate_sees_only_its_directory_and_the_interpreter(tmp_path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("the trainer's")
    code = (f"import os\n"
            f"print(os.path.exists({str(secret)!r}), os.path.exists({os.getcwd()!r}),\n"
            f"      sorted(os.listdir('/')))")
    result = run_probe(code, "fs")
    seen = result.detail
    assert "False False" in seen, seen
    assert "'usr'" in seen and "'home'" not in seen and "'etc'" not in seen, seen


@pytest.mark.parametrize("replace", [
    "os.mkfifo('stdout')",  # opening it with no writer blocked the reward's thread for good
    "os.symlink('/etc/hostname', 'stdout')",  # the trainer would read a host file as output
])
def test_a_candidate_replacing_its_output_file_changes_only_its_own_copy(replace: str) -> None:
    """Isolated, the work directory a candidate sees is a tmpfs holding copies: what it does
    to 'stdout' there touches nothing the trainer reads; what it printed is its output."""
    code = f"import os\nprint('42', flush=True)\nos.remove('stdout')\n{replace}\n"
    result = run_case(code, StdioCase("swap", "", "42"), SandboxLimits(wall_s=3, cpu_s=3))
    assert result.status == "passed", result


@pytest.mark.parametrize("replace", ["os.mkfifo('stdout')",
                                     "os.symlink('/etc/hostname', 'stdout')"])
def test_unisolated_a_candidate_replacing_its_output_file_gets_a_runtime_error(
        monkeypatch, replace: str) -> None:
    monkeypatch.setattr(sandbox, "_isolated", False)
    code = f"import os\nos.remove('stdout')\n{replace}\n"
    result = run_case(code, StdioCase("swap", "", ""), SandboxLimits(wall_s=3, cpu_s=3))
    assert result.status == "runtime_error", result
    assert "replaced its output file" in result.detail


def test_the_process_limit_holds_even_when_the_trainer_runs_as_root() -> None:
    """300 forks of which the limit lets fewer than 16 succeed, whoever runs the trainer (as
    root the kernel ignores RLIMIT_NPROC: the candidate runs as a uid of its own)."""
    code = ("import os, time\n"
            "n = 0\n"
            "for _ in range(300):\n"
            "    try:\n"
            "        pid = os.fork()\n"
            "    except OSError:\n"
            "        break\n"
            "    if pid == 0:\n"
            "        time.sleep(3)\n"
            "        os._exit(0)\n"
            "    n += 1\n"
            "print(n < 16)")
    result = run_case(code, StdioCase("forks", "", "True"),
                      SandboxLimits(wall_s=8, cpu_s=8, processes=16))
    assert result.status == "passed", result


def test_what_a_candidate_writes_is_bounded_in_total_not_only_per_file() -> None:
    """Files each under the per-file limit, 160 MB in all, against a 32 MB work directory."""
    code = ("written = 0\n"
            "try:\n"
            "    for i in range(20):\n"
            "        with open(f'f{i}', 'wb') as out:\n"
            "            out.write(b'x' * (8 << 20))\n"
            "        written += 8\n"
            "except OSError as exc:\n"
            "    print('full', exc.errno == 28, written < 32)")
    result = run_case(code, StdioCase("disk", "", "full True True"),
                      SandboxLimits(wall_s=8, cpu_s=8, disk_bytes=32 * 2**20))
    assert result.status == "passed", result


def test_a_candidate_cannot_open_kernel_settings_for_writing_even_as_root() -> None:
    """procfs grants uid 0 writes to /proc/sys by file mode, without a capability: a trainer
    run as root (no user namespace) must still not hand the candidate kernel.core_pattern.
    The sandbox's /proc is mounted read-only, which the candidate sees whoever runs it (a
    non-root run would refuse the writes anyway, so the mount itself is checked)."""
    code = ("import os\n"
            "for p in ('/proc/sys/kernel/core_pattern', '/proc/sys/vm/drop_caches',\n"
            "          '/proc/sysrq-trigger'):\n"
            "    try:\n"
            "        os.close(os.open(p, os.O_WRONLY))\n"
            "        print('writable', p)\n"
            "    except OSError:\n"
            "        print('refused')\n"
            "proc = [l.split() for l in open('/proc/self/mountinfo') if l.split()[4] == '/proc']\n"
            "print('ro' in proc[0][5].split(','))\n")
    result = run_probe(code, "sysctl", "refused\nrefused\nrefused\nTrue")
    assert result.status == "passed", result.detail


def test_a_candidate_holds_no_capability_so_it_can_neither_chroot_out_nor_remount() -> None:
    code = ("import os, subprocess\n"
            "os.mkdir('up')\n"
            "try:\n"
            "    os.chroot('up')\n"  # the first move of the classic climb out of a chroot
            "    print('chrooted')\n"
            "except PermissionError:\n"
            "    print('no-chroot')\n"
            "r = subprocess.run(['mount', '-o', 'remount,bind,rw', '/usr'], capture_output=True)\n"
            "print('no-mount' if r.returncode else 'mounted')\n"
            "print(open('/proc/self/status').read().split('CapEff:')[1].split()[0])")
    result = run_probe(code, "caps", "no-chroot\nno-mount\n0000000000000000")
    assert result.status == "passed", result.detail


def test_where_namespaces_are_refused_the_code_sandbox_needs_explicit_consent(monkeypatch):
    # A kernel that refuses namespaces cannot be had here: stand in for its answer.
    monkeypatch.setattr(isolation, "available", lambda: "unshare: Operation not permitted")
    with pytest.raises(sandbox.SandboxUnavailable, match="--allow-unisolated-sandbox"):
        sandbox.configure_isolation(allow_unisolated=False)
    try:
        assert "NOT isolated" in sandbox.configure_isolation(allow_unisolated=True)
        result = run_case("print(2 + 3)", StdioCase("u", "", "5"), SandboxLimits(wall_s=10))
        assert result.status == "passed"  # limits only, but it runs
    finally:
        monkeypatch.undo()
        assert sandbox.configure_isolation(allow_unisolated=False).startswith("isolated")


def test_invalid_utf8_output_is_a_wrong_answer_not_a_crash() -> None:
    code = "import sys\nsys.stdout.buffer.write(b'\\xff\\xfe')"
    assert run_probe(code, "bytes", "ok").status == "wrong_answer"


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
    from rlharvest.models.model_tokenizer import load_tokenizer
    from rlharvest.services.trainer.config import TrainerConfig
    from rlharvest.services.trainer.task_setup import build_task_setup
    from rlharvest.services.trainer.tasks import TaskItem

    data = tmp_path / "mixed.jsonl"
    data.write_text('{"prompt": "1+1=", "reward_model": {"ground_truth": "2"}, '
                    '"data_source": "gsm8k"}\n'
                    '{"prompt": "print 2", "reward_model": {"ground_truth": "2"}, '
                    '"data_source": "apps"}\n')
    cfg = TrainerConfig.model_validate(dict(data=str(data), reward_timeouts="math=2, code=120",
                                            reward_timeout_s=7))
    setup = build_task_setup(cfg, load_tokenizer("tiny"), context_tokens=1024)
    timeouts = [cfg.reward_timeout_of(setup.kind_of(TaskItem(0, "p", "a", data_source=source)))
                for source in ("gsm8k", "apps", "unknown")]
    assert timeouts == [2.0, 120.0, 7.0]
    assert setup.runs_code  # an "apps" row runs programs: the trainer checks the sandbox
    builtin = TrainerConfig.model_validate(dict(reward_timeouts="addition=3"))
    assert not build_task_setup(builtin, load_tokenizer("tiny"), 1024).runs_code
    assert build_task_setup(TrainerConfig.model_validate(dict(task="code")),
                            load_tokenizer("tiny"), 1024).runs_code
    assert builtin.reward_timeout_of(build_task_setup(builtin, load_tokenizer("tiny"),
                                                      1024).kind_of(TaskItem(0, "p", "a"))) == 3
    for bad in ("math", "poetry=3", "math=-1", "code=x"):
        with pytest.raises(ValueError, match="give kind=seconds"):
            TrainerConfig.model_validate(dict(reward_timeouts=bad))
    with pytest.raises(ValueError, match="code reward's timeout"):
        TrainerConfig.model_validate(dict(task="code", reward_timeouts="code=2"))


def test_a_code_timeout_below_the_code_reward_s_worst_case_is_refused_where_it_may_run(
        tmp_path) -> None:
    """The built-in code reward runs up to MAX_CODE_CASES cases one after another: a timeout
    below that scores a correct but slow program 0. It may run with --reward code, and with a
    dataset whose rows pick their reward by data_source (codecontests, apps, ...)."""
    from rlharvest.services.trainer.config import TrainerConfig
    from rlharvest.services.trainer.rewards.builtin import CODE_LIMITS, MAX_CODE_CASES

    assert MAX_CODE_CASES * CODE_LIMITS.wall_s > 30
    data = str(tmp_path / "rows.jsonl")  # not read by the config
    for flags in (dict(reward="code"), dict(reward_fn="code"), dict(data=data)):
        with pytest.raises(ValueError, match="cannot cover its worst case.*code=[0-9]+ or more"):
            TrainerConfig.model_validate(dict(reward_timeouts="code=30", **flags))
    # The code task's own reward is one sandbox run per sample, and a user's function is not
    # the code reward: their code timeouts need only exceed T_max.
    TrainerConfig.model_validate(dict(task="code", reward_timeouts="code=30"))
    TrainerConfig.model_validate(dict(data=data, reward="exact", reward_timeouts="code=30"))


def test_the_default_code_timeout_covers_the_code_reward_s_worst_case_where_it_may_run(
        tmp_path) -> None:
    from rlharvest.services.trainer.config import TrainerConfig
    from rlharvest.services.trainer.rewards.builtin import CODE_REWARD_WORST_S

    worst = CODE_REWARD_WORST_S  # the cases' wall limits and their overhead
    for flags in (dict(reward="code"), dict(data=str(tmp_path / "rows.jsonl"))):
        cfg = TrainerConfig.model_validate(flags)  # reward_timeout_s: 10 s
        assert cfg.reward_timeout_of("code") >= worst
        assert cfg.reward_timeout_of("math") == cfg.reward_timeout_s  # other kinds keep it
    assert TrainerConfig.model_validate(dict(reward="code", reward_timeout_s=500)) \
        .reward_timeout_of("code") == 500


async def test_a_sync_reward_learns_the_pool_gave_up_on_it_and_only_inside_the_pool() -> None:
    from rlharvest.services.trainer.rewards.pool import caller_gave_up

    seen: list[bool] = []
    ended = threading.Event()

    def patient(prompt: str, completion: str, reference: str) -> float:
        seen.append(caller_gave_up())  # at the start: the pool is waiting
        while not caller_gave_up():
            time.sleep(0.01)
        ended.set()
        return 1.0

    pool = RewardPool(patient, max_concurrency=1, timeout_s=0.2)
    outcome = await pool.score(RewardRequest("s", "", ""))
    assert not outcome.ok and "timed out" in outcome.error
    assert await asyncio.to_thread(ended.wait, 2.0), "the abandoned call never saw it"
    assert seen == [False]
    assert not caller_gave_up()  # outside a pool's call: no one to give up


async def test_the_code_reward_starts_no_test_case_once_the_pool_gave_up_on_it(
        monkeypatch) -> None:
    """Real sandbox runs of a correct program that takes 0.4 s a case: the pool gives up after
    about two, and no later case starts (each would run outside --reward-concurrency)."""
    from rlharvest.services.trainer.rewards import builtin

    started: list[float] = []

    def counted(code: str, case: StdioCase, limits: SandboxLimits) -> sandbox.CaseResult:
        started.append(time.monotonic())
        return run_case(code, case, limits)

    monkeypatch.setattr(builtin, "run_case", counted)
    reference = json.dumps({"inputs": ["1\n", "2\n", "3\n", "4\n", "5\n", "6\n"],
                            "outputs": ["1", "2", "3", "4", "5", "6"]})
    program = "```python\nimport time\ntime.sleep(0.4)\nprint(input())\n```"
    pool = RewardPool(builtin.code_reward, max_concurrency=1, timeout_s=0.6)
    outcome = await pool.score(RewardRequest("s", "", program, reference))
    gave_up = time.monotonic()
    # Either the pool's timeout fired first (the call abandoned, counted) or, on a loaded box
    # whose loop ran late, the call saw the deadline between two cases and ended itself.
    assert not outcome.ok and (pool.abandoned_calls == 1 or
                               outcome.error.startswith("abandoned by its caller")), outcome
    await asyncio.sleep(2.0)  # the four cases left would start within it
    assert 1 <= len(started) <= 3
    assert not [t for t in started if t > gave_up]


def test_memory_is_bounded_for_all_of_a_cases_processes_together() -> None:
    """Four processes touching 96 MB each, every one under the per-process limit, against
    256 MB for the case: where the trainer may make a cgroup (root), they cannot all finish."""
    probe = sandbox.isolation.case_cgroup(1 << 30, 64)
    if probe is None:
        pytest.skip("no cgroup can be made here (not root, or no writable hierarchy): the "
                    "limits per process remain")
    probe.remove()
    code = ("import os\n"
            "kids = []\n"
            "for _ in range(4):\n"
            "    pid = os.fork()\n"
            "    if pid == 0:\n"
            "        block = bytearray(96 << 20)\n"
            "        for i in range(0, len(block), 4096):\n"
            "            block[i] = 1\n"
            "        os._exit(0)\n"
            "    kids.append(pid)\n"
            "codes = [os.waitstatus_to_exitcode(os.waitpid(k, 0)[1]) for k in kids]\n"
            "print(all(c == 0 for c in codes))")
    result = run_case(code, StdioCase("memory", "", "False"),
                      SandboxLimits(wall_s=10, cpu_s=10, total_memory_bytes=256 << 20))
    assert result.status in ("passed", "memory_limit"), result  # some child was killed
