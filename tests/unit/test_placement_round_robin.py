"""Intra-group scheduling (WEAVE §4.3): round-robin meta-iteration, Theorem 1, permits, long-tail
migration."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlharvest.services.placement_scheduler.long_tail import RolloutProgress, plan_tail_migration
from rlharvest.services.placement_scheduler.model import PlacementError, Pool
from rlharvest.services.placement_scheduler.permits import PhaseQueues
from rlharvest.services.placement_scheduler.round_robin import (
    Member, co_execution_periods, fast_round_robin, simulate_round_robin, t_cycle, t_load,
    theorem1_meta_iteration_s, utilization)

durations = st.floats(min_value=1.0, max_value=600.0, allow_nan=False)


def test_two_complementary_jobs_interleave_with_no_slowdown() -> None:
    # Fig. 1: A's training fills B's rollout bubble and vice versa.
    group = [Member("A", 100, 100, ("r",)), Member("B", 100, 100, ("r",))]
    assert simulate_round_robin(group) == {"A": 200.0, "B": 200.0}
    assert utilization(group, 200.0) == (1.0, 1.0)


def test_overloaded_group_cycles_at_its_bottleneck_load() -> None:
    group = [Member(x, 50, 50, ("r",)) for x in "ABC"]
    assert theorem1_meta_iteration_s(group) is None
    assert simulate_round_robin(group) == {x: 150.0 for x in "ABC"}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(durations, durations), min_size=1, max_size=5))
def test_theorem1_unsaturated_group_meta_iteration_equals_longest_solo_time(phases) -> None:
    group = [Member(f"j{i}", r, t, ("r",)) for i, (r, t) in enumerate(phases)]
    periods = simulate_round_robin(group)
    bound = theorem1_meta_iteration_s(group)
    if bound is not None:
        assert all(p == pytest.approx(bound) for p in periods.values())
    # Never faster than the slowest member or the busiest node, saturated or not.
    assert min(periods.values()) >= max(t_cycle(group), t_load(group)) - 1e-6


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(durations, durations, st.sets(st.sampled_from("abc"), min_size=1)),
                min_size=1, max_size=5))
def test_fast_replay_matches_the_permit_state_machine(rows) -> None:
    group = [Member(f"j{i}", r, t, tuple(sorted(n))) for i, (r, t, n) in enumerate(rows)]
    assert fast_round_robin(group) == simulate_round_robin(group)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(durations, durations, st.sets(st.sampled_from("abcd"), min_size=1),
                          st.one_of(st.none(), st.floats(0.1, 0.9))), min_size=1, max_size=5))
def test_fast_replay_matches_the_permit_state_machine_with_long_tail_migration(rows) -> None:
    group = [Member(f"j{i}", r, t, tuple(sorted(n)), None if f is None else f * r)
             for i, (r, t, n, f) in enumerate(rows)]
    assert fast_round_robin(group) == simulate_round_robin(group)


def test_a_migrated_tail_frees_its_other_nodes_for_the_next_rollout() -> None:
    """A 2-node rollout (200 s) and a 1-node one (150 s) share r2: without migration C's
    rollout waits for all of A's, a meta-iteration of 350 s. A tail-bound 50 s in keeps r1
    only, C rolls out on r2 alongside A's tail: both iterate every 250 s (T_cycle)."""
    solo = Member("C", 150, 50, ("r2",))
    assert co_execution_periods([Member("A", 200, 50, ("r1", "r2")), solo]) == \
        {"A": 350.0, "C": 350.0}
    tailed = [Member("A", 200, 50, ("r1", "r2"), tail_s=50.0), solo]
    assert co_execution_periods(tailed) == simulate_round_robin(tailed) == \
        {"A": 250.0, "C": 250.0}
    # Two rollouts of 200 s on one node a meta-iteration, overlapping through the migration:
    # 200 + 200 > 350 no longer bounds the period, Σ T_train and T_cycle still do.
    pair = [Member("A", 200, 50, ("r1", "r2"), tail_s=50.0),
            Member("B", 200, 50, ("r1", "r2"), tail_s=50.0)]
    assert co_execution_periods(pair) == fast_round_robin(pair) and \
        max(fast_round_robin(pair).values()) < t_load(pair)


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_permits_never_overlap_on_a_node_and_no_phase_runs_twice(data) -> None:
    nodes = ["r1", "r2", "r3"]
    queues = PhaseQueues()
    jobs = [f"j{i}" for i in range(data.draw(st.integers(1, 4)))]
    for job in jobs:
        queues.add_job(job, data.draw(st.lists(st.sampled_from(nodes), min_size=1, max_size=2,
                                               unique=True)), ["t1", "t2"])
    completed: dict[tuple[str, Pool, int], int] = {}
    for step in range(data.draw(st.integers(1, 60))):
        action = data.draw(st.sampled_from(["acquire", "release", "shrink", "roundtrip"]))
        job = data.draw(st.sampled_from(jobs))
        phase, iteration, status = queues.next_phase(job)
        if action == "acquire" and status == "waiting":
            queues.acquire(job, phase, float(step))
        elif action == "release" and status == "running":
            held = {p.job_id: p for p in queues.running()}[job]
            if held.pending_node_ids:
                with pytest.raises(PlacementError):
                    queues.release(job, phase, float(step))
                continue
            queues.release(job, phase, float(step))
            key = (job, phase, iteration)
            completed[key] = completed.get(key, 0) + 1
        elif action == "shrink" and status == "running" and phase is Pool.ROLLOUT:
            held = {p.job_id: p for p in queues.running()}[job]
            if len(held.node_ids) > 1 and not held.pending_node_ids:
                queues.shrink(job, held.node_ids[:1])
        elif action == "roundtrip":
            queues = PhaseQueues.from_dict(queues.to_dict())
        else:
            wrong = Pool.TRAIN if phase is Pool.ROLLOUT else Pool.ROLLOUT
            with pytest.raises(PlacementError):
                queues.acquire(job, wrong, float(step))
        owners: dict[str, str] = {}
        for permit in queues.running():
            for node in permit.node_ids:
                assert node not in owners, f"{node} held by {owners[node]} and {permit.job_id}"
                owners[node] = permit.job_id
        assert all(count == 1 for count in completed.values())


