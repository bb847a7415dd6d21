"""The torch engine's paged KV option: the same tokens as the slot cache (whole and chunked
prefill, resumed requests, aborts), memory reserved per request so admission waits when pages
are short, every page given back, and two models sharing one page store."""

from __future__ import annotations

import math

import pytest
import torch

from rlharvest.common.engine_types import EngineRequest
from rlharvest.services.rollout_worker.kv_pages import OwnPages, PageStore, page_bytes
from rlharvest.services.rollout_worker.torch_engine import PagedKV, TorchEngine

from .test_torch_engine import MAX_LEN, drain, engine, prompt, sampled

PAGE_TOKENS = 4


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def page_size(model: TorchEngine) -> int:
    cfg = model._model.config
    return page_bytes(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, PAGE_TOKENS,
                      torch.float32)


def paged(pages: int, **kwargs) -> tuple[TorchEngine, OwnPages]:
    own = OwnPages(pages, PAGE_TOKENS)
    probe = engine(max_running=1)
    store = PageStore(pages, page_size(probe))
    return engine(paged=PagedKV(store, PAGE_TOKENS, own), **kwargs), own


def requests(count: int) -> list[EngineRequest]:
    out = []
    for i in range(count):
        generated = [5 + i, 6 + i] if i % 3 == 2 else []  # some resumed
        out.append(EngineRequest(f"r{i}", prompt(i, 3 + 5 * i % 29), sampled(i, 12),
                                 generated_token_ids=generated))
    return out


@pytest.mark.parametrize("chunk", [0, 5])
def test_paged_kv_gives_exactly_the_tokens_of_the_slot_cache(chunk):
    slots, pages = engine(max_running=4, prefill_chunk=chunk), paged(256, max_running=4,
                                                                     prefill_chunk=chunk)[0]
    for eng in (slots, pages):
        for r in requests(10):
            eng.add(r)
    assert drain(pages) == drain(slots)


def test_short_of_pages_requests_wait_their_turn_and_every_page_comes_back():
    need = math.ceil((29 + 12) / PAGE_TOKENS)  # the largest request: prompt + max_tokens
    eng, own = paged(need + 2, max_running=8)
    for r in requests(6):
        eng.add(r)
    busiest = 0
    done = {}
    while eng.has_work():
        for out in eng.step():
            done.setdefault(out.request_id, []).extend(out.new_token_ids)
        busiest = max(busiest, eng.load().executing)
        assert own.free_pages >= 0
    assert busiest < 6  # the pages, not the 8 slots, bounded the batch
    assert sorted(done) == [f"r{i}" for i in range(6)] and own.free_pages == need + 2
    want = {rid: tokens for rid, (tokens, _, _) in drain_all_slots(requests(6)).items()}
    assert done == want


def drain_all_slots(asked: list[EngineRequest]) -> dict:
    eng = engine(max_running=8)
    for r in asked:
        eng.add(r)
    return drain(eng)


def test_aborting_running_and_mid_prefill_requests_gives_their_pages_back():
    eng, own = paged(64, max_running=4, prefill_chunk=4)
    for r in requests(4):
        eng.add(r)
    eng.step()
    eng.step()
    for r in requests(4):
        eng.abort(r.request_id)
    assert not eng.has_work() and own.free_pages == 64


def test_two_models_share_one_page_store_without_touching_each_others_pages():
    """The co-executor's layout: the serving and the rollout model in one store, each seeing
    pages in its own shape; interleaved, each gets exactly what it gets alone."""
    small = TorchEngine("small", seed=1, max_running=2, max_len=MAX_LEN)
    tiny = engine(max_running=2)
    cfg = small._model.config
    size = max(page_size(tiny), page_bytes(cfg.num_hidden_layers, cfg.num_key_value_heads,
                                           cfg.head_dim, PAGE_TOKENS, torch.float32))
    store = PageStore(96, size)
    pool = OwnPages(96, PAGE_TOKENS)  # one allocator: a page is one model's at a time
    both = [TorchEngine("small", seed=1, max_running=2, max_len=MAX_LEN,
                        paged=PagedKV(store, PAGE_TOKENS, pool)),
            engine(max_running=2, paged=PagedKV(store, PAGE_TOKENS, pool))]
    for i, eng in enumerate((small, tiny, *both)):
        for r in requests(4):
            eng.add(EngineRequest(f"m{i % 2}-{r.request_id}", r.prompt_token_ids, r.sampling,
                                  generated_token_ids=r.generated_token_ids))
    together: list[dict] = [{}, {}]
    while any(e.has_work() for e in both):
        for side, eng in enumerate(both):  # one forward at a time, alternating
            for out in eng.step():
                together[side].setdefault(out.request_id, []).extend(out.new_token_ids)
    alone = [{rid: t for rid, (t, _, _) in drain(e).items()} for e in (small, tiny)]
    assert together == alone and pool.free_pages == 96


def test_an_engine_with_kv_pages_of_its_own_matches_the_slot_cache():
    own = engine(max_running=4, kv_pages=64, page_tokens=8)
    slots = engine(max_running=4)
    for eng in (own, slots):
        for r in requests(6):
            eng.add(r)
    assert drain(own) == drain(slots)
    assert own.load().kv_capacity_tokens == 64 * 8


def test_the_worker_config_gives_its_engine_paged_kv():
    from rlharvest.services.rollout_worker.config import WorkerConfig
    from rlharvest.services.rollout_worker.main import build_engine

    assert WorkerConfig().kv_pages == 0
    eng = build_engine(WorkerConfig(max_running=2, max_len=MAX_LEN, kv_pages=30, page_tokens=4))
    assert eng.load().kv_capacity_tokens == 120


def test_a_pool_of_its_own_that_cannot_hold_one_request_of_max_len_is_refused_at_construction():
    # Such a pool would accept a request it can never reserve pages for: it would wait at the
    # head of the queue forever, every request behind it with it.
    with pytest.raises(ValueError, match=r"kv_pages \(23\) x page_tokens \(4\) = 92 .* max_len "
                                         r"\(96\).* at least 24"):
        engine(max_running=4, kv_pages=23, page_tokens=PAGE_TOKENS)
    # A pool of exactly max_len tokens runs a request of max_len tokens, and the next one.
    eng = engine(max_running=4, kv_pages=24, page_tokens=PAGE_TOKENS)
    eng.add(EngineRequest("whole", prompt(1, 60), sampled(1, MAX_LEN - 60, stop_token_ids=[])))
    eng.add(EngineRequest("next", prompt(2), sampled(2, 4)))
    done = drain(eng)
    assert len(done["whole"][0]) == MAX_LEN - 60 and len(done["next"][0]) == 4
