"""The trainer's pure step plan: on-policy checks on every streamed token, groups that train only
when complete, version numbering across a resume, and the demo's preemption schedule."""

from __future__ import annotations

import pytest

from rlharvest.common import delta_batch
from rlharvest.common.pb import common_pb2, rollout_manager_pb2 as mpb
from rlharvest.cli.driver import Kill, PreemptionSchedule, Replace
from rlharvest.services.trainer.step_plan import (
    GroupAssembler,
    OnPolicyViolation,
    RolloutFailed,
    resume_version,
    submit_request,
)
from tests.builders import step_spec


def completion(rid: str, version: int = 3, **kw) -> mpb.Completion:
    return mpb.Completion(request_id=rid, token_ids=[10, 2], logprobs=[-0.5, -0.1],
                          weight_version=version, **kw)


def test_submit_request_asks_every_sample_of_every_prompt_on_the_step_version():
    s = step_spec()
    request = submit_request(s, max_new_tokens=4, temperature=1.0, top_p=1.0,
                             stop_token_ids=[2], data_seed=0, no_worker_deadline_s=9)
    assert request.weight_version == 3 and len(request.requests) == 4
    assert len({r.sampling.seed for r in request.requests}) == 4  # samples differ
    again = submit_request(s, max_new_tokens=4, temperature=1.0, top_p=1.0,
                           stop_token_ids=[2], data_seed=0, no_worker_deadline_s=9)
    assert again == request  # a retried or resumed step samples the same


def test_a_group_is_ready_only_when_all_its_samples_are_rewarded():
    a = GroupAssembler(step_spec())
    assert a.completion(completion("s5-g1-r0")) == (1, 0)
    assert a.completion(completion("s5-g1-r1", migrations=2)) == (1, 1)
    assert a.reward(1, 1, 0.5) is None
    ready = a.reward(1, 0, 0.25)
    assert ready is not None and ready.rewards == (0.25, 0.5) and a.migrations == 2
    assert [c.request_id for c in ready.completions] == ["s5-g1-r0", "s5-g1-r1"]


def test_a_token_of_another_version_is_refused():
    a = GroupAssembler(step_spec(version=3))
    ids = ["s5-g0-r0"]
    a.rows(_batch(0, 0, [7]), ids)
    with pytest.raises(OnPolicyViolation, match="s5-g0-r0: tokens came from weight version 2"):
        a.rows(_batch(0, 1, [8], version=2), ids)
    with pytest.raises(OnPolicyViolation, match="completed on weight version 4"):
        a.completion(completion("s5-g0-r1", version=4))


@pytest.mark.parametrize("rid, message", [("s4-g0-r0", "not one of step 5"),
                                          ("s5-g2-r0", "not one of step 5"),
                                          ("s5-g0-r9", "not one of step 5")])
def test_foreign_requests_are_refused(rid, message):
    with pytest.raises(ValueError, match=message):
        GroupAssembler(step_spec()).completion(completion(rid))


def test_failed_and_duplicate_completions_are_refused():
    a = GroupAssembler(step_spec())
    with pytest.raises(RolloutFailed, match="no healthy worker"):
        a.completion(completion("s5-g0-r0", failed=True, finish_reason="no healthy worker"))
    a.completion(completion("s5-g0-r1"))
    with pytest.raises(ValueError, match="completed twice"):
        a.completion(completion("s5-g0-r1"))


@pytest.mark.parametrize("checkpoint, announced, expected", [
    (0, None, (0, False)),   # fresh job: workers build version 0 themselves
    (4, None, (4, True)),    # the agent lost everything: publish the checkpoint again
    (4, 4, (4, False)),      # crash right after a checkpoint: nothing to publish
    (4, 6, (7, True)),       # versions 5, 6 went out after the checkpoint: never reuse a number
    (4, 2, (4, True)),
])
def test_resumed_weights_never_reuse_a_version_number(checkpoint, announced, expected):
    assert resume_version(checkpoint, announced) == expected


def test_preemption_schedule_kills_only_a_worker_that_holds_requests_then_replaces_it():
    s = PreemptionSchedule(kill_at=(2, 4), replace_after=2)
    assert s.decide(1, spot_assigned=5) == []
    assert s.decide(2, spot_assigned=0) == []  # nothing to lose yet: wait
    assert s.decide(2, spot_assigned=3) == [Kill(2)]
    assert s.decide(3, spot_assigned=0) == []
    assert s.decide(4, spot_assigned=4) == [Replace(4)]  # the next kill waits for the new one
    assert s.decide(4, spot_assigned=4) == [Kill(4)]
    assert s.decide(6, spot_assigned=0) == [Replace(6)]
    assert s.decide(9, spot_assigned=9) == []


