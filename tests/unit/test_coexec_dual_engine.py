"""The co-executor's dual engine with two real torch engines: transparent to rollout alone, one
engine steps per tick, serving's burst halves B_roll and aborts rollout requests back to the
manager, pages conserved throughout, a new weight version starts a new step."""

from __future__ import annotations

from collections import defaultdict

from rlharvest.common.engine_types import EngineRequest, RequestOutput, SamplingParams
from rlharvest.services.coexecutor.admission import DualSloAdmission, SloConfig
from rlharvest.services.coexecutor.dual_engine import DualEngine
from rlharvest.services.coexecutor.latency_profile import LatencyProfile
from rlharvest.services.coexecutor.memory_sharing import MemoryConfig, MemorySharing, MemoryState
from rlharvest.services.coexecutor.page_pool import Owner, PagePool, PageState
from rlharvest.services.coexecutor.pool_pages import PoolPages
from rlharvest.services.rollout_worker.kv_pages import PageStore
from rlharvest.services.coexecutor.scheduler import CoexecScheduler
from rlharvest.services.rollout_worker.torch_engine import PagedKV, TorchEngine, kv_page_bytes


def profile() -> LatencyProfile:
    return LatencyProfile.linear(prefill_base_s=1e-3, prefill_per_token_s=1e-5,
                                 decode_base_s=1e-3, decode_per_seq_s=1e-4)


class Counted(TorchEngine):
    """A torch engine that counts its forwards."""

    steps = 0

    def step(self):
        self.steps += 1
        return super().step()


def dual(total_pages: int = 400, slo: SloConfig = SloConfig(60.0, 60.0), chunk: int = 0,
         paged: bool = False, prefix_reuse: bool = False, lease_s: float = 60.0, clock=None):
    """``paged``: both engines keep their KV in the pool's pages (one store), as the service
    does by default. ``prefix_reuse``: finished rollout tables are parked for the next turn."""
    pool = PagePool(total_pages, lease_s=lease_s)
    kv = {owner: None for owner in Owner}
    if paged:
        store = PageStore(total_pages, kv_page_bytes("tiny", 8))
        kv = {owner: PagedKV(store, 8, PoolPages(pool, 8, owner, prefix_reuse and
                                                 owner is Owner.ROLLOUT)) for owner in Owner}
    memory = MemorySharing(pool, MemoryConfig(headroom=0.2))
    scheduler = CoexecScheduler(DualSloAdmission(slo, profile()), memory.headroom_pages)
    served: dict[str, list[int]] = defaultdict(list)

    def deliver(outputs: list[RequestOutput]) -> None:
        for out in outputs:
            served[out.request_id] += out.new_token_ids

    engine = DualEngine(Counted("tiny", seed=0, max_running=8, max_len=128, prefill_chunk=chunk,
                                paged=kv[Owner.ROLLOUT]),
                        Counted("tiny", seed=1, max_running=8, max_len=128,
                                paged=kv[Owner.SERVING]),
                        scheduler=scheduler, memory=memory, rollout_profile=profile(),
                        tokens_per_page=(8, 8), deliver=deliver, rollout_prefill_chunk=chunk,
                        prefix_reuse=prefix_reuse, **({"clock": clock} if clock else {}))
    return engine, served


def request(rid: str, prompt_len: int = 6, max_tokens: int = 12, seed: int = 0) -> EngineRequest:
    return EngineRequest(rid, [5 + i % 20 for i in range(prompt_len)],
                         SamplingParams(max_tokens=max_tokens, seed=seed))


def run(engine: DualEngine, ticks: int = 10_000) -> dict[str, list[RequestOutput]]:
    outputs: dict[str, list[RequestOutput]] = defaultdict(list)
    for _ in range(ticks):
        if not engine.has_work():
            break
        for out in engine.step():
            outputs[out.request_id].append(out)
        engine.pool.check()
    return outputs


