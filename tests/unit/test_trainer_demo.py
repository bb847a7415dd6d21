"""The demo's verdict: it fails unless reward visibly rose between the first and last steps."""

from __future__ import annotations

import pytest

from rlharvest.services.demo import reward_ends, rise_failure


def test_the_ends_average_up_to_three_steps_and_never_share_one() -> None:
    assert reward_ends([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7]) == pytest.approx((0.2, 0.6, 3))
    assert reward_ends([0.1, 0.5, 0.9]) == pytest.approx((0.1, 0.9, 1))
    with pytest.raises(ValueError, match="at least 2 steps"):
        reward_ends([0.4])


def test_a_run_whose_reward_rose_passes() -> None:
    assert rise_failure([0.02, 0.05, 0.03, 0.2, 0.3, 0.45, 0.5], min_rise=0.1) is None


@pytest.mark.parametrize("rewards", [
    [0.3, 0.3, 0.3, 0.3, 0.3, 0.3],  # flat
    [0.5, 0.4, 0.45, 0.2, 0.1, 0.15],  # fell
    [0.1, 0.12, 0.1, 0.15, 0.14, 0.16],  # rose, but by less than min_rise
])
def test_a_run_whose_reward_did_not_rise_fails_and_says_by_how_much(rewards) -> None:
    failure = rise_failure(rewards, min_rise=0.1)
    assert failure is not None and failure.startswith("reward did not rise")
    assert "last 3 steps" in failure and "needed +0.1" in failure


def test_too_short_a_run_cannot_show_a_rise() -> None:
    assert "too few" in rise_failure([0.9], min_rise=0.0)
    assert rise_failure([], min_rise=0.0) is not None
