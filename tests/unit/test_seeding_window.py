"""RLBoost Algorithm 1 (adaptive seeding window and instance cap) as written, with the decisions
the paper leaves open (rlharvest/services/trainer/seeding_window.py)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rlharvest.services.trainer.config import TrainerConfig
from rlharvest.services.trainer.instance_cap import InstanceCap
from rlharvest.services.trainer.seeding_window import Schedule, SeedingWindow, StepTimings


def timings(t_train=40.0, t_train_wait=6.0, t_remote=30.0, t_remote_wait=2.0, n_mean=3.0,
            n_next=3) -> StepTimings:
    return StepTimings(t_train, t_train_wait, t_remote, t_remote_wait, n_mean, n_next)


def test_the_first_step_runs_t_init_with_as_many_instances_as_local_engines():
    assert SeedingWindow(n_resv=2, eta=2.0, t_init=10.0).schedule == Schedule(10.0, 2)


def test_worked_step_lines_9_10_and_memory():
    window = SeedingWindow(n_resv=2, eta=2.0, t_init=10.0)
    # line 9: 10 + (6 - 2) / 2 = 12; line 10: (30 * 3 + 12 * 2) / 40 = 2.85 -> 3
    assert window.observe(timings()) == Schedule(12.0, 3)
    assert window.memory == {3: 12.0}  # availability held at 3 all step


def test_a_changed_availability_is_not_memorised_and_a_known_level_is_restored():
    window = SeedingWindow(n_resv=2, eta=2.0, t_init=10.0)
    window.observe(timings())  # M[3] = 12
    # Instances came and went (mean 4.5, 6 next): line 9 moves on, nothing is written.
    moved = window.observe(timings(t_train_wait=0.0, t_remote_wait=10.0, n_mean=4.5, n_next=6))
    assert moved.t_seed == pytest.approx(12.0 - 5.0) and 6 not in window.memory
    # Back to 3 instances (again a changing step): start from what 3 instances converged to.
    back = window.observe(timings(t_train_wait=0.0, t_remote_wait=10.0, n_mean=5.0, n_next=3))
    assert back.t_seed == 12.0
    # Line 10 used the line-9 value (7 - 5 = 2), not the restored one: (30*5 + 2*2)/40 -> 4 -> 3.
    assert back.n_prem == 3


@pytest.mark.parametrize("step, expected", [
    (timings(t_train_wait=0.0, t_remote_wait=100.0), Schedule(0.0, 3)),  # never below 0
    (timings(t_train_wait=100.0, t_remote_wait=0.0), Schedule(25.0, 3)),  # the fallback's cap
    (timings(t_remote=400.0, n_mean=3.0, n_next=3), Schedule(12.0, 3)),  # no more than available
    (timings(t_remote=0.0, n_mean=0.0, n_next=0, t_train=1000.0), Schedule(12.0, 1)),  # >= 1
    (timings(t_remote=30.0, t_train=45.0), Schedule(12.0, 3)),  # 114/45 = 2.53 rounds up
])
def test_clamps(step, expected):
    window = SeedingWindow(n_resv=2, eta=2.0, t_init=10.0, t_seed_cap=25.0)
    assert window.observe(step) == expected


def test_a_step_that_trained_nothing_keeps_the_schedule():
    window = SeedingWindow(n_resv=2, eta=2.0, t_init=10.0)
    assert window.observe(timings(t_train=0.0, t_train_wait=50.0)) == Schedule(10.0, 2)
    assert window.memory == {}


def test_without_remote_instances_the_window_grows_to_the_colocated_fallback():
    window = SeedingWindow(n_resv=4, eta=4.0, t_init=0.0, t_seed_cap=60.0)
    history = []
    for _ in range(40):  # nobody else rolls out: the trainer waits for its own tail
        history.append(window.observe(timings(t_train=20.0, t_train_wait=30.0, t_remote=0.0,
                                              t_remote_wait=0.0, n_mean=0.0, n_next=0)).t_seed)
    assert history == sorted(history) and history[-1] == 60.0
    assert window.schedule.n_prem == 1


def test_measuring_the_full_rollout_caps_the_current_window():
    window = SeedingWindow(n_resv=1, eta=1.0, t_init=90.0)
    window.measured_full_rollout(50.0)
    assert window.schedule.t_seed == 50.0
    with pytest.raises(ValueError, match=">= 0 seconds"):
        window.measured_full_rollout(-1.0)


@pytest.mark.parametrize("kwargs, message", [
    (dict(n_resv=0, eta=1.0, t_init=0.0), "n_resv"),
    (dict(n_resv=1, eta=0.0, t_init=0.0), "eta"),
    (dict(n_resv=1, eta=1.0, t_init=-1.0), "t_init"),
])
def test_bad_parameters_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SeedingWindow(**kwargs)


@given(a=st.floats(0, 100), gap=st.floats(0, 100), t0=st.floats(0, 200), eta=st.floats(2, 10))
def test_on_a_monotone_plant_the_window_converges_without_oscillating(a, gap, t0, eta):
    """The trainer waits max(0, hi - T) for responses and the remote instances max(0, T - lo)
    for the trainer: the balance is T* = (hi + lo) / 2. With eta >= 2 every step moves towards it
    and never past it."""
    lo, hi = a, a + gap
    target = (hi + lo) / 2
    window = SeedingWindow(n_resv=1, eta=eta, t_init=t0)
    t, gaps = t0, [abs(t0 - target)]
    for _ in range(200):
        t = window.observe(timings(t_train_wait=max(0.0, hi - t), t_remote_wait=max(0.0, t - lo),
                                   n_mean=1.5, n_next=2)).t_seed  # no memory: keep adapting
        assert (t - target) * (t0 - target) >= -1e-9, "crossed the balance point"
        gaps.append(abs(t - target))
    assert all(later <= earlier + 1e-9 for earlier, later in zip(gaps, gaps[1:]))
    assert gaps[-1] <= 1e-3 * max(1.0, gaps[0])


@given(steps=st.lists(st.tuples(st.floats(0, 1e4), st.floats(0, 1e4), st.floats(0, 1e4),
                                st.floats(0, 1e4), st.floats(0, 64), st.integers(0, 64)),
                      max_size=30))
def test_the_window_and_the_cap_stay_in_bounds_whatever_is_measured(steps):
    window = SeedingWindow(n_resv=2, eta=3.0, t_init=5.0, t_seed_cap=120.0)
    for t_train, t_wait, t_remote, r_wait, n_mean, n_next in steps:
        before = window.schedule
        got = window.observe(StepTimings(t_train, t_wait, t_remote, r_wait, n_mean, n_next))
        assert 0.0 <= got.t_seed <= 120.0
        if t_train > 0:
            assert 1 <= got.n_prem <= max(1, n_next)
        else:
            assert got == before


def test_the_trainers_window_is_capped_by_the_longest_rollout_it_measured():
    cap = InstanceCap(etcd=None, job="j", seeding=True, t_init=5.0, eta=1.0)
    assert cap.window.schedule.t_seed == 5.0  # no rollout measured yet: no cap
    cap.rollout_measured(2.0)
    assert cap.window.schedule.t_seed == 2.0  # a window as long as the rollout: co-located
    cap.rollout_measured(1.0)  # a shorter step does not lower the cap
    assert cap.window.t_seed_cap == 2.0
    off = InstanceCap(etcd=None, job="j", t_init=5.0)
    off.rollout_measured(9.0)
    assert off.window.schedule.t_seed == 0.0  # without the seed role T_seed stays 0


def test_the_seed_role_needs_the_controller_and_publishing():
    with pytest.raises(ValueError, match="--seed-role needs --instance-cap auto"):
        TrainerConfig.model_validate(dict(seed_role=True))
    with pytest.raises(ValueError, match="publishing"):
        TrainerConfig.model_validate(dict(seed_role=True, instance_cap="auto", publish=False))
    assert TrainerConfig.model_validate(dict(seed_role=True, instance_cap="auto")).seed_role