def test_rollout_alone_gets_exactly_the_tokens_of_a_plain_engine():
    engine, _ = dual()
    plain = TorchEngine("tiny", seed=0, max_running=8, max_len=128)
    for i in range(5):
        engine.add(request(f"r{i}", seed=i))
        plain.add(request(f"r{i}", seed=i))
    got = run(engine)
    want: dict[str, list[int]] = defaultdict(list)
    while plain.has_work():
        for out in plain.step():
            want[out.request_id] += out.new_token_ids
    assert {rid: [t for o in outs for t in o.new_token_ids] for rid, outs in got.items()} == want
    assert engine.pool.rollout_pages == 0 and engine.pool.free_pages == engine.pool.total_pages


def test_each_tick_steps_one_engine_and_both_sides_finish():
    engine, served = dual()
    for i in range(4):
        engine.add(request(f"r{i}", seed=i))
        engine.serving_side.add(request(f"s{i}", max_tokens=10, seed=10 + i))
    got = run(engine)
    forwards = engine.rollout.steps + engine.serving.steps  # type: ignore[attr-defined]
    assert forwards == engine.stats.steps["rollout"] + engine.stats.steps["serving_prefill"] \
        + engine.stats.steps["serving_decode"]
    assert all(len(served[f"s{i}"]) == 10 for i in range(4))
    assert all(outs[-1].finish_reason == "length" for outs in got.values()) and len(got) == 4


def test_a_serving_burst_halves_b_roll_once_and_aborts_rollout_back_with_pages_conserved():
    engine, _ = dual(total_pages=40)  # H = 8 pages; B_roll = 32 with no serving yet
    for i in range(6):
        engine.add(request(f"r{i}", prompt_len=30, max_tokens=40, seed=i))
    for _ in range(3):
        engine.step()
    assert engine.pool.rollout_pages > 16 and engine.memory.budget == 32
    budgets = [engine.memory.budget]
    engine.serving_side.add(request("burst", prompt_len=60, max_tokens=40))  # 8 pages
    got = run(engine, ticks=5)
    budgets.append(engine.memory.budget)
    assert engine.memory.state is MemoryState.PRESSURE and engine.memory.budget == 16
    aborted = [rid for rid, outs in got.items() if outs[-1].finish_reason == "abort"]
    assert aborted and engine.stats.aborts["memory_pressure"] == len(aborted)
    assert engine.pool.rollout_pages <= 16
    run(engine)
    budgets.append(engine.memory.budget)
    assert budgets == sorted(budgets, reverse=True)  # never up within the step
    engine.load_weights({}, version=1)  # the next step: B_roll from serving's recent use again
    assert engine.memory.state is MemoryState.NORMAL and engine.weight_version == 1


def test_a_rollout_request_with_no_progress_for_2_s_goes_back_to_the_manager():
    now = [0.0]
    pool = PagePool(400, lease_s=60.0)
    memory = MemorySharing(pool)
    # Serving that always has a deadline due keeps rollout from running at all.
    scheduler = CoexecScheduler(DualSloAdmission(SloConfig(0.001, 0.001), profile()), 0)
    engine = DualEngine(TorchEngine("tiny", max_running=4, max_len=128),
                        TorchEngine("tiny", max_running=4, max_len=128), scheduler=scheduler,
                        memory=memory, rollout_profile=profile(), tokens_per_page=(8, 8),
                        clock=lambda: now[0])
    engine.add(request("starved"))
    engine.serving_side.add(request("busy", max_tokens=100))
    outputs = []
    for _ in range(30):  # 1.9 s of virtual time: still waiting
        now[0] += 0.0633
        outputs += engine.step()
    assert outputs == [] and engine.stats.steps["rollout"] == 0
    now[0] = 2.0
    [aborted] = engine.step()
    assert aborted.request_id == "starved" and aborted.finish_reason == "abort"
    assert engine.stats.aborts["stall"] == 1 and not engine.rollout.has_work()


