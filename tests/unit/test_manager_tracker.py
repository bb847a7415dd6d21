"""Token-level request tracking (RLBoost §4.2): every token kept, none duplicated, none skipped."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlharvest.common import delta_batch
from rlharvest.services.rollout_manager.tracker import (
    NewRequest,
    RequestState,
    RequestTracker,
    StepError,
    StepLimits,
    TokenDelta,
)
from tests.builders import Clock, request


def req(rid: str, prompt=(1, 5, 6), max_tokens: int = 16, version: int = 3,
        stop: tuple[int, ...] = (), no_worker_timeout_s: float | None = None) -> NewRequest:
    return request(rid, prompt=prompt, max_tokens=max_tokens, version=version, stop=stop,
                   no_worker_timeout_s=no_worker_timeout_s)


def delta(rid: str, position: int, tokens, version: int = 3, finished: bool = False,
          reason: str = "") -> TokenDelta:
    return TokenDelta(rid, position, tuple(tokens), tuple(-0.5 for _ in tokens), version,
                      finished, reason)


def tracker(limits: StepLimits | None = None) -> RequestTracker:
    return RequestTracker(limits or StepLimits(max_requests=8, max_prompt_tokens=8,
                                               max_new_tokens=64, vocab_size=128), Clock())


def resumed(rid: str, tokens: tuple[int, ...], logprobs: tuple[float, ...] | None = None,
            **kw) -> NewRequest:
    base = req(rid, **kw)
    return dataclasses.replace(base, resume_token_ids=tokens,
                               resume_logprobs=logprobs if logprobs is not None
                               else tuple(-0.5 for _ in tokens))


# ---- step validation --------------------------------------------------------------------------

@pytest.mark.parametrize("step, fragment", [
    ([], "no requests"),
    ([req("a"), req("a")], "appears twice"),
    ([req("")], "empty request_id"),
    ([req("a", prompt=())], "empty prompt"),
    ([req("a", prompt=(1,) * 9)], "above the limit of 8"),
    ([req("a", prompt=(1, 128))], "outside the vocabulary"),
    ([req("a", max_tokens=0)], "max_tokens=0"),
    ([req("a", max_tokens=65)], "max_tokens=65"),
    ([req("a", version=-1)], "weight_version -1"),
    ([req("a", no_worker_timeout_s=-1.0)], "no_worker_deadline_s -1.0, which is negative"),
    ([req(str(i)) for i in range(9)], "9 requests"),
    ([resumed("a", (7, 8), (-0.5,))], "resumes 2 tokens with 1 logprobs"),
    ([resumed("a", (7, 8), max_tokens=2)], "resumes 2 tokens of max_tokens=2: it is finished"),
    ([resumed("a", (7, 2), stop=(2,))], "resumes after stop token 2: it is finished"),
    ([resumed("a", (7, 500))], "resumes token id 500 outside the vocabulary"),
])
def test_a_bad_step_is_refused_with_a_precise_reason_and_nothing_is_tracked(step, fragment):
    t = tracker()
    with pytest.raises(StepError, match=fragment):
        t.add_step(step)
    assert list(t.all()) == []


def test_a_request_id_already_tracked_is_refused_in_a_later_step():
    t = tracker()
    t.add_step([req("a")])
    with pytest.raises(StepError, match="'a' appears twice"):
        t.add_step([req("b"), req("a")])
    assert "b" not in t


# ---- streaming tokens -------------------------------------------------------------------------

def test_tokens_from_the_assignee_are_appended_in_order_with_their_logprobs():
    t = tracker()
    t.add_step([req("a")])
    t.assign("a", "w1")
    assert t.get("a").state is RequestState.PENDING
    report = t.apply_deltas("w1", [delta("a", 0, [7, 8])])
    report2 = t.apply_deltas("w1", [delta("a", 2, [9])])
    a = t.get("a")
    assert a.token_ids == [7, 8, 9] and a.logprobs == [-0.5, -0.5, -0.5]
    assert a.state is RequestState.EXECUTING
    assert report.accepted_tokens + report2.accepted_tokens == t.counters.tokens_generated == 3


def test_a_late_message_from_a_migrated_away_worker_is_dropped_never_appended():
    t = tracker()
    t.add_step([req("a")])
    t.assign("a", "w1")
    t.apply_deltas("w1", [delta("a", 0, [7, 8])])
    t.move("a", "w2")
    late = t.apply_deltas("w1", [delta("a", 2, [9, 10])])
    assert [d.reason for d in late.dropped] == ["stale"]
    assert t.counters.tokens_dropped_stale == 2
    t.apply_deltas("w2", [delta("a", 2, [11])])
    assert t.get("a").token_ids == [7, 8, 11]
    assert t.get("a").migrations == 1


def test_a_workers_executing_count_follows_its_requests_states():
    t = tracker()
    t.add_step([req("a"), req("b"), req("c")])
    for rid in "abc":
        t.assign(rid, "w1")
    t.apply_deltas("w1", [delta("a", 0, [7]), delta("b", 0, [7])])
    t.apply_deltas("w1", [delta("a", 1, [8])])  # already executing: counted once
    assert (t.assigned_count("w1"), t.executing_count("w1")) == (3, 2)
    t.move("a", "w2")  # pending on w2 until its first token there
    t.apply_deltas("w1", [delta("b", 1, [8], finished=True)])
    assert (t.executing_count("w1"), t.executing_count("w2")) == (0, 0)
    t.apply_deltas("w2", [delta("a", 2, [9])])
    t.release("a")
    t.fail("c", "cut")
    assert (t.assigned_count("w1"), t.executing_count("w1"), t.executing_count("w2")) == (0, 0, 0)


@pytest.mark.parametrize("position, reason", [(1, "position"), (3, "position")])
def test_a_delta_that_would_leave_a_gap_or_a_duplicate_is_dropped(position, reason):
    t = tracker()
    t.add_step([req("a")])
    t.assign("a", "w1")
    t.apply_deltas("w1", [delta("a", 0, [7, 8])])
    report = t.apply_deltas("w1", [delta("a", position, [9])])
    assert [d.reason for d in report.dropped] == [reason]
    assert t.get("a").token_ids == [7, 8]


def test_tokens_of_another_weight_version_are_never_appended():
    t = tracker()
    t.add_step([req("a", version=3)])
    t.assign("a", "w1")
    report = t.apply_deltas("w1", [delta("a", 0, [7], version=4)])
    assert [d.reason for d in report.dropped] == ["version"]
    assert t.get("a").token_ids == []


@pytest.mark.parametrize("bad", [
    TokenDelta("a", 0, (7, 8), (-0.1,), 3),  # logprobs do not match tokens
    TokenDelta("a", 0, (7, 200), (-0.1, -0.1), 3),  # outside the vocabulary
    TokenDelta("a", 0, (7,) * 5, (-0.1,) * 5, 3),  # beyond max_tokens
])
def test_malformed_deltas_are_dropped(bad):
    t = tracker()
    t.add_step([req("a", max_tokens=4)])
    t.assign("a", "w1")
    assert [d.reason for d in t.apply_deltas("w1", [bad]).dropped] == ["malformed"]


def test_outputs_for_unknown_or_finished_requests_are_dropped():
    t = tracker()
    t.add_step([req("a")])
    t.assign("a", "w1")
    t.apply_deltas("w1", [delta("a", 0, [7], finished=True, reason="stop")])
    report = t.apply_deltas("w1", [delta("a", 1, [8]), delta("zzz", 0, [8])])
    assert sorted(d.reason for d in report.dropped) == ["done", "unknown"]


# ---- completion -------------------------------------------------------------------------------

def test_a_request_finishes_once_when_the_worker_says_so():
    clock = Clock()
    t = RequestTracker(StepLimits(), clock)
    t.add_step([req("a")])
    t.assign("a", "w1")
    clock.now = 4.0
    report = t.apply_deltas("w1", [delta("a", 0, [7], finished=True, reason="stop")])
    a = t.get("a")
    assert report.finished == ["a"] and a.state is RequestState.FINISHED
    assert a.finish_reason == "stop" and a.finished_at == 4.0 and a.worker_id is None
    assert t.on_worker("w1") == [] and t.unfinished() == 0 and t.counters.finished == 1


def test_the_manager_finishes_a_request_at_max_tokens_or_a_stop_token_even_without_the_flag():
    t = tracker()
    t.add_step([req("len", max_tokens=2), req("stop", stop=(2,))])
    t.assign("len", "w1")
    t.assign("stop", "w1")
    report = t.apply_deltas("w1", [delta("len", 0, [7, 8]), delta("stop", 0, [7, 2])])
    assert sorted(report.finished) == ["len", "stop"]
    assert t.get("len").finish_reason == "length" and t.get("stop").finish_reason == "stop"


def test_an_abort_from_the_assignee_sends_the_request_back_to_wait_with_its_tokens():
    t = tracker()
    t.add_step([req("a")])
    t.assign("a", "w1")
    report = t.apply_deltas("w1", [delta("a", 0, [7]), delta("a", 1, [], finished=True,
                                                                 reason="abort")])
    assert report.aborted == ["a"]
    assert t.get("a").state is RequestState.WAITING and t.get("a").token_ids == [7]


def test_an_abort_of_an_earlier_dispatch_to_the_same_worker_leaves_the_request_running_there():
    # Migrated off w1 and back before w1's abort confirmation came: the confirmation names the
    # first dispatch, and the request stays on w1, whose rows of the second dispatch count.
    t = tracker()
    t.add_step([req("a")])
    t.assign("a", "w1")
    first = t.resume_payload("a").handle
    t.move("a", "w2")
    t.move("a", "w1")
    second = t.resume_payload("a").handle
    assert second not in (first, 0)
    late = delta_batch.build([(first, 0, [7], [-0.5], ""), (first, 1, [], [], "abort")], 3)
    report = t.apply_outputs("w1", late)
    assert report.aborted == [] and [d.reason for d in report.dropped] == ["stale", "stale"]
    assert t.get("a").worker_id == "w1" and t.counters.tokens_dropped_stale == 1
    t.apply_outputs("w1", delta_batch.build([(second, 0, [9], [-0.5], "")], 3))
    assert t.get("a").token_ids == [9]


# ---- resume -----------------------------------------------------------------------------------

def test_resume_payload_is_prompt_plus_tokens_so_far_with_the_remaining_budget():
    t = tracker()
    t.add_step([req("a", prompt=(1, 5), max_tokens=10)])
    t.assign("a", "w1")
    t.apply_deltas("w1", [delta("a", 0, [7, 8, 9])])
    t.release("a")
    payload = t.resume_payload("a")
    assert payload.prompt_token_ids == (1, 5) and payload.generated_token_ids == (7, 8, 9)
    assert payload.remaining_tokens == 7 and payload.sampling.max_tokens == 10
    engine_request = payload.to_engine_request()
    assert engine_request.prompt_token_ids == [1, 5]
    assert engine_request.generated_token_ids == [7, 8, 9]


def test_a_finished_request_has_no_resume_payload():
    t = tracker()
    t.add_step([req("a")])
    t.assign("a", "w1")
    t.apply_deltas("w1", [delta("a", 0, [7], finished=True, reason="stop")])
    with pytest.raises(ValueError, match="finished; nothing to resume"):
        t.resume_payload("a")


def test_released_requests_are_dispatched_before_new_ones():
    t = tracker()
    t.add_step([req("a"), req("b"), req("c")])
    t.assign("c", "w1")
    t.release("c")
    assert [r.request_id for r in t.waiting()] == ["c", "a", "b"]


def test_assign_and_move_refuse_requests_in_the_wrong_state():
    t = tracker()
    t.add_step([req("a"), req("b")])
    with pytest.raises(ValueError, match="use assign"):
        t.move("a", "w1")
    t.assign("a", "w1")
    with pytest.raises(ValueError, match="not waiting"):
        t.assign("a", "w2")
    with pytest.raises(ValueError, match="already on 'w1'"):
        t.move("a", "w1")


def test_recompute_from_prompt_regenerates_tokens_and_migration_does_not():
    t = tracker()
    t.add_step([req("migrated"), req("recomputed")])
    for rid in ("migrated", "recomputed"):
        t.assign(rid, "w1")
        t.apply_deltas("w1", [delta(rid, 0, [7, 8, 9])])
        t.release(rid)
    t.restart_from_prompt("recomputed")
    t.assign("migrated", "w2")
    t.assign("recomputed", "w2")
    t.apply_deltas("w2", [delta("migrated", 3, [10]), delta("recomputed", 0, [7, 8, 9, 10])])
    assert t.get("migrated").token_ids == t.get("recomputed").token_ids == [7, 8, 9, 10]
    assert t.counters.tokens_regenerated == 3  # all three from the recomputed request


# ---- property: any migration history yields the exact sequence --------------------------------

@settings(max_examples=60, deadline=None)
@given(tokens=st.lists(st.integers(3, 127), min_size=1, max_size=40),
       plan=st.lists(st.tuples(st.integers(1, 5), st.sampled_from(["w1", "w2", "w3"]),
                               st.booleans()), min_size=1, max_size=30))
def test_migrated_request_continues_from_its_last_token_whatever_the_history(tokens, plan):
    """Chunks arrive from whichever worker holds the request; after each move the former worker
    re-sends its next chunk late. The completion is always the exact sequence, never regenerated."""
    t = tracker()
    t.add_step([req("a", max_tokens=len(tokens))])
    holder = "w1"
    t.assign("a", holder)
    for size, worker, late in plan:
        pos = len(t.get("a").token_ids)
        if pos == len(tokens):
            break
        if worker != holder:
            t.move("a", worker)
            if late:  # the old worker's in-flight step arrives after the move
                t.apply_deltas(holder, [delta("a", pos, tokens[pos:pos + size])])
            holder = worker
        payload = t.resume_payload("a")
        assert list(payload.generated_token_ids) == tokens[:pos]
        t.apply_deltas(holder, [delta("a", pos, tokens[pos:pos + size])])
    a = t.get("a")
    assert a.token_ids == tokens[:len(a.token_ids)]
    assert t.counters.tokens_regenerated == 0
    assert (a.state is RequestState.FINISHED) == (len(a.token_ids) == len(tokens))


# ---- property: the mean context of a worker, kept without walking its requests ----------------

OPS = st.lists(st.tuples(
    st.sampled_from(["assign", "move", "release", "emit", "finish", "abort", "fail", "batch"]),
    st.integers(0, 3), st.sampled_from(["w1", "w2"]), st.integers(0, 4)), max_size=40)


@settings(max_examples=80, deadline=None)
@given(ops=OPS)
def test_a_workers_mean_context_is_that_of_its_requests_whatever_happened(ops):
    t = tracker()
    t.add_step([req(f"r{i}", prompt=(1,) * (i + 1), max_tokens=12) for i in range(4)])
    for op, i, worker, n in ops:
        r = t.get(f"r{i}")
        if op == "assign" and r.state is RequestState.WAITING:
            t.assign(r.request_id, worker)
        elif op == "move" and r.worker_id not in (None, worker) and not r.done:
            t.move(r.request_id, worker)
        elif op == "release" and r.worker_id is not None:
            t.release(r.request_id)
        elif op in ("emit", "finish", "abort") and r.worker_id is not None:
            pos = len(r.token_ids)
            reason = {"finish": "stop", "abort": "abort"}.get(op, "")
            t.apply_deltas(r.worker_id, [delta(r.request_id, pos, [7] * min(n, 12 - pos),
                                                finished=bool(reason), reason=reason)])
        elif op == "fail":
            t.fail(r.request_id, "test")
        elif op == "batch":  # one delta per request of the worker, the n-th one finishing
            on = t.on_worker(worker)
            t.apply_deltas(worker, [
                delta(x.request_id, len(x.token_ids), [7] * min(2, 12 - len(x.token_ids)),
                      finished=k == n, reason="stop" if k == n else "")
                for k, x in enumerate(on)])
        for w in ("w1", "w2"):
            on = t.on_worker(w)
            expected = sum(x.context_length for x in on) / len(on) if on else None
            assert t.mean_context(w) == expected


def test_a_resumed_request_continues_after_its_tokens_and_completes_with_them():
    """A step resubmitted after its manager died: the worker prefills prompt + resumed tokens,
    deltas continue at their end, and the completion carries all of them; none counts as
    regenerated."""
    t = tracker()
    t.add_step([resumed("a", (7, 8, 9))])
    payload = t.resume_payload("a")
    assert payload.generated_token_ids == (7, 8, 9) and payload.remaining_tokens == 13
    t.assign("a", "w1")
    report = t.apply_deltas("w1", [delta("a", 3, [10, 11], finished=True, reason="stop")])
    assert report.accepted_tokens == 2
    tracked = t.get("a")
    assert tracked.token_ids == [7, 8, 9, 10, 11] and tracked.done
    assert t.counters.tokens_regenerated == 0
