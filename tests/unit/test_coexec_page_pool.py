"""The co-executor's paged KV pool: pages are conserved whatever the calls, one owner and one
state each, B_roll bounds rollout grants and never serving ones, leases free idle rollout KV."""

from __future__ import annotations

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from rlharvest.services.coexecutor.page_pool import (
    Owner,
    PagePool,
    PageState,
    PoolError,
    PoolExhausted,
    pages_for,
)


class PoolMachine(RuleBasedStateMachine):
    """Random grants, growth, parks, touches, frees and budget changes; the invariants hold
    after every call, refused calls change nothing, and a double free is always refused."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = PagePool(total_pages=24, lease_s=10.0)
        self.now = 0.0
        self.ids = 0
        self.freed: set[str] = set()

    @rule(owner=st.sampled_from(list(Owner)), pages=st.integers(0, 10))
    def allocate(self, owner, pages):
        self.ids += 1
        rid = f"r{self.ids}"
        before = (self.pool.free_pages, self.pool.rollout_pages)
        try:
            granted = self.pool.allocate(rid, owner, pages, self.now)
        except PoolExhausted:
            assert (self.pool.free_pages, self.pool.rollout_pages) == before
            assert not self.pool.holds(rid)
            return
        assert len(granted) == pages and self.pool.free_pages == before[0] - pages

    @precondition(lambda self: self.pool.tables())
    @rule(data=st.data(), pages=st.integers(0, 4))
    def grow(self, data, pages):
        rid = data.draw(st.sampled_from(sorted(self.pool.tables())))
        table = self.pool.table(rid)
        held = len(table.pages)
        try:
            self.pool.allocate(rid, table.owner, pages, self.now)
        except PoolExhausted:
            assert len(self.pool.table(rid).pages) == held
            return
        assert len(self.pool.table(rid).pages) == held + pages and not table.cached

    @precondition(lambda self: self.pool.tables(Owner.ROLLOUT))
    @rule(data=st.data())
    def park(self, data):
        rid = data.draw(st.sampled_from(sorted(self.pool.tables(Owner.ROLLOUT))))
        self.pool.park(rid, self.now)
        assert self.pool.table(rid).state is PageState.ROLLOUT_CACHED

    @precondition(lambda self: any(t.cached and t.pages for t in self.pool.tables().values()))
    @rule(data=st.data())
    def adopt(self, data):
        parked = data.draw(st.sampled_from(sorted(
            rid for rid, t in self.pool.tables().items() if t.cached and t.pages)))
        pages = self.pool.table(parked).pages
        keep = data.draw(st.integers(1, len(pages)))
        free, rollout = self.pool.free_pages, self.pool.rollout_pages
        self.ids += 1
        rid = f"r{self.ids}"
        assert self.pool.adopt(parked, rid, keep, self.now) == pages[:keep]
        assert not self.pool.holds(parked) and self.pool.table(rid).adopted == keep
        assert self.pool.table(rid).state is PageState.ROLLOUT_ACTIVE
        assert self.pool.free_pages == free + len(pages) - keep
        assert self.pool.rollout_pages == rollout - (len(pages) - keep)

    @precondition(lambda self: self.pool.tables())
    @rule(data=st.data())
    def free(self, data):
        rid = data.draw(st.sampled_from(sorted(self.pool.tables())))
        held = len(self.pool.table(rid).pages)
        free = self.pool.free_pages
        assert self.pool.free(rid) == held and self.pool.free_pages == free + held
        self.freed.add(rid)

    @precondition(lambda self: self.freed)
    @rule(data=st.data())
    def free_again_is_refused(self, data):
        rid = data.draw(st.sampled_from(sorted(self.freed)))
        if not self.pool.holds(rid):
            with pytest.raises(PoolError, match="holds no pages"):
                self.pool.free(rid)

    @rule(budget=st.integers(0, 24))
    def set_budget(self, budget):
        self.pool.rollout_budget = budget

    @rule(dt=st.floats(0, 6))
    def time_passes(self, dt):
        self.now += dt
        for rid in self.pool.expired(self.now):
            assert self.now - self.pool.table(rid).last_used >= self.pool.lease_s
            self.pool.free(rid)
            self.freed.add(rid)
        assert self.pool.expired(self.now) == []  # freed within the tick

    @invariant()
    def conserved(self):
        self.pool.check()
        assert sum(self.pool.count(s) for s in PageState) == self.pool.total_pages


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_rollout_is_refused_past_b_roll_but_serving_only_for_pages_not_free():
    pool = PagePool(10)
    pool.rollout_budget = 3
    pool.allocate("roll", Owner.ROLLOUT, 3, now=0)
    with pytest.raises(PoolExhausted, match="would pass B_roll"):
        pool.allocate("roll", Owner.ROLLOUT, 1, now=0)
    pool.allocate("serve", Owner.SERVING, 7, now=0)  # the budget never limits serving
    with pytest.raises(PoolExhausted, match="1 pages wanted for 'more', 0 free"):
        pool.allocate("more", Owner.SERVING, 1, now=0)


def test_a_page_changes_owner_only_through_the_free_list_and_keeps_its_number():
    pool = PagePool(4)
    pages = pool.allocate("roll", Owner.ROLLOUT, 4, now=0)
    pool.free("roll")
    assert sorted(pool.allocate("serve", Owner.SERVING, 4, now=1)) == sorted(pages)


def test_a_cached_prefix_is_active_again_when_its_request_grows_and_leases_renew_on_use():
    pool = PagePool(8, lease_s=10)
    pool.allocate("t1", Owner.ROLLOUT, 2, now=0)
    pool.park("t1", now=1)
    assert pool.count(PageState.ROLLOUT_CACHED) == 2
    pool.touch("t1", now=9)
    assert pool.expired(now=18) == []
    pool.allocate("t1", Owner.ROLLOUT, 1, now=18)  # the next turn reuses the prefix
    assert pool.count(PageState.ROLLOUT_ACTIVE) == 3 and pool.count(PageState.ROLLOUT_CACHED) == 0
    assert pool.expired(now=28) == ["t1"]


def test_bad_calls_name_what_is_wrong():
    with pytest.raises(PoolError, match="total_pages must be >= 1"):
        PagePool(0)
    pool = PagePool(4)
    pool.allocate("s", Owner.SERVING, 1, now=0)
    with pytest.raises(PoolError, match="only rollout KV is cached"):
        pool.park("s", now=0)
    with pytest.raises(PoolError, match="is a serving request, not rollout"):
        pool.allocate("s", Owner.ROLLOUT, 1, now=0)
    with pytest.raises(PoolError, match="at least one token"):
        pages_for(10, 0)
    assert pages_for(10, 4) == 3 and pages_for(0, 4) == 0


def test_only_a_parked_table_is_adopted_and_only_by_a_request_without_pages():
    pool = PagePool(total_pages=8)
    pool.allocate("turn-1", Owner.ROLLOUT, 3, 0.0)
    with pytest.raises(PoolError, match="not a parked"):
        pool.adopt("turn-1", "turn-2", 2, 0.0)
    pool.park("turn-1", 0.0)
    pool.allocate("other", Owner.ROLLOUT, 1, 0.0)
    with pytest.raises(PoolError, match="holds pages already"):
        pool.adopt("turn-1", "other", 2, 0.0)
    with pytest.raises(PoolError, match="has 3"):
        pool.adopt("turn-1", "turn-2", 4, 0.0)
    assert pool.adopt("turn-1", "turn-2", 2, 1.0) == [0, 1]
    pool.check()


def test_parked_prefixes_find_the_longest_run_of_full_pages_and_forget_what_moved():
    from rlharvest.services.coexecutor.parked_prefixes import ParkedPrefixes

    index = ParkedPrefixes(page_tokens=4)
    history = list(range(10, 23))  # 13 tokens of KV: 3 full pages
    assert index.park("turn-1", history, version=0) == 3
    assert index.park("short", [1, 2, 3], version=0) == 0 and "short" not in index
    assert index.match(history + [99], 0) == ("turn-1", 3)
    assert index.match(history[:12], 0) == ("turn-1", 2)  # one token is left to prefill
    assert index.match(history[:6] + [0] * 8, 0) == ("turn-1", 1)
    assert index.match(history, 1) is None  # another weight version: no prefix
    index.forget("turn-1")
    assert index.match(history + [99], 0) is None and len(index) == 0
    index.park("a", history, 0)
    assert index.clear() == ["a"] and index.match(history, 0) is None