def plain_serving(requests: list[EngineRequest]) -> dict[str, list[int]]:
    """What the serving engine alone, with room for everything, generates for ``requests``."""
    plain = TorchEngine("tiny", seed=1, max_running=8, max_len=128)
    for r in requests:
        plain.add(r)
    want: dict[str, list[int]] = defaultdict(list)
    while plain.has_work():
        for out in plain.step():
            want[out.request_id] += out.new_token_ids
    return want


def test_serving_beyond_the_whole_pool_waits_for_pages_and_all_of_it_is_served():
    engine, served = dual(total_pages=4)  # 32 tokens: two 6-token prompts, not five
    asked = [request(f"s{i}", prompt_len=6, max_tokens=6, seed=i) for i in range(5)]
    for r in asked:
        engine.serving_side.add(r)
    assert engine.stats.serving_queued == 1  # 4 prompts fit at first (1 page each), one waits
    run(engine)  # checks page conservation every tick
    assert dict(served) == plain_serving(asked)  # every token, as if there had been room
    assert engine.pool.free_pages == engine.pool.total_pages


def test_a_serving_request_that_cannot_grow_recomputes_the_latest_and_its_stream_goes_on():
    engine, served = dual(total_pages=4)
    asked = [request(f"s{i}", prompt_len=6, max_tokens=12, seed=i) for i in range(2)]
    for r in asked:  # 18 tokens each at the end: 3 pages each, 6 > 4
        engine.serving_side.add(r)
    run(engine)
    assert engine.stats.serving_preempted >= 1
    assert dict(served) == plain_serving(asked)  # the recomputed one continued exactly
    assert all(len(tokens) == 12 for tokens in served.values())


def test_a_serving_request_aborted_while_it_waits_for_pages_leaves_no_trace():
    engine, served = dual(total_pages=2)
    engine.serving_side.add(request("first", prompt_len=12, max_tokens=4))  # 2 pages
    engine.serving_side.add(request("waits", prompt_len=6, max_tokens=4))
    assert engine.stats.serving_queued == 1
    gone = engine.serving_side.abort("waits")
    assert gone.finish_reason == "abort" and gone.finished
    run(engine)
    assert list(served) == ["first"] and not engine.has_work()


def test_with_chunked_rollout_prefill_a_unit_is_predicted_and_run_as_one_chunk_at_most():
    engine, _ = dual(chunk=8)
    engine.add(request("long", prompt_len=60, max_tokens=4))
    unit = engine._rollout_unit()
    assert unit.cost_s == profile().decode_s(0) + profile().prefill_s(8)  # not 60 tokens' prefill
    prefilled = []
    for _ in range(100):
        if not engine.has_work():
            break
        engine.step()
        prefilled.append(engine.last_step_prefill_tokens)
    assert max(prefilled) == 8 and sum(prefilled) == 60  # 60 tokens in chunks of 8


def test_in_one_physical_pool_both_models_get_exactly_their_own_tokens_through_cuts():
    """The pool's pages are the KV: serving bursts take pages rollout held (its requests go
    back to the manager), serving recomputes when it cannot grow, and every token either model
    produced is the one it produces with memory of its own."""
    engine, served = dual(total_pages=12, paged=True, chunk=8)
    rollout_asked = [request(f"r{i}", prompt_len=10, max_tokens=12, seed=i) for i in range(4)]
    for r in rollout_asked:
        engine.add(r)
    for _ in range(4):
        engine.step()
    serving_asked = [request(f"s{i}", prompt_len=14, max_tokens=12, seed=10 + i)
                     for i in range(4)]
    for r in serving_asked:
        engine.serving_side.add(r)
    got = run(engine)  # page conservation checked every tick
    assert dict(served) == plain_serving(serving_asked)
    assert engine.stats.aborts and engine.pool.free_pages == engine.pool.total_pages
    plain = TorchEngine("tiny", seed=0, max_running=8, max_len=128)
    for r in rollout_asked:
        plain.add(r)
    want: dict[str, list[int]] = defaultdict(list)
    while plain.has_work():
        for out in plain.step():
            want[out.request_id] += out.new_token_ids
    for rid, outs in got.items():  # an aborted request's tokens are a prefix of the full run
        tokens = [t for o in outs for t in o.new_token_ids]
        assert tokens == want[rid][:len(tokens)], rid


