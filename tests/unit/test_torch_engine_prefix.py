"""The engine's prefix cache: a multi-turn trajectory's later turns (and resumed requests) read
their cached history instead of prefilling it, produce exactly the tokens they produce without
the cache, count hits and saved tokens, forget everything on a weight load, evict under page
pressure instead of refusing work, and give every page back."""

from __future__ import annotations


from rlharvest.common.engine_types import EngineRequest
from rlharvest.services.rollout_worker.torch_engine import TorchEngine

from rlharvest.models.tiny_model import build_model

from .test_torch_engine import (  # noqa: F401 - one_torch_thread: the module's autouse fixture
    SHARP_VERSION,
    drain,
    engine,
    one_torch_thread,
    prompt,
    sampled,
    sharpened,
)

PAGE_TOKENS = 4


def cached_engine(pages: int = 256, **kwargs) -> TorchEngine:
    return engine(max_running=4, kv_pages=pages, page_tokens=PAGE_TOKENS, prefix_cache=True,
                  **kwargs)


def trajectories(eng: TorchEngine, count: int, turns: int) -> dict[str, list[int]]:
    """``count`` trajectories of ``turns`` turns, run turn by turn: each turn's prompt is the
    last turn's prompt, its completion and an observation. Returns each turn's tokens."""
    history = {t: prompt(t, 9 + 3 * t) for t in range(count)}
    out: dict[str, list[int]] = {}
    for turn in range(turns):
        for t in range(count):
            eng.add(EngineRequest(f"t{t}.{turn}", history[t], sampled(100 * t + turn, 10)))
        done = drain(eng)
        for t in range(count):
            tokens = done[f"t{t}.{turn}"][0]
            out[f"t{t}.{turn}"] = tokens
            history[t] = history[t] + tokens + [7, 8, 9 + turn]  # the environment's reply
    return out


def test_later_turns_hit_the_cache_and_generate_exactly_what_they_do_without_it():
    plain = trajectories(engine(max_running=4, kv_pages=256, page_tokens=PAGE_TOKENS), 4, 3)
    eng = cached_engine()
    assert trajectories(eng, 4, 3) == plain
    stats = eng.load()
    assert stats.prefix_lookups == 12
    assert stats.prefix_hits == 8  # every turn after the first
    # A turn reads all full pages of the last turn's prompt + completion but its last token.
    assert stats.prefix_cached_tokens >= 8 * 2 * PAGE_TOKENS
    assert stats.prefix_cache_pages > 0


def test_a_resumed_request_reads_what_it_generated_before_it_moved():
    eng = cached_engine()
    first = EngineRequest("a", prompt(1, 13), sampled(1, 30))
    eng.add(first)
    for _ in range(12):
        eng.step()
    eng.abort("a")  # migrated away; its pages stay cached here
    whole = _run_alone(first)
    generated = whole[:11]
    eng.add(EngineRequest("a", first.prompt_token_ids, first.sampling,
                          generated_token_ids=generated))
    done = drain(eng)
    assert generated + done["a"][0] == whole
    assert eng.load().prefix_hits == 1


def _run_alone(request: EngineRequest) -> list[int]:
    eng = engine(max_running=4, kv_pages=256, page_tokens=PAGE_TOKENS)
    eng.add(request)
    return drain(eng)[request.request_id][0]


def test_a_weight_load_empties_the_cache_and_the_next_turn_misses():
    eng = cached_engine()
    trajectories(eng, 2, 1)
    assert eng.load().prefix_cache_pages > 0
    eng.load_weights({}, SHARP_VERSION + 1)
    assert eng.load().prefix_cache_pages == 0
    eng.add(EngineRequest("x", prompt(0, 9) + [1] * 8, sampled(0, 4)))
    drain(eng)
    assert eng.load().prefix_hits == 0


def other_weights() -> dict:
    """Weights unlike ``engine``'s, to load under the same version number."""
    return sharpened(build_model("tiny", seed=0), factor=3.0)


