"""RollPacker's short round in the manager (§3): a prompt is accepted when R0 of its responses
finish, its other responses are cancelled, the round ends once P0 prompts are accepted, and the
rest are deferred — over random finish orders (hypothesis)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings, strategies as st

from rlharvest.services.rollout_manager.tail_batching import AcceptanceError, TailBatchingStep
from tests.builders import PolicyProgress as Progress


def round_of(prompts: int, responses: int) -> dict[str, str]:
    return {f"g{g}-r{r}": f"g{g}" for g in range(prompts) for r in range(responses)}


def play(policy: TailBatchingStep, groups: dict[str, str], order: list[str], failed: set[str]):
    """Deliver completions in ``order``; cancel what the policy cuts after each. Returns the
    progress, the cancelled ids and every verdict handed out."""
    step = Progress(tuple(groups), set(groups))
    cancelled: list[str] = []
    verdicts = []
    for rid in order:
        if rid not in step.outstanding:
            continue
        step.deliver(rid, rid not in failed)
        for cut in policy.cut(step, 0.0):
            assert cut in step.outstanding
            step.deliver(cut, False)
            cancelled.append(cut)
        verdicts += policy.verdicts(step)
    return step, cancelled, verdicts


@settings(max_examples=200, deadline=None)
@given(p0=st.integers(1, 4), r0=st.integers(1, 4), eta_p=st.sampled_from([1.0, 1.25, 1.5, 2.0]),
       eta_r=st.sampled_from([1.0, 1.25, 1.5, 2.0]), data=st.data())
def test_a_short_round_accepts_the_first_p0_prompts_to_finish_r0_responses(p0, r0, eta_p, eta_r,
                                                                            data):
    prompts, responses = math.ceil(eta_p * p0), math.ceil(eta_r * r0)
    groups = round_of(prompts, responses)
    order = data.draw(st.permutations(list(groups)))
    failed = set(data.draw(st.lists(st.sampled_from(list(groups)), max_size=3)))
    policy = TailBatchingStep(groups, p0, r0)
    step, cancelled, verdicts = play(policy, groups, order, failed)

    assert not step.outstanding  # the round ended: nothing of it runs on any more
    # Each accepted group: R0 finished responses, and its R0-th came before any later group's.
    rank = {}
    for gid in {g for g in groups.values()}:
        done = sorted(step.succeeded[r] for r, g in groups.items() if g == gid and
                      r in step.succeeded)
        if len(done) >= r0:
            rank[gid] = done[r0 - 1]
    expected = sorted(rank, key=lambda g: (rank[g], int(g[1:])))[:p0]
    assert policy.accepted == expected
    assert len(policy.accepted) == min(p0, len(rank))
    # Every group gets exactly one verdict; the accepted ones are the accepted.
    assert sorted(v.group_id for v in verdicts) == sorted(set(groups.values()))
    assert {v.group_id for v in verdicts if v.accepted} == set(policy.accepted)
    # Only requests that were not needed were cancelled: never one of an accepted group's
    # first R0 finishes.
    for gid in policy.accepted:
        firsts = sorted((step.succeeded[r], r) for r, g in groups.items()
                        if g == gid and r in step.succeeded)[:r0]
        assert not {r for _, r in firsts} & set(cancelled)


def test_without_speculation_nothing_is_cancelled_and_every_prompt_is_accepted():
    groups = round_of(3, 2)
    policy = TailBatchingStep(groups, 3, 2)
    step, cancelled, verdicts = play(policy, groups, list(reversed(list(groups))), set())
    assert cancelled == [] and sorted(policy.accepted) == ["g0", "g1", "g2"]
    assert all(v.accepted for v in verdicts)


def test_an_accepted_prompts_extra_responses_are_cancelled_at_once():
    groups = round_of(3, 3)  # R0 = 2 of 3 responses
    policy = TailBatchingStep(groups, 2, 2)
    step = Progress(tuple(groups), set(groups))
    step.deliver("g1-r0", True)
    assert policy.cut(step, 0.0) == []
    step.deliver("g1-r2", True)
    assert policy.cut(step, 0.0) == ["g1-r1"]  # g1 has its 2: its third is not needed
    assert [v.group_id for v in policy.verdicts(step)] == ["g1"]


def test_a_rule_the_step_cannot_meet_is_refused():
    with pytest.raises(AcceptanceError, match="fewer than the 3 a prompt needs"):
        TailBatchingStep(round_of(2, 2), 1, 3)
    with pytest.raises(AcceptanceError, match="fewer than the 3 it must accept"):
        TailBatchingStep(round_of(2, 2), 3, 1)
    with pytest.raises(AcceptanceError, match=">= 1"):
        TailBatchingStep(round_of(2, 2), 0, 1)


def test_a_groups_verdict_goes_out_with_its_r0th_finished_response():
    groups = round_of(2, 2)
    policy = TailBatchingStep(groups, 2, 2)
    step = Progress(tuple(groups), set(groups))
    for rid in ("g1-r0", "g1-r1"):
        step.deliver(rid, True)
    assert [(v.group_id, v.accepted) for v in policy.verdicts(step)] == [("g1", True)]
    for rid in ("g0-r1", "g0-r0"):  # the round ends with no tick in between: still told
        step.deliver(rid, True)
    assert [(v.group_id, v.accepted) for v in policy.verdicts(step)] == [("g0", True)]
    assert policy.verdicts(step) == []
