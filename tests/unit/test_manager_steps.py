"""The manager's step as an object of its core: admitted on its version, ended exactly once, its
policy behind one interface, and the batching profile P (RLBoost §4.2.1) frozen once per finished
step from true engine-step samples."""

from __future__ import annotations

from collections.abc import Collection

import grpc
import pytest

from rlharvest.services.rollout_manager.batching_profile import StepStats
from rlharvest.services.rollout_manager.commands import Abort, Fail
from rlharvest.services.rollout_manager.control_loop import ControlConfig, RolloutControl
from rlharvest.services.rollout_manager.step import Step, StepOutcome
from rlharvest.services.rollout_manager.step_policy import PlainStep, StepPolicy, StepProgress
from rlharvest.services.rollout_manager.step_book import UnknownVersion
from rlharvest.services.rollout_manager.tracker import StepError, TokenDelta
from tests.builders import Clock, request, step

KIND = "gpu"


def make(capacity: int = 64, theta: int = 2) -> tuple[RolloutControl, Clock]:
    clock = Clock()
    control = RolloutControl(ControlConfig(theta=theta), clock)
    control.worker_joined("w", 0, capacity=capacity, kind=KIND)
    return control, clock


def finish(control: RolloutControl, *request_ids: str) -> None:
    """Worker w produces each request's last token; the service delivers the completions."""
    for rid in request_ids:
        pos = len(control.tracker.get(rid).token_ids)
        control.step_deltas("w", [TokenDelta(rid, pos, (5,), (0.0,), 0, True, "stop")])
    for rid in request_ids:
        control.deliver(rid)


# ---- a step ends exactly once -------------------------------------------------------------------

def test_a_step_ends_once_when_its_last_completion_is_delivered():
    control, _ = make()
    s = control.add_step("s", step(2), 0)
    control.tick()
    finish(control, "r0")
    assert not s.ended and s.outstanding == {"r1"}
    control.step_deltas("w", [TokenDelta("r1", 0, (5,), (0.0,), 0, True, "stop")])
    assert control.deliver("r1") is s
    assert s.outcome is StepOutcome.FINISHED and not control.steps.live()
    assert control.abandon_step(s) == []  # the client leaving afterwards changes nothing
    assert s.outcome is StepOutcome.FINISHED
    with pytest.raises(ValueError, match="a step ends once"):
        s.end(StepOutcome.ABANDONED)


def test_a_client_going_away_drops_its_requests_and_aborts_those_on_a_worker():
    control, _ = make(capacity=1, theta=1)
    s = control.add_step("s", step(3), 0)
    control.tick()  # r0 in the slot, r1 pending on w, r2 waits in the manager
    commands = control.abandon_step(s)
    assert sorted(commands, key=str) == [Abort("r0", "w"), Abort("r1", "w")]
    assert s.outcome is StepOutcome.ABANDONED
    assert not any(r in control.tracker for r in ("r0", "r1", "r2"))
    assert control.tick() == []
    late = control.step_deltas("w", [TokenDelta("r0", 0, (5,), (0.0,), 0)])
    assert [d.reason for d in late.dropped] == ["unknown"]


def test_a_completion_delivered_after_its_step_was_abandoned_is_ignored():
    control, _ = make()
    s = control.add_step("s", step(1), 0)
    control.tick()
    control.abandon_step(s)
    assert control.deliver("r0") is None and s.outcome is StepOutcome.ABANDONED


def test_steps_may_share_an_id_and_stay_two_steps():
    control, _ = make()
    a = control.add_step("s", step(1, prefix="a"), 0)
    b = control.add_step("s", step(1, prefix="b"), 0)
    assert a.key != b.key and control.steps.live() == [a, b]


# ---- which steps may start ----------------------------------------------------------------------

def test_a_step_runs_on_a_version_a_worker_holds_or_the_job_announced():
    control, _ = make()  # w holds version 0
    assert control.add_step("held", step(1, prefix="h"), 0).weight_version == 0
    assert control.add_step("soon", step(1, prefix="s", version=3), 3,
                            announced_version=5).weight_version == 3
    with pytest.raises(UnknownVersion, match=r"version 6 is unknown.*workers hold \[0\]") as err:
        control.add_step("later", step(1, prefix="l", version=6), 6, announced_version=5)
    assert err.value.code is grpc.StatusCode.FAILED_PRECONDITION
    assert "l0" not in control.tracker


@pytest.mark.parametrize("version, requests, fragment", [
    (-1, [request("a", version=-1)], "weight_version -1 is negative"),
    (0, [request("a", version=1)], "'a' has weight_version 1; a step runs on one version, 0"),
    (0, [], "no requests"),
])
def test_a_malformed_step_is_refused_as_an_invalid_argument_and_nothing_is_added(
        version, requests, fragment):
    control, _ = make()
    with pytest.raises(StepError, match=fragment) as err:
        control.add_step("s", requests, version)
    assert err.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert "a" not in control.tracker and not control.steps.live()


