"""Preemptive memory sharing (ROSE §4.1, App. C): B_roll from serving's recent use minus H, one
halving cut when serving crosses the watermark, no regrowth before the next step, reclaim order."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from rlharvest.common.errors import InvalidArgument
from rlharvest.services.coexecutor.memory_sharing import MemoryConfig, MemorySharing, MemoryState
from rlharvest.services.coexecutor.page_pool import Owner, PagePool


def sharing(total: int = 100, **config) -> MemorySharing:
    return MemorySharing(PagePool(total, lease_s=10), MemoryConfig(**config))


def test_b_roll_is_the_pool_minus_serving_p99_over_the_window_minus_h():
    mem = sharing(100)  # H = 20 pages
    mem.observe(0.0, 90)  # out of the window by the step start
    for i in range(1, 401):  # 4 samples a second: 240 in the last 60 s, one of them a spike
        mem.observe(i / 4, 70 if i == 300 else 30)
    assert mem.start_step(100.0) == 100 - 30 - 20  # the P99 skips one spike in 240
    for i in range(401, 411):
        mem.observe(i / 4, 75)  # a burst of 10 samples is over 1%: it counts
    assert mem.start_step(102.5) == 100 - 75 - 20
    for t in range(200, 300):
        mem.observe(float(t), 95)
    assert mem.start_step(299.0) == 0  # floored: serving needs it all


def test_crossing_the_watermark_halves_b_roll_once_and_it_stays_down_until_the_next_step():
    mem = sharing(100)
    for t in range(60):
        mem.observe(float(t), 20)
    assert mem.start_step(60.0) == 60
    assert mem.watermark_pages == 20 + 10  # serving's share plus half of H
    assert not mem.on_serving_use(61.0, 29)
    assert mem.on_serving_use(62.0, 30) and mem.budget == 30
    assert mem.state is MemoryState.PRESSURE
    assert not mem.on_serving_use(63.0, 90) and mem.budget == 30  # one cut per step
    assert not mem.on_serving_use(64.0, 5) and mem.budget == 30  # frozen: no regrowth
    assert mem.start_step(65.0) <= 60 and mem.state is MemoryState.NORMAL and mem.cuts == 1


@settings(max_examples=200, deadline=None)
@given(uses=st.lists(st.integers(0, 100), min_size=1, max_size=60))
def test_b_roll_never_rises_within_a_step(uses):
    mem = sharing(100)
    mem.start_step(0.0)
    budgets = [mem.budget]
    for i, used in enumerate(uses):
        mem.on_serving_use(float(i + 1), used)
        budgets.append(mem.budget)
    assert budgets == sorted(budgets, reverse=True)


def test_victims_are_expired_first_then_cached_lru_then_running_with_fewest_tokens():
    mem = sharing(100)
    pool = mem.pool
    for rid, pages, used in (("stale", 2, 0.0), ("old-cache", 3, 5.0), ("new-cache", 3, 8.0),
                             ("long", 4, 9.0), ("short", 4, 9.0)):
        pool.allocate(rid, Owner.ROLLOUT, pages, now=used)
    pool.park("stale", now=0.0)
    pool.park("old-cache", now=5.0)
    pool.park("new-cache", now=8.0)
    pool.rollout_budget = 16 - 8  # 8 pages over
    order = mem.victims(12.0, {"long": 50, "short": 3})
    assert order == ["stale", "old-cache", "new-cache"]  # 2 + 3 + 3 = 8
    pool.rollout_budget = 16 - 9
    assert mem.victims(12.0, {"long": 50, "short": 3})[-1] == "short"


def test_serving_takes_rollout_pages_within_the_budget_when_the_pool_is_full():
    mem = sharing(10)
    mem.pool.allocate("roll", Owner.ROLLOUT, 6, now=0)
    mem.pool.allocate("serve", Owner.SERVING, 4, now=0)
    assert mem.victims(1.0, {"roll": 1}) == []  # within the budget: nothing to do
    assert mem.victims(1.0, {"roll": 1}, serving_need=2) == ["roll"]


def test_the_static_partition_gives_each_half_and_never_cuts():
    mem = sharing(100, static=True)
    assert mem.start_step(0.0) == 50 and mem.serving_limit == 50
    assert not mem.on_serving_use(1.0, 99) and mem.budget == 50


@pytest.mark.parametrize(("key", "value"), [("headroom", 0.0), ("headroom", 1.0),
                                            ("cut_factor", 1.0), ("usage_quantile", 0.0)])
def test_a_bad_setting_is_refused_by_name(key, value):
    with pytest.raises(InvalidArgument, match=f"setting {key} = "):
        MemoryConfig(**{key: value})


def test_recent_serving_share_is_the_mean_over_the_window_what_lending_ranks_by():
    mem = sharing(100, usage_window_s=10)
    assert mem.recent_serving_share == 0.0
    mem.observe(0.0, 80)
    for t in range(11, 21):
        mem.observe(float(t), 10 if t % 2 else 30)
    assert mem.recent_serving_share == pytest.approx(0.2)  # the 80 at t=0 left the window
