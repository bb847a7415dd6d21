"""The simulated step the seeding bench drives Algorithm 1 with (rlharvest/sim/seeding.py): its timings
mean what Algorithm 1 reads, and its limits are the co-located and all-remote cases."""

from __future__ import annotations

import math

from rlharvest.sim.seeding import Plant, simulate_step

PLANT = Plant(n_resv=2, slots=2, token_s=1.0, train_s_per_token=0.1, migrate_s=0.5)


def test_without_remote_instances_the_step_is_co_located_rollout_then_training():
    result = simulate_step([3, 5, 2, 4], t_seed=0.0, n_remote=0, plant=PLANT)
    # 2 engines x 2 slots hold all 4 at once: the longest, 5 tokens, ends rollout at t = 5.
    assert result.rollout_s == 5.0 and math.isclose(result.timings.t_train, 14 * 0.1)
    assert math.isclose(result.step_s, 5.0 + 1.4)  # the cluster trains only after rolling out
    assert result.tokens == 14 and result.timings.t_remote_wait == 0.0


def test_a_zero_window_puts_all_rollout_on_the_remote_instances_and_training_waits():
    result = simulate_step([4, 4], t_seed=0.0, n_remote=1, plant=PLANT, n_next=3)
    assert result.rollout_s == 4.0  # one instance, both requests at once
    assert result.timings.t_train_wait == 4.0  # the trainer sat idle from 0 until then
    assert (result.timings.n_prem_mean, result.timings.n_prem_next) == (1.0, 3)


def test_seeds_carry_their_tokens_to_the_remote_instances():
    # Four 10-token requests; the local engines take all four, the one remote (2 slots) none.
    unseeded = simulate_step([10] * 4, t_seed=0.0, n_remote=1, plant=PLANT)
    assert unseeded.rollout_s == 20.0  # two waves of 10 on the remote alone
    seeded = simulate_step([10] * 4, t_seed=4.0, n_remote=1, plant=PLANT)
    # At 4 s each holds 4 tokens; the remote wakes after its prefill (4.5 s) and needs 6 more
    # per request, in two waves: 4.5 + 6 + 6 = 16.5 (24.5 if the seeds' tokens were lost).
    assert seeded.rollout_s == 16.5
    whole = simulate_step([10] * 4, t_seed=10.0, n_remote=1, plant=PLANT)
    assert whole.rollout_s == 10.0  # a window as long as the rollout: nothing left to seed


def test_the_remote_instances_idle_from_their_last_response_to_the_steps_end():
    result = simulate_step([1, 1, 1, 1], t_seed=0.0, n_remote=2, plant=PLANT)
    assert result.timings.t_remote_wait == result.step_s - result.timings.t_remote > 0
