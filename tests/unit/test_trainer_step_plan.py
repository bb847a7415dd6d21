"""The trainer's pure step plan: on-policy checks on every streamed token, groups that train only
when complete, version numbering across a resume, and the demo's preemption schedule."""

from __future__ import annotations

import pytest

from rlharvest.common.pb import common_pb2, rollout_manager_pb2 as mpb
from rlharvest.services.demo import Kill, PreemptionSchedule, Replace
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
    a.delta(common_pb2.TokenDelta(request_id="s5-g0-r0", token_ids=[7], weight_version=3))
    with pytest.raises(OnPolicyViolation, match="weight version 2"):
        a.delta(common_pb2.TokenDelta(request_id="s5-g0-r0", position=1, token_ids=[8],
                                      weight_version=2))
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