# ---- the vocabulary comes from the job's workers --------------------------------------------------

def test_the_first_worker_fixes_the_vocabulary_that_prompts_and_deltas_are_checked_against():
    control = RolloutControl(ControlConfig(), Clock())
    control.worker_joined("old", 0, capacity=4, kind=KIND)  # an older worker states none
    control.add_step("early", [request("big", prompt=(1, 150_000))], 0)
    control.worker_joined("w", 0, capacity=4, kind=KIND, vocab_size=151_936)  # a Qwen3 vocabulary
    control.add_step("qwen", [request("ok", prompt=(1, 151_935))], 0)
    with pytest.raises(StepError, match=r"token id 151936 outside the vocabulary \[0, 151936\)"):
        control.add_step("bad", [request("over", prompt=(151_936,))], 0)


def test_a_worker_serving_another_vocabulary_is_refused_with_both_sizes():
    control = RolloutControl(ControlConfig(), Clock())
    control.worker_joined("qwen", 0, capacity=4, kind=KIND, vocab_size=151_936)
    with pytest.raises(ValueError, match="vocabulary of 128256 tokens, but this job's model has "
                                         "151936"):
        control.worker_joined("llama", 0, capacity=4, kind=KIND, vocab_size=128_256)
    assert "llama" not in control.pool
    control.worker_joined("silent", 0, capacity=4, kind=KIND)  # an older worker states none
    assert "silent" in control.pool


# ---- the step-policy seam -----------------------------------------------------------------------

class CutAfter:
    """Tail batching in miniature (RollPacker): once ``n`` completions of the step are in, the
    rest is not needed."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.name = f"cut-after-{n}"

    def cut(self, step: StepProgress, now: float) -> Collection[str]:
        done = len(step.request_ids) - len(step.outstanding)
        return set(step.outstanding) if done >= self.n else ()


@pytest.mark.parametrize("policy", [PlainStep(), CutAfter(2)], ids=lambda p: p.name)
def test_every_step_policy_keeps_the_contract(policy: StepPolicy):
    """Any policy, built in or not: a name, cuts only outstanding requests of its step, and the
    step still ends exactly once with every request delivered."""
    control, clock = make(capacity=2, theta=1)
    s = control.add_step("s", step(6), 0, policy=policy)
    assert isinstance(policy.name, str) and policy.name
    delivered = []
    for _ in range(20):
        assert set(policy.cut(s, clock())) <= set(s.outstanding)
        for c in control.tick():
            if isinstance(c, Fail):
                control.deliver(c.request_id)
                delivered.append(c.request_id)
        running = [r.request_id for r in control.tracker.on_worker("w")]
        finish(control, *running[:1])
        delivered += running[:1]
        if s.ended:
            break
        clock.advance(1.0)
    assert s.outcome is StepOutcome.FINISHED and sorted(delivered) == list(s.request_ids)


def test_requests_a_policy_cuts_fail_with_its_name_and_are_aborted_where_they_run():
    control, _ = make(capacity=2, theta=1)
    s = control.add_step("s", step(4), 0, policy=CutAfter(1))
    control.tick()  # r0, r1 in the slots; r2 pending on w; r3 waits in the manager
    finish(control, "r0")
    fails = {c.request_id: c for c in control.tick() if isinstance(c, Fail)}
    assert sorted(fails) == ["r1", "r2", "r3"]
    assert fails["r1"].worker_id == "w" and fails["r3"].worker_id is None
    assert all(c.reason == "cut by the cut-after-1 step policy" for c in fails.values())
    assert control.tracker.get("r1").state.value == "failed"
    for rid in fails:
        control.deliver(rid)
    assert s.outcome is StepOutcome.FINISHED


def test_a_policy_cutting_a_request_of_another_step_is_a_bug_that_names_it():
    class Rogue:
        name = "rogue"

        def cut(self, step: StepProgress, now: float) -> Collection[str]:
            return {"not-mine"}

    control, _ = make()
    control.add_step("s", step(1), 0, policy=Rogue())
    with pytest.raises(ValueError, match="policy 'rogue' cut 'not-mine'"):
        control.tick()


# ---- P from true engine-step samples, frozen once per finished step ----------------------------

def step_time(batch: int, context: float) -> float:
    """A decode step on the simulator's cost model (policy_sim.CostModel): reading the weights,
    a share of compute per sequence, and the batch's KV reads."""
    return 0.020 + 0.0003 * batch + 1.5e-6 * batch * context


def roofline_time(batch: int, context: float) -> float:
    """Memory-bound decode: the weights bound small batches, the KV reads large ones."""
    return max(0.02, 2e-6 * batch * context)