def test_phases_alternate_pools_and_follow_admission_order() -> None:
    queues = PhaseQueues()
    queues.add_job("A", ["r"], ["t"])
    queues.add_job("B", ["r"], ["t"])
    assert queues.runnable() == [("A", Pool.ROLLOUT)]
    assert queues.acquire("B", Pool.ROLLOUT, 0.0) is None  # not B's turn yet
    queues.acquire("A", Pool.ROLLOUT, 0.0)
    queues.release("A", Pool.ROLLOUT, 10.0)
    assert queues.runnable() == [("A", Pool.TRAIN), ("B", Pool.ROLLOUT)]
    with pytest.raises(PlacementError, match="next phase is train"):
        queues.acquire("A", Pool.ROLLOUT, 10.0)


def test_failed_job_leaves_and_the_others_keep_their_turns() -> None:
    queues = PhaseQueues()
    for job in "ABC":
        queues.add_job(job, ["r"], ["t"])
    queues.acquire("A", Pool.ROLLOUT, 0.0)
    queues.remove_job("A")  # crashes mid-rollout
    assert queues.holders()["r"] is None
    assert queues.runnable() == [("B", Pool.ROLLOUT)]
    queues.add_job("A", ["r"], ["t"], iteration=3)  # resubmitted: resumes from its checkpoint
    assert queues.turn("r") == "B" and queues.next_phase("A") == (Pool.ROLLOUT, 3, "waiting")


def test_long_tail_migration_lets_the_next_rollout_start_on_freed_nodes() -> None:
    queues = PhaseQueues()
    queues.add_job("A", ["r1", "r2", "r3"], ["t"])
    queues.add_job("B", ["r1", "r2", "r3"], ["t"])
    queues.acquire("A", Pool.ROLLOUT, 0.0)
    progress = RolloutProgress("A", 100, 85, {"r1": 9, "r2": 4, "r3": 2})
    migration = plan_tail_migration(progress, requests_per_node=16)
    assert migration is not None and migration.keep_node_ids == ("r1",)
    assert sum(n for _, _, n in migration.moves) == 6  # all open requests of r2, r3 move to r1
    queues.shrink("A", migration.keep_node_ids)
    permit = queues.acquire("B", Pool.ROLLOUT, 5.0)
    assert permit.node_ids == ("r2", "r3") and permit.pending_node_ids == ("r1",)
    grown = queues.release("A", Pool.ROLLOUT, 9.0)
    assert grown[0].job_id == "B" and set(grown[0].node_ids) == {"r1", "r2", "r3"}


def test_rollout_is_not_tail_bound_before_the_threshold() -> None:
    progress = RolloutProgress("A", 100, 79, {"r1": 11, "r2": 10})
    assert plan_tail_migration(progress, requests_per_node=64) is None
    with pytest.raises(PlacementError, match="report every node"):
        RolloutProgress("A", 100, 90, {"r1": 3})
