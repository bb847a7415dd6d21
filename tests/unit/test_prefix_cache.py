"""The prefix cache's bookkeeping (pure, fake clock): chained keys name whole prefixes under one
weight version, a match leaves a token to prefill, referenced and parent pages are never evicted,
eviction takes expired leaves first, a flush frees what no request reads and the rest on release,
and pages are conserved through random operations."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlharvest.services.rollout_worker.prefix_cache import PrefixCache, check_prefix_cache


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def cache(page_tokens: int = 4, lease_s: float = 10.0) -> tuple[PrefixCache, Clock]:
    clock = Clock()
    return PrefixCache(page_tokens, lease_s, clock), clock


def test_a_key_names_the_whole_prefix_and_the_weight_version():
    c, _ = cache()
    a = c.keys([1, 2, 3, 4, 5, 6, 7, 8, 9], version=0)
    assert len(a) == 2  # full pages only
    assert c.keys([1, 2, 3, 4, 5, 6, 7, 8], 0) == a
    assert c.keys([0, 2, 3, 4, 5, 6, 7, 8], 0)[1] != a[1]  # same page 2, other prefix
    assert c.keys([1, 2, 3, 4, 5, 6, 7, 8], 1)[0] != a[0]


def test_a_match_is_the_longest_cached_run_and_leaves_one_token_to_prefill():
    c, _ = cache()
    tokens = list(range(12))
    assert c.insert(tokens, [7, 8, 9], version=0) == {7, 8, 9}
    assert c.match(tokens + [99], 0)[1] == [7, 8, 9]
    assert c.match(tokens, 0)[1] == [7, 8]  # all 12 cached: the last page is prefilled again
    assert c.match([0, 1, 2, 3, 5, 5, 6, 7, 8], 0)[1] == [7]  # diverges in page 2
    assert c.match(tokens + [99], version=1) == ([], [])


def test_a_page_already_cached_is_not_adopted_twice():
    c, _ = cache()
    c.insert(list(range(8)), [1, 2], 0)
    assert c.insert(list(range(12)), [5, 6, 7], 0) == {7}
    assert c.pages == 3


def test_referenced_pages_and_parents_of_cached_pages_are_not_evicted():
    c, _ = cache()
    tokens = list(range(12))
    c.insert(tokens, [1, 2, 3], 0)
    keys, pages = c.match(tokens + [0], 0)
    c.acquire(keys[:2])
    assert c.evict(3) == [3]  # 1 and 2 are read; 3 was the only leaf
    c.release(keys[:2])
    assert c.evict(3) == [2, 1]  # leaf first, then its parent
    assert c.pages == 0


def test_expired_leaves_go_before_recently_used_ones():
    c, clock = cache(lease_s=10)
    c.insert([1, 1, 1, 1], [1], 0)
    clock.now = 5
    c.insert([2, 2, 2, 2], [2], 0)
    clock.now = 12  # page 1 unused for 12 s (expired), page 2 for 7 s
    c.acquire(c.match([2, 2, 2, 2, 0], 0)[0])  # touches page 2 at 12
    c.release(c.match([2, 2, 2, 2, 0], 0)[0])
    assert c.evict(1) == [1]
    clock.now = 13
    c.insert([3, 3, 3, 3], [3], 0)
    assert c.evict(1) == [2]  # neither expired: least recently used


def test_a_flush_frees_unread_pages_now_and_read_ones_when_released():
    c, _ = cache()
    c.insert(list(range(8)), [1, 2], 0)
    keys, _ = c.match(list(range(9)), 0)
    c.acquire(keys[:1])
    assert c.flush() == [2]
    assert c.pages == 0 and c.match(list(range(9)), 0) == ([], [])
    assert c.release(keys[:1]) == [1]


def test_a_release_after_a_flush_frees_the_page_it_read_even_when_its_prefix_is_cached_again():
    # A load may keep the version number: the same tokens under the same version are cached
    # again after the flush, while a request still reads the flushed entry.
    c, _ = cache()
    c.insert(list(range(8)), [1, 2], 0)
    keys, _ = c.match(list(range(9)), 0)
    c.acquire(keys)
    c.flush()
    assert c.match(list(range(9)), 0) == ([], [])
    assert c.insert(list(range(8)), [5, 6], 0) == {5, 6}
    assert sorted(c.release(keys)) == [1, 2]  # the flushed pages, free now
    assert not c._doomed and [e.refs for e in c._entries.values()] == [0, 0]
    assert c.match(list(range(9)), 0)[1] == [5, 6]


def test_bad_sizes_and_combinations_are_refused():
    with pytest.raises(ValueError):
        PrefixCache(0)
    with pytest.raises(ValueError, match="kv_pages"):
        check_prefix_cache(True, kv_pages=0)
    with pytest.raises(ValueError, match="shared pool"):
        check_prefix_cache(True, kv_pages=64, shared_pool=True)
    check_prefix_cache(False, kv_pages=0)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["run", "evict", "flush", "tick"]),
                          st.lists(st.integers(0, 2), min_size=1, max_size=14)),
                max_size=30))
def test_pages_are_conserved_and_never_both_free_and_cached(ops):
    """A model of the engine: requests match, acquire, take fresh pages, insert and release;
    every page is free, cached, or held by exactly one place at every step."""
    c, clock = cache(page_tokens=2, lease_s=3)
    free = set(range(40))
    for op, tokens in ops:
        if op == "tick":
            clock.now += 2
        elif op == "evict":
            freed = c.evict(len(tokens))
            assert not free & set(freed)
            free |= set(freed)
        elif op == "flush":
            freed = c.flush()
            assert not free & set(freed)
            free |= set(freed)
        else:
            keys, prefix = c.match(tokens, 0)
            c.acquire(keys)
            need = -(-len(tokens) // 2) - len(prefix)
            if need > len(free):
                free |= set(c.release(keys))
                continue
            own = [free.pop() for _ in range(need)]
            pages = prefix + own
            adopted = c.insert(tokens, pages, 0)
            assert adopted <= set(own)
            free |= set(c.release(keys))
            free |= set(own) - adopted
        cached = {e.page for e in c._entries.values()}
        assert not cached & free
        assert len(cached) == c.pages
        assert len(cached) + len(free) + len({e.page for e in c._doomed.values()}) == 40


def test_the_worker_refuses_a_prefix_cache_without_its_own_pages_naming_the_key():
    from rlharvest.common.config import ConfigError, load_config
    from rlharvest.services.rollout_worker.config import WorkerConfig

    with pytest.raises(ConfigError, match="kv_pages"):
        load_config(WorkerConfig, flags={"prefix_cache": True})
    cfg = load_config(WorkerConfig, flags={"prefix_cache": True, "kv_pages": "64",
                                           "prefill_chunk": 32})
    assert cfg.prefix_cache and cfg.prefix_cache_lease_s == 60.0 and cfg.prefill_chunk == 32


def test_the_coexecutor_keeps_prefixes_only_in_its_shared_pool():
    from rlharvest.common.config import ConfigError, load_config
    from rlharvest.services.coexecutor.config import CoexecutorConfig

    with pytest.raises(ConfigError, match="kv_memory pool"):
        load_config(CoexecutorConfig, flags={"prefix_cache": True, "kv_memory": "slots"})
    assert load_config(CoexecutorConfig, flags={"prefix_cache": True}).prefix_cache