def report_curve(control: RolloutControl, sizes, context: float, time_of=step_time,
                 repeats: int = 3) -> None:
    for _ in range(repeats):
        for b in sizes:
            control.engine_step("w", StepStats(b, time_of(b, context), b, 0))


def analytic_plateau(sizes, context: float, time_of=step_time, epsilon: float = 0.1) -> int:
    throughput = {b: b / time_of(b, context) for b in sizes}
    best = max(throughput.values())
    return min(b for b, t in throughput.items() if t >= (1 - epsilon) * best)


def prompt_step(n: int, context: int, prefix: str = "r") -> list:
    return step(n, prefix=prefix, prompts=((1,) * context,))


def test_the_plateau_from_engine_step_stats_is_the_synthetic_curves():
    control, _ = make()
    s = control.add_step("s", prompt_step(64, 500), 0)
    control.tick()
    assert control.tracker.mean_context("w") == 500
    report_curve(control, range(1, 65), 500)
    assert control.profiles[KIND].plateau(500) is None  # P exists only once a step finished
    finish(control, *s.request_ids)
    assert s.ended
    assert control.profiles[KIND].plateau(500) == analytic_plateau(range(1, 65), 500) == 44


def test_the_plateau_follows_the_context_of_a_memory_bound_curve():
    control, _ = make()
    s = control.add_step("s", prompt_step(64, 500), 0)
    control.tick()
    report_curve(control, range(1, 65), 500, roofline_time)
    finish(control, *s.request_ids)
    for context in (500, 1000, 2000):
        expected = analytic_plateau(range(1, 65), context, roofline_time)
        assert abs(control.profiles[KIND].plateau(context) - expected) <= 1


def test_prefill_heavy_engine_steps_do_not_drag_the_plateau():
    control, _ = make()
    s = control.add_step("s", prompt_step(64, 500), 0)
    control.tick()
    report_curve(control, range(1, 65), 500)
    for b in range(40, 65):  # big batches that also prefilled a long prompt: slow steps
        for _ in range(5):
            control.engine_step("w", StepStats(b, 10 * step_time(b, 500), b, 4 * b))
    finish(control, *s.request_ids)
    assert control.profiles[KIND].plateau(500) == analytic_plateau(range(1, 65), 500)


def captured_sizes(control: RolloutControl) -> set[int]:
    captured = control.profiles[KIND].captured
    return set() if captured is None else set(captured.throughput)


def test_each_of_two_concurrent_steps_freezes_p_once_from_what_was_sampled_while_it_ran():
    control, _ = make()
    a = control.add_step("a", prompt_step(2, 100, "a"), 0)
    control.tick()
    report_curve(control, range(1, 9), 100)  # only a in flight
    b = control.add_step("b", prompt_step(2, 100, "b"), 0)
    control.tick()
    report_curve(control, range(9, 17), 100)  # both
    finish(control, *a.request_ids)
    assert a.ended and not b.ended
    assert captured_sizes(control) == set(range(1, 17))  # a's lifetime
    report_curve(control, range(17, 25), 100)  # only b
    finish(control, *b.request_ids)
    assert captured_sizes(control) == set(range(9, 25))  # b's lifetime, not just its tail


def test_a_single_generate_ending_mid_step_never_freezes_p():
    control, _ = make()
    a = control.add_step("a", prompt_step(2, 100, "a"), 0)
    g = control.add_step("g0", [request("g0", prompt=(1,) * 100)], 0, profiled=False)
    control.tick()
    report_curve(control, range(1, 9), 100)
    finish(control, "g0")
    assert g.outcome is StepOutcome.FINISHED and control.profiles[KIND].captured is None
    report_curve(control, range(9, 17), 100)
    finish(control, *a.request_ids)
    assert captured_sizes(control) == set(range(1, 17))


def test_an_abandoned_step_does_not_freeze_p_and_samples_without_a_step_are_dropped():
    control, _ = make()
    a = control.add_step("a", prompt_step(2, 100, "a"), 0)
    control.tick()
    report_curve(control, range(1, 9), 100)
    control.abandon_step(a)
    assert control.profiles[KIND].captured is None
    b = control.add_step("b", prompt_step(2, 100, "b"), 0)
    control.tick()
    report_curve(control, range(9, 17), 100)
    finish(control, *b.request_ids)
    assert captured_sizes(control) == set(range(9, 17))


def test_a_step_object_holds_what_a_policy_reads():
    s = Step(7, "s", 3, ("r0", "r1"), PlainStep(), True, started_at=2.5)
    progress: StepProgress = s
    assert (progress.step_id, progress.weight_version, progress.started_at) == ("s", 3, 2.5)
    assert progress.request_ids == ("r0", "r1") and progress.outstanding == {"r0", "r1"}
    assert not s.delivered("r0") and s.delivered("r1") and not s.ended
    s.end(StepOutcome.FINISHED)
    with pytest.raises(ValueError, match="already finished"):
        s.delivered("r0")
