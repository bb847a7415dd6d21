"""The torch engine's KV budget (RollPacker §4.2 memory pressure): past the budget the newest
request is preempted and recomputed later, vLLM-style, its completion unchanged; the count
reaches the load message and the worker's metrics."""

from __future__ import annotations

import random

import pytest
import torch
from prometheus_client import REGISTRY

from rlharvest.common.engine_types import EngineLoad, EngineRequest
from rlharvest.services.rollout_worker.torch_engine import TorchEngine

from .test_torch_engine import (  # one_torch_thread: the module fixture, autouse here too
    MAX_LEN,
    collect,
    drain,
    engine,
    one_torch_thread,  # noqa: F401
    prompt,
    sampled,
)

BUDGET = MAX_LEN  # the smallest budget allowed: about three of the requests below at once


def crowd(count: int = 8, seed: int = 900) -> list[EngineRequest]:
    """Sampled requests (temperature 1) of 4 to 16 prompt tokens and 24 to generate, one of them
    resumed: together they hold far more KV than ``BUDGET``."""
    rng = random.Random(seed)
    requests = [EngineRequest(f"r{i}", prompt(seed + i, length=rng.randrange(4, 17)),
                              sampled(seed + i, max_tokens=24, top_p=rng.choice([0.9, 1.0])))
                for i in range(count)]
    requests[-1].generated_token_ids = [rng.randrange(3, 128) for _ in range(5)]
    return requests


def run_all(eng: TorchEngine, requests: list[EngineRequest]
            ) -> dict[str, tuple[list[int], list[float], str]]:
    """Drains ``eng``, checking after every step that the KV in use stays within its budget."""
    for r in requests:
        eng.add(r)
    done: dict[str, tuple[list[int], list[float], str]] = {}
    while eng.has_work():
        collect(eng.step(), done)
        assert eng.load().kv_used_tokens <= (eng._kv_budget or eng.load().kv_capacity_tokens)
    return done


@pytest.mark.parametrize("prefill_chunk", [0, 5])
def test_preempted_requests_finish_with_the_tokens_and_logprobs_of_an_unlimited_engine(
        prefill_chunk):
    requests = crowd()
    unlimited = run_all(engine(prefill_chunk=prefill_chunk), requests)
    budgeted = engine(prefill_chunk=prefill_chunk, kv_budget_tokens=BUDGET)
    pressed = run_all(budgeted, requests)
    assert budgeted.preemptions >= 3  # the claim below is about preempted requests
    assert pressed.keys() == unlimited.keys()
    for rid, (tokens, logprobs, reason) in unlimited.items():
        assert pressed[rid][0] == tokens and pressed[rid][2] == reason == "length"
        assert torch.allclose(torch.tensor(pressed[rid][1]), torch.tensor(logprobs),
                              rtol=1e-4, atol=1e-5)


def test_the_newest_request_is_preempted_waits_first_in_line_and_emits_nothing_meanwhile():
    eng = engine(kv_budget_tokens=BUDGET)
    for i in range(3):  # each holds 20 + generated tokens: three fit until 3 * (20 + g) > 96
        eng.add(EngineRequest(f"r{i}", prompt(i, length=20), sampled(i, max_tokens=24)))
    eng.add(EngineRequest("late", prompt(9, length=40), sampled(9, max_tokens=2)))
    assert {out.request_id for out in eng.step()} == {"r0", "r1", "r2"}  # 3 * 21 + 41 > 96
    while eng.preemptions == 0:
        outputs = eng.step()
    assert {out.request_id for out in outputs} == {"r0", "r1"}
    assert list(eng._pending) == ["r2", "late"]
    assert (eng.load().executing, eng.load().pending) == (2, 2)


def test_admission_holds_back_a_request_that_does_not_fit_beside_the_running_ones():
    eng = engine(kv_budget_tokens=BUDGET)
    eng.add(EngineRequest("a", prompt(1, length=50), sampled(1, max_tokens=8)))
    eng.add(EngineRequest("b", prompt(2, length=50), sampled(2, max_tokens=8)))
    eng.step()
    assert (eng.load().executing, eng.load().pending) == (1, 1)
    done = drain(eng)
    assert len(done["a"][0]) == 7 and len(done["b"][0]) == 8  # "a" emitted its first above
    assert eng.preemptions == 0  # waiting is not preempting: "b" never held a slot


def test_load_reports_the_preemptions_since_start_and_the_budget_as_kv_capacity():
    eng = engine(kv_budget_tokens=BUDGET)
    assert eng.load().preemptions == 0 and eng.load().kv_capacity_tokens == BUDGET
    run_all(eng, crowd())
    assert eng.load().preemptions == eng.preemptions > 0
    run_all(eng, crowd(seed=950))
    assert eng.load().preemptions > 0 and eng.load().preemptions == eng.preemptions


def test_without_a_budget_nothing_is_preempted():
    eng = engine(max_running=4)  # the queue, not memory, limits what runs
    run_all(eng, crowd())
    assert eng.preemptions == 0 and eng.load().preemptions == 0


def test_the_pump_passes_preemptions_into_the_load_message_and_the_counter():
    from rlharvest.common.worker_core.engine_pump import EnginePump

    class Pressed:
        preemptions = 3

        def load(self) -> EngineLoad:
            return EngineLoad(pending=0, executing=0, kv_used_tokens=0, kv_capacity_tokens=96,
                              weight_version=0, preemptions=self.preemptions)

    def counted() -> float:
        return REGISTRY.get_sample_value("rlh_worker_preemptions_total") or 0.0

    before = counted()
    engine_ = Pressed()
    pump = EnginePump(engine_, sink=None)  # snapshot_load only
    assert pump.last_load.preemptions == 3 and counted() == before + 3
    engine_.preemptions = 5
    assert pump.snapshot_load().preemptions == 5 and counted() == before + 5
    pump.close()


@pytest.mark.parametrize("options, message", [
    ({"kv_budget_tokens": 64}, r"kv_budget_tokens \(64\) must be >= max_len \(96\)"),
    ({"kv_budget_tokens": -1}, "kv_budget_tokens must be >= 0"),
    ({"kv_budget_tokens": 200, "kv_pages": 64}, "cannot be combined with paged KV"),
])
def test_a_budget_below_max_len_negative_or_with_paged_kv_is_refused(options, message):
    with pytest.raises(ValueError, match=message):
        TorchEngine("tiny", max_running=2, max_len=MAX_LEN, **options)


def test_the_worker_config_passes_kv_budget_tokens_to_its_engine():
    from rlharvest.services.rollout_worker.config import WorkerConfig
    from rlharvest.services.rollout_worker.main import build_engine

    assert WorkerConfig().kv_budget_tokens == 0
    eng = build_engine(WorkerConfig(max_running=2, max_len=MAX_LEN, kv_budget_tokens=128))
    assert eng.load().kv_capacity_tokens == 128
    with pytest.raises(ValueError, match="must be >= max_len"):
        build_engine(WorkerConfig(max_running=2, max_len=MAX_LEN, kv_budget_tokens=64))
