"""The manager's remote timings of a step (RLBoost Algorithm 1's t_remote, t_remote_wait, the
time-weighted mean and the next count of remote instances), with worked numbers."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rlharvest.services.rollout_manager.remote_timing import RemoteTiming


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_worked_example_of_two_instances_and_a_preemption():
    clock = Clock()
    timing = RemoteTiming(clock)
    timing.active_changed(2)
    timing.step_opened(7)
    clock.now = 1.0
    timing.produced([7], "a")
    timing.produced([7], "b")
    clock.now = 4.0
    timing.produced([7], "a")  # a works 1 -> 4
    timing.active_changed(1, 3)  # b preempted at 4 after working 1 -> 1; 2 more stand by
    clock.now = 10.0
    got = timing.step_closed(7)
    assert got is not None and got.n_available_next == 3
    assert got.t_remote == pytest.approx((3.0 + 0.0) / 2)
    assert got.t_remote_wait == pytest.approx((6.0 + 9.0) / 2)
    assert got.n_prem_mean == pytest.approx((2 * 4 + 1 * 6) / 10)
    assert got.n_prem_next == 1 and got.instances == 2


def test_a_step_no_remote_instance_worked_on_has_zero_times_and_the_count_it_saw():
    clock = Clock()
    timing = RemoteTiming(clock)
    timing.step_opened(1)
    clock.now = 2.0
    timing.active_changed(3)
    clock.now = 4.0
    got = timing.step_closed(1)
    assert got is not None
    assert (got.t_remote, got.t_remote_wait, got.instances) == (0.0, 0.0, 0)
    assert got.n_prem_mean == pytest.approx(1.5) and got.n_prem_next == 3


def test_tokens_of_another_or_a_closed_step_are_ignored_and_a_step_closes_once():
    clock = Clock()
    timing = RemoteTiming(clock)
    timing.step_opened(1)
    timing.produced([2], "a")
    assert timing.step_closed(1) is not None
    timing.produced([1], "a")
    assert timing.step_closed(1) is None
    with pytest.raises(ValueError, match="0 <= active <= available"):
        timing.active_changed(-1)
    with pytest.raises(ValueError, match="0 <= active <= available"):
        timing.active_changed(3, 2)


def test_two_steps_in_flight_each_measure_over_their_own_lifetime():
    clock = Clock()
    timing = RemoteTiming(clock)
    timing.active_changed(4)
    timing.step_opened(1)
    clock.now = 5.0
    timing.active_changed(2)
    timing.step_opened(2)
    clock.now = 10.0
    first, second = timing.step_closed(1), timing.step_closed(2)
    assert first is not None and second is not None
    assert first.n_prem_mean == pytest.approx(3.0)
    assert second.n_prem_mean == pytest.approx(2.0)


def test_a_scope_measures_every_turn_of_an_agentic_step_over_its_own_lifetime():
    """An agentic step is many Generate steps: its scope takes the remote tokens of all of
    them while open (first to last per instance), not those of a turn that ended before it
    opened, and closes once."""
    clock = Clock()
    timing = RemoteTiming(clock)
    timing.active_changed(2)
    timing.step_opened(1)  # a turn of an earlier step
    timing.produced([1], "a")
    timing.step_closed(1)
    clock.now = 1.0
    timing.scope_opened(("seed-window", "s1"))
    for key, at, instance in ((2, 2.0, "a"), (3, 3.0, "b"), (4, 5.0, "a"), (5, 6.0, "b")):
        clock.now = at
        timing.step_opened(key)  # each turn a step of its own
        timing.produced([key], instance)
        assert timing.step_closed(key) is not None
    clock.now = 7.0
    timing.active_changed(1)
    clock.now = 9.0
    got = timing.scope_closed(("seed-window", "s1"))
    assert got is not None and got.instances == 2
    assert got.t_remote == pytest.approx(((5.0 - 2.0) + (6.0 - 3.0)) / 2)
    assert got.t_remote_wait == pytest.approx(((9.0 - 5.0) + (9.0 - 6.0)) / 2)
    assert got.n_prem_mean == pytest.approx((2 * 6 + 1 * 2) / 8)
    assert got.n_prem_next == 1
    assert timing.scope_closed(("seed-window", "s1")) is None


@given(st.lists(st.tuples(st.floats(0.0, 5.0), st.integers(0, 8), st.sampled_from("abc")),
                min_size=1, max_size=30))
def test_the_mean_count_lies_between_the_counts_and_an_instance_never_waits_past_the_step(
        events):
    clock = Clock()
    timing = RemoteTiming(clock)
    timing.step_opened(0)
    counts = [0]
    for dt, count, instance in events:
        clock.now += dt
        timing.active_changed(count)
        counts.append(count)
        timing.produced([0], instance)
    clock.now += 1.0
    got = timing.step_closed(0)
    assert got is not None
    assert min(counts) - 1e-9 <= got.n_prem_mean <= max(counts) + 1e-9
    assert 0 <= got.t_remote and 0 <= got.t_remote_wait
    assert got.t_remote + got.t_remote_wait <= clock.now + 1e-9
    assert got.n_prem_next == counts[-1]