def test_the_benchmark_length_model_is_long_tailed_capped_and_keeps_a_prompts_difficulty():
    from rlharvest.services.trainer.load_model import LengthModel

    model = LengthModel(median=20, cap=400, seed=1)
    lengths = [model.tokens(p, 1, r) for p in range(64) for r in range(4)]
    ratio = max(lengths) / sorted(lengths)[len(lengths) // 2]
    assert 8 < ratio < 40 and all(2 <= n <= 400 for n in lengths)  # RollPacker §2: ~20x
    hard = max(range(64), key=lambda p: model.tokens(p, 1, 0))
    # A hard prompt stays hard in its later attempt (a long round) whatever the noise.
    assert sum(model.tokens(hard, 9, r) for r in range(8)) > \
        sum(model.tokens(p, 9, r) for p in range(64) for r in range(8)) / 64
    assert LengthModel(median=50, cap=10).tokens(0, 1, 0) <= 10


def test_with_a_length_model_each_request_runs_its_modelled_length_without_stop_tokens():
    from rlharvest.services.trainer.load_model import LengthModel

    s = step_spec()
    model = LengthModel(median=6, cap=30, seed=2)
    request = submit_request(s, max_new_tokens=30, temperature=1.0, top_p=1.0,
                             stop_token_ids=[2], data_seed=0, no_worker_deadline_s=9,
                             lengths=model)
    for r in request.requests:
        group, sample = GroupAssembler(s).parse(r.request_id)
        assert r.sampling.max_tokens == model.tokens(s.items[group].index, s.step, sample)
        assert not r.sampling.stop_token_ids


def _batch(index: int, position: int, tokens: list[int], finished: str = "",
           version: int = 3) -> common_pb2.DeltaBatch:
    """One row naming the request by its index in the submission."""
    return delta_batch.encode(delta_batch.build(
        [(index, position, tokens, [-0.25] * len(tokens), finished)], version))


IDS = ["s5-g0-r0", "s5-g0-r1", "s5-g1-r0", "s5-g1-r1"]  # the submission's order


def test_a_resumed_step_carries_each_unfinished_requests_streamed_tokens():
    """The manager died mid-step: completed requests are not sent again, one whose final delta
    came completes from its deltas, the others resume after their last streamed token (a gap
    in the deltas resumes from the prompt), with the same sampling."""
    s = step_spec()
    request = submit_request(s, max_new_tokens=8, temperature=1.0, top_p=1.0,
                             stop_token_ids=[2], data_seed=0, no_worker_deadline_s=0)
    a = GroupAssembler(s)
    a.rows(_batch(0, 0, [10, 2], finished="stop"), IDS)
    a.completion(completion("s5-g0-r0"))
    a.rows(_batch(1, 0, [11, 12]), IDS)
    a.rows(_batch(1, 2, [13]), IDS)
    a.rows(_batch(2, 0, [20]), IDS)
    a.rows(_batch(2, 1, [21, 2], finished="stop"), IDS)  # final delta, no completion
    a.rows(_batch(3, 0, [30]), IDS)
    a.rows(_batch(3, 3, [33]), IDS)  # a gap: these tokens cannot be trusted
    again, finished = a.resume(request)
    assert [r.request_id for r in again.requests] == ["s5-g0-r1", "s5-g1-r1"]
    resumed = {r.request_id: r for r in again.requests}
    assert list(resumed["s5-g0-r1"].resume_token_ids) == [11, 12, 13]
    assert list(resumed["s5-g0-r1"].resume_logprobs) == [-0.25] * 3
    assert list(resumed["s5-g1-r1"].resume_token_ids) == []
    original = {r.request_id: r for r in request.requests}
    assert resumed["s5-g0-r1"].sampling == original["s5-g0-r1"].sampling
    assert again.step_id == request.step_id and again.weight_version == 3
    [done] = finished
    assert (done.request_id, list(done.token_ids), done.finish_reason) == \
        ("s5-g1-r0", [20, 21, 2], "stop")
    assert a.completion(done) == (1, 0)  # it trains like any completion


def test_a_request_the_manager_would_have_finished_completes_instead_of_resuming():
    """No final delta came, but its tokens already end it by the manager's own rule (a stop
    token last, or max_tokens reached): resubmitting it would be refused, so it completes."""
    s = step_spec(prompts=1)
    request = submit_request(s, max_new_tokens=3, temperature=1.0, top_p=1.0,
                             stop_token_ids=[2], data_seed=0, no_worker_deadline_s=0)
    a = GroupAssembler(s)
    a.rows(_batch(0, 0, [10, 2]), IDS)  # a stop token last
    a.rows(_batch(1, 0, [11, 12, 13]), IDS)  # max_tokens
    again, finished = a.resume(request)
    assert list(again.requests) == []
    assert {(c.request_id, c.finish_reason) for c in finished} == \
        {("s5-g0-r0", "stop"), ("s5-g0-r1", "length")}