def test_a_load_that_keeps_the_version_number_takes_back_no_kv_of_the_old_weights():
    # A placed worker switching to a job at the same version, a LoadWeights of the current
    # version: the number stays, the weights change, and the requests the load ends must not
    # hand their old KV to the cache as a prefix of the new weights.
    eng = cached_engine()
    history = prompt(2, 21)
    eng.add(EngineRequest("r", history, sampled(1, 8)))
    for _ in range(3):
        eng.step()
    eng.load_weights(other_weights(), SHARP_VERSION)
    eng.abort("r")  # the worker ends every request a load finds running
    assert eng.load().prefix_cache_pages == 0
    eng.add(EngineRequest("s", history, sampled(1, 8)))
    got = drain(eng)["s"]
    assert eng.load().prefix_hits == 0
    fresh = engine(max_running=4, kv_pages=256, page_tokens=PAGE_TOKENS, weights=other_weights())
    fresh.add(EngineRequest("s", history, sampled(1, 8)))
    assert got == drain(fresh)["s"]


def test_a_request_reading_a_prefix_across_a_load_of_the_same_version_gives_every_page_back():
    eng = cached_engine(pages=64)
    history = prompt(2, 21)
    eng.add(EngineRequest("a", history, sampled(1, 8)))
    drain(eng)
    eng.add(EngineRequest("b", history, sampled(2, 8)))
    eng.step()
    assert eng.load().prefix_hits == 1  # b reads a's pages
    eng.load_weights(other_weights(), SHARP_VERSION)
    eng.abort("b")
    eng.add(EngineRequest("c", history, sampled(3, 8)))
    drain(eng)
    own, cache = eng._own, eng._prefix
    assert own is not None and cache is not None
    assert eng.load().prefix_hits == 1  # c read nothing of the old weights
    assert not cache._doomed and all(e.refs == 0 for e in cache._entries.values())
    assert own.free_pages + eng.load().prefix_cache_pages == 64


def test_page_pressure_evicts_cached_pages_instead_of_refusing_work_and_every_page_comes_back():
    eng = cached_engine(pages=40)  # 4 trajectories of ~40 tokens would need more than this
    out = trajectories(eng, 4, 3)
    assert len(out) == 12 and all(len(tokens) == 10 for tokens in out.values())
    own, cache = eng._own, eng._prefix
    assert own is not None and cache is not None
    assert cache.evicted > 0 and eng.load().prefix_hits > 0
    assert own.free_pages + eng.load().prefix_cache_pages == 40


def test_chunked_prefill_starts_after_the_cached_prefix_and_generates_the_same_tokens():
    plain = trajectories(engine(max_running=4, kv_pages=256, page_tokens=PAGE_TOKENS), 4, 3)
    eng = cached_engine(prefill_chunk=8)  # histories of 9-40 tokens: most need several chunks
    assert trajectories(eng, 4, 3) == plain
    stats = eng.load()
    assert stats.prefix_hits == 8
    assert stats.prefix_cached_tokens >= 8 * 2 * PAGE_TOKENS


def test_a_hit_counts_only_its_rest_against_the_chunk_so_others_join_the_same_step():
    eng = cached_engine(prefill_chunk=8)
    history = prompt(3, 30)
    eng.add(EngineRequest("first", history, sampled(1, 6)))
    first = drain(eng)["first"][0]
    # 37 tokens: the KV of 35 (the last sampled token has none) = 8 full pages cached, 5 to
    # prefill. Alone that fills 5 of the 8-token chunk; a 3-token prompt fits beside it.
    turn = history + first + [7]
    eng.add(EngineRequest("turn", turn, sampled(2, 6)))
    eng.add(EngineRequest("new", prompt(4, 3), sampled(3, 6)))
    eng.step()
    assert eng.load().prefix_cached_tokens == 8 * PAGE_TOKENS
    assert eng._last_step_prefill_tokens == 5 + 3
    assert [e.request.request_id for e in eng._running] == ["turn", "new"]
    assert eng._partial is None
    drain(eng)
