"""Paged KV memory: two models of different shapes in one byte store, block tables per slot,
what is written is what is read back, and moving a slot moves no KV."""

from __future__ import annotations

import pytest
import torch

from rlharvest.services.rollout_worker.kv_pages import PagedKVCache, PageStore, page_bytes

SMALL = dict(layers=2, kv_heads=2, head_dim=4, page_tokens=4, dtype=torch.float32)
LARGE = dict(layers=3, kv_heads=4, head_dim=8, page_tokens=4, dtype=torch.float32)


def store(pages: int = 16) -> PageStore:
    return PageStore(pages, max(page_bytes(**SMALL), page_bytes(**LARGE)))


def test_two_models_see_the_same_bytes_in_their_own_layouts():
    shared = store()
    small, large = shared.view(**SMALL), shared.view(**LARGE)
    assert small.shape == (16, 2, 2, 2, 4, 4) and large.shape == (16, 3, 2, 4, 4, 8)
    large[5].fill_(7.0)  # page 5 as the large model wrote it
    assert bool((small[5] == 7.0).all())  # the small model reads the same bytes: no copy
    assert bool((small[4] == 0).all() and (small[6] == 0).all())  # and nothing else changed
    base = shared.buffer.data_ptr()
    assert small.data_ptr() == base and large.data_ptr() == base


def test_a_model_whose_page_does_not_fit_the_store_is_refused():
    with pytest.raises(ValueError, match="bytes"):
        PageStore(4, page_bytes(**SMALL)).view(**LARGE)


def test_a_padded_prefill_is_read_back_in_order_and_its_padding_touches_no_page():
    torch.manual_seed(0)
    cache = PagedKVCache(store().view(**SMALL), max_slots=3, max_len=16)
    lengths = [7, 3, 12]
    for slot, pages in enumerate(([9, 2], [0], [15, 4, 11])):  # any pages, in token order
        assert cache.acquire() == slot
        cache.bind(slot, pages)
        cache.set_length(slot, lengths[slot])
    untouched = cache.pages[[1, 3, 5]].clone()
    k, v = torch.randn(3, 2, 12, 4), torch.randn(3, 2, 12, 4)
    for layer in range(2):
        cache.store_prefill(layer, 0, k + layer, v - layer, lengths)
    assert torch.equal(cache.pages[[1, 3, 5]], untouched)  # padding wrote nowhere
    for layer in range(2):
        got_k, got_v = cache.window(layer, 0, 3, 12)
        for slot, n in enumerate(lengths):
            assert torch.equal(got_k[slot, :, :n], k[slot, :, :n] + layer)
            assert torch.equal(got_v[slot, :, :n], v[slot, :, :n] - layer)
        one_k, _ = cache.window(layer, 2, 1, 12)
        assert torch.equal(one_k[0], k[2] + layer)


def test_a_chunk_continues_a_slot_and_one_token_per_slot_lands_at_its_position():
    cache = PagedKVCache(store().view(**SMALL), max_slots=2, max_len=16)
    for slot, pages in enumerate(([3, 8], [1, 6])):
        cache.acquire()
        cache.bind(slot, pages)
    chunk = torch.arange(2 * 3 * 4, dtype=torch.float32).view(2, 3, 4)  # [kvh, 3 tokens, hd]
    cache.store_chunk(0, 1, 3, chunk, -chunk)  # positions 3..5 of slot 1: across a page edge
    k, v = cache.window(0, 1, 1, 6)
    assert torch.equal(k[0, :, 3:6], chunk) and torch.equal(v[0, :, 3:6], -chunk)
    token_k = torch.ones(2, 2, 4) * torch.tensor([1.0, 2.0])[:, None, None]
    cache.store_tokens(0, torch.tensor([5, 2]), token_k, -token_k)
    k, v = cache.window(0, 0, 2, 8)
    assert float(k[0, 0, 5, 0]) == 1.0 and float(k[1, 0, 2, 0]) == 2.0
    assert float(v[1, 1, 2, 3]) == -2.0
    assert float(cache.pages[8, 0, 0, 0, 1, 0]) == 1.0  # slot 0, position 5: page 8, offset 1


def test_releasing_a_slot_moves_the_last_ones_block_table_not_its_kv():
    cache = PagedKVCache(store().view(**SMALL), max_slots=3, max_len=16)
    for slot, pages in enumerate(([0], [1], [2])):
        cache.acquire()
        cache.bind(slot, pages)
        cache.set_length(slot, slot + 1)
    cache.pages[2].fill_(5.0)
    before = cache.pages.clone()
    assert cache.release(0) == 2  # slot 2 moved into slot 0
    assert torch.equal(cache.pages, before)  # not one KV byte moved
    assert cache.tables[0, 0] == 2 and cache.host_lengths == [3, 2] and cache.bound == [1, 1]
    k, _ = cache.window(0, 0, 1, 3)
    assert bool((k == 5.0).all())


def test_binding_more_pages_than_max_len_needs_is_refused():
    cache = PagedKVCache(store().view(**SMALL), max_slots=1, max_len=8)
    cache.acquire()
    with pytest.raises(ValueError, match="max_len"):
        cache.bind(0, [0, 1, 2])
