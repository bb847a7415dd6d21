"""The trainer's tail batcher (RollPacker §3): short rounds of speculative fresh prompts, long
rounds of the deferred ones, every drawn prompt trained exactly once by the end of the data,
nothing changed by a step that did not commit, and the queue kept across a checkpoint."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings, strategies as st

from rlharvest.services.trainer.tail_batcher import TailBatcher


def run_to_the_end(batcher: TailBatcher, rng: random.Random, restart_at: int = -1):
    """Drive the batcher; each short round accepts a random P0 of its prompts. Returns the
    trained prompts in order and the rounds. ``restart_at``: rebuild from a checkpoint there."""
    trained: list[int] = []
    rounds = []
    while not batcher.done:
        if len(rounds) == restart_at:
            fresh = TailBatcher(batcher.p0, batcher.r0, batcher.size)
            fresh.p, fresh.r = batcher.p, batcher.r
            fresh.load_state_dict(batcher.state_dict())
            batcher = fresh
        plan = batcher.plan()
        assert plan == batcher.plan()  # planning changes nothing
        if plan.kind == "short":
            accepted = rng.sample(plan.prompts, plan.accept_prompts)
        else:
            accepted = list(plan.prompts)
        batcher.commit(plan, accepted)
        trained += accepted
        rounds.append(plan)
    return trained, rounds


@settings(max_examples=150, deadline=None)
@given(p0=st.integers(1, 6), size=st.integers(1, 60), eta=st.sampled_from([1.0, 1.1, 1.25, 1.5]),
       seed=st.integers(0, 10_000), restart=st.integers(-1, 20))
def test_every_drawn_prompt_trains_exactly_once_and_short_rounds_train_p0(p0, size, eta, seed,
                                                                         restart):
    batcher = TailBatcher(p0, 4, size, eta_prompts=eta, eta_responses=eta)
    trained, rounds = run_to_the_end(batcher, random.Random(seed), restart)
    assert sorted(trained) == list(range(size))  # each prompt once, none lost or repeated
    for plan in rounds:
        if plan.kind == "short":
            assert plan.accept_prompts == min(p0, len(plan.prompts))
            assert plan.responses == batcher.r and plan.accept_responses == 4
        else:
            assert len(plan.prompts) <= p0 and plan.responses == 4


def test_without_speculation_the_schedule_is_the_plain_one():
    batcher = TailBatcher(3, 2, 9, eta_prompts=1.0, eta_responses=1.0)
    trained, rounds = run_to_the_end(batcher, random.Random(0))
    assert [r.prompts for r in rounds] == [(0, 1, 2), (3, 4, 5), (6, 7, 8)]
    assert all(r.kind == "short" and r.responses == 2 for r in rounds)
    assert sorted(trained) == list(range(9))


def test_a_long_round_runs_once_p0_prompts_are_deferred():
    batcher = TailBatcher(3, 2, 100, eta_prompts=1.5)  # short rounds of 5 prompts, 3 accepted
    plan = batcher.plan()
    assert plan.kind == "short" and plan.prompts == (0, 1, 2, 3, 4)
    batcher.commit(plan, [0, 2, 3])
    assert batcher.deferred == [1, 4] and batcher.plan().kind == "short"  # 2 < P0 deferred
    plan = batcher.plan()
    batcher.commit(plan, [5, 6, 7])
    assert batcher.deferred == [1, 4, 8, 9]
    plan = batcher.plan()
    assert plan.kind == "long" and plan.prompts == (1, 4, 8) and plan.responses == 2
    batcher.commit(plan, plan.prompts)
    assert batcher.deferred == [9] and batcher.position == 10


def test_a_step_that_fails_before_commit_leaves_queue_and_position_unchanged():
    batcher = TailBatcher(2, 2, 10, eta_prompts=2.0)
    before = batcher.state_dict()
    batcher.plan()  # the step ran and failed: nothing committed
    assert batcher.state_dict() == before and batcher.plan().prompts == (0, 1, 2, 3)


def test_bad_settings_commits_and_checkpoints_are_refused():
    with pytest.raises(ValueError, match="eta_prompts"):
        TailBatcher(2, 2, 10, eta_prompts=0.5)
    batcher = TailBatcher(2, 2, 10)
    plan = batcher.plan()
    with pytest.raises(ValueError, match="not in the round"):
        batcher.commit(plan, [99])
    with pytest.raises(ValueError, match="does not fit"):
        batcher.load_state_dict({"position": 3, "deferred": [5]})

