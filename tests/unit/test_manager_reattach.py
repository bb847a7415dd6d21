"""The re-attach journals (reattach.py): what a step delivered is kept while its client streams
and for the grace after it left; the same submission claims it back, another one replaces it."""

from __future__ import annotations

import pytest

from rlharvest.common.pb import common_pb2, rollout_manager_pb2 as mpb
from rlharvest.services.rollout_manager.reattach import Journals, fingerprint
from tests.builders import Clock


def requests(*prompts: tuple[int, ...]) -> list[mpb.RolloutRequest]:
    return [mpb.RolloutRequest(request_id=f"r{i}", group_id="g0", prompt_token_ids=p,
                               sampling=common_pb2.SamplingParams(max_tokens=8, seed=i))
            for i, p in enumerate(prompts)]


def completion(rid: str, failed: bool = False) -> mpb.Completion:
    return mpb.Completion(request_id=rid, token_ids=[1, 2], logprobs=[0.0, 0.0], failed=failed)


def test_a_fingerprint_changes_with_any_request_or_the_version():
    base = fingerprint(1, requests((1, 2), (3,)))
    assert base == fingerprint(1, requests((1, 2), (3,)))
    assert base != fingerprint(2, requests((1, 2), (3,)))
    assert base != fingerprint(1, requests((1, 2), (4,)))
    assert base != fingerprint(1, requests((3,), (1, 2)))


def test_a_detached_step_is_claimed_back_by_the_same_submission_within_the_grace():
    clock = Clock()
    journals = Journals(10.0, clock)
    print_ = fingerprint(1, requests((1,), (2,)))
    journals.open("step-1", 7, print_, stream="first")
    journals.record(7, completion("r0"))
    assert journals.claim("step-1", print_) == (None, [])  # its client still streams it
    assert journals.detach(7) is not None and journals.detached() == 1
    clock.advance(9.0)
    claimed, stale = journals.claim("step-1", print_)
    assert claimed is not None and stale == [] and claimed.stream == "first"
    assert [c.request_id for c in claimed.completions] == ["r0"]
    assert journals.detached() == 0 and journals.expired() == []


def test_a_detached_step_expires_after_the_grace():
    clock = Clock()
    journals = Journals(10.0, clock)
    journals.open("step-1", 7, b"x", stream=None)
    journals.detach(7)
    clock.advance(9.9)
    assert journals.expired() == []
    clock.advance(0.1)
    assert [j.step_key for j in journals.expired()] == [7]
    assert len(journals) == 0 and journals.claim("step-1", b"x") == (None, [])


def test_another_submission_of_the_same_id_replaces_the_detached_step():
    journals = Journals(10.0, Clock())
    journals.open("step-1", 7, b"old", stream=None)
    journals.detach(7)
    claimed, stale = journals.claim("step-1", b"new")
    assert claimed is None and [j.step_key for j in stale] == [7] and len(journals) == 0


def test_a_step_with_a_failed_completion_is_never_re_attached():
    journals = Journals(10.0, Clock())
    journals.open("step-1", 7, b"x", stream=None)
    journals.record(7, completion("r0", failed=True))
    assert journals.detach(7) is None and len(journals) == 0


def test_ended_steps_stay_claimable_and_only_the_newest_are_kept():
    journals = Journals(10.0, Clock(), keep_ended=2)
    for key in (1, 2, 3):
        journals.open(f"step-{key}", key, b"x", stream=None)
        journals.ended(key, mpb.RemoteTimings(instances=key))
    assert [journals.get(k) is not None for k in (1, 2, 3)] == [False, True, True]
    journals.detach(3)
    claimed, _ = journals.claim("step-3", b"x")
    assert claimed is not None and claimed.ended and claimed.remote.instances == 3


def test_the_grace_must_be_positive():
    with pytest.raises(ValueError, match="grace_s"):
        Journals(0.0, Clock())


def test_a_completion_that_fails_while_detached_makes_the_step_not_re_attachable():
    journals = Journals(10.0, Clock())
    journals.open("step-1", 7, b"x", stream=None)
    journals.detach(7)
    journals.record(7, completion("r0", failed=True))  # a deadline ran out meanwhile
    claimed, stale = journals.claim("step-1", b"x")
    assert claimed is None and [j.step_key for j in stale] == [7]