def turns(engine: DualEngine, trajectories: int = 3, count: int = 3) -> dict[str, list[int]]:
    """Trajectories turn by turn on the rollout side: each turn's prompt is the last prompt, its
    completion and an observation. Returns each turn's tokens."""
    history = {t: [5 + (t * 7 + i) % 20 for i in range(10 + 3 * t)] for t in range(trajectories)}
    out: dict[str, list[int]] = {}
    for turn in range(count):
        for t in range(trajectories):
            engine.add(EngineRequest(f"t{t}.{turn}", list(history[t]),
                                     SamplingParams(max_tokens=9, seed=100 * t + turn)))
        done = run(engine)
        for t in range(trajectories):
            tokens = [tok for o in done[f"t{t}.{turn}"] for tok in o.new_token_ids]
            out[f"t{t}.{turn}"] = tokens
            history[t] = history[t] + tokens + [7, 8, 9 + turn]
    return out


def test_a_turn_takes_over_its_last_turns_parked_pages_and_generates_the_same_tokens():
    plain, _ = dual(paged=True)
    reused, _ = dual(paged=True, prefix_reuse=True)
    assert turns(reused) == turns(plain)
    load = reused.load()
    assert load.prefix_lookups == 9 and load.prefix_hits == 6  # every turn after the first
    assert load.prefix_cached_tokens >= 6 * 8
    assert plain.load().prefix_lookups == 0
    # The last turns are parked (ROLLOUT_CACHED), each table whole; pages conserved.
    assert load.prefix_cache_pages == reused.pool.count(PageState.ROLLOUT_CACHED) > 0
    reused.pool.check()


def test_parked_prefixes_expire_on_their_lease_and_a_weight_load_frees_them():
    now = [0.0]
    engine, _ = dual(paged=True, prefix_reuse=True, lease_s=5.0, clock=lambda: now[0])
    turns(engine, count=1)
    assert engine.pool.count(PageState.ROLLOUT_CACHED) > 0
    now[0] += 6.0  # past the lease: freed, and no abort reaches the manager for them
    assert engine.step() == []
    assert engine.pool.count(PageState.ROLLOUT_CACHED) == 0 and len(engine._parked) == 0
    turns(engine, count=1)
    assert engine.pool.count(PageState.ROLLOUT_CACHED) > 0
    engine.load_weights({}, 1)
    assert engine.pool.count(PageState.ROLLOUT_CACHED) == 0 and len(engine._parked) == 0
    engine.pool.check()


def test_a_rollout_request_queued_behind_a_full_batch_outlives_the_page_lease():
    """The lease frees pages nobody uses (parked prefixes); a request waiting for a slot while
    rollout steps run is in use though it has no output to renew its pages with."""
    now = [0.0]
    engine, _ = dual(lease_s=10.0, clock=lambda: now[0])
    for i in range(9):  # the rollout engine runs 8: the 9th waits ~30 steps, 15 s, for a slot
        engine.add(request(f"r{i}", max_tokens=30, seed=i))
    ends: dict[str, str] = {}
    while engine.has_work():
        for out in engine.step():
            if out.finished:
                ends[out.request_id] = out.finish_reason
        now[0] += 0.5  # each step takes 0.5 s
    assert ends == {f"r{i}": "length" for i in range(9)}, ends
    assert engine.stats.aborts.get("lease", 0) == 0
    engine.pool.check()


def test_a_turn_sent_again_under_its_parked_id_replaces_that_table():
    engine, _ = dual(paged=True, prefix_reuse=True)
    first = turns(engine, trajectories=1, count=1)["t0.0"]
    history = [5 + i % 20 for i in range(10)]
    engine.add(EngineRequest("t0.0", history, SamplingParams(max_tokens=9, seed=0)))
    again = [t for o in run(engine)["t0.0"] for t in o.new_token_ids]
    assert again == first
    engine.pool.check()
