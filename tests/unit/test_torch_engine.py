"""TorchEngine: the built-in rollout engine (RLBoost §4.2: stream tokens, abort, resume elsewhere).

The tiny model's seeded init is nearly uniform, which makes greedy decoding repeat one token. The
tests load a *sharpened* copy (matrices scaled up) so that greedy and sampled completions vary from
token to token and any mix-up of positions, slots or weights shows in the output.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from safetensors.torch import save_file

from rlharvest.models.tiny_model import build_model
from rlharvest.common.engine_types import EngineInputError, EngineRequest, SamplingParams
from rlharvest.services.rollout_worker.kv_cache import SlotKVCache
from rlharvest.services.rollout_worker.decoder_forward import DecoderForward
from rlharvest.services.rollout_worker.torch_engine import TorchEngine
from tests.builders import decoder_of

MAX_LEN = 96
SHARP_VERSION = 1


def sharpened(model: torch.nn.Module, factor: float = 6.0) -> dict[str, torch.Tensor]:
    return {name: value * factor if value.dim() == 2 else value.clone()
            for name, value in model.state_dict().items()}


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """The model's ops are tiny: on a shared 2-core machine, OpenMP threads spin-waiting for a
    busy core make every op wait (steps 20x slower). Restored so other modules keep theirs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def hf_model():
    model = build_model("tiny", seed=0)
    model.load_state_dict(sharpened(model))
    return model


def engine(max_running: int = 16, weights: dict | None = None, **kwargs) -> TorchEngine:
    eng = TorchEngine("tiny", seed=0, max_running=max_running, max_len=MAX_LEN, **kwargs)
    eng.load_weights(weights or sharpened(build_model("tiny", seed=0)), SHARP_VERSION)
    return eng


def prompt(seed: int, length: int = 8) -> list[int]:
    rng = random.Random(seed)
    return [1] + [rng.randrange(3, 128) for _ in range(length - 1)]


def sampled(seed: int, max_tokens: int = 24, **overrides) -> SamplingParams:
    return SamplingParams(**{"temperature": 1.0, "top_p": 0.9, "max_tokens": max_tokens,
                             "seed": seed, **overrides})


def drain(eng: TorchEngine) -> dict[str, tuple[list[int], list[float], str]]:
    """Steps until idle; returns request id -> (tokens, logprobs, finish reason)."""
    done: dict[str, tuple[list[int], list[float], str]] = {}
    while eng.has_work():
        collect(eng.step(), done)
    return done


def collect(outputs, done: dict) -> None:
    for out in outputs:
        tokens, logprobs, _ = done.get(out.request_id, ([], [], ""))
        done[out.request_id] = (tokens + out.new_token_ids, logprobs + out.new_logprobs,
                                out.finish_reason)


def run_alone(request: EngineRequest) -> list[int]:
    eng = engine()
    eng.add(request)
    return drain(eng)[request.request_id][0]


# ---- the forward pass ----------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_forward_matches_hf_logits_in_prefill_and_decode(preset):
    model = build_model(preset, seed=4)
    model.load_state_dict(sharpened(model, 3.0))
    model.requires_grad_(False)
    forward = DecoderForward(decoder_of(model), max_len=64)
    cfg = model.config
    cache = SlotKVCache(cfg.num_hidden_layers, 3, cfg.num_key_value_heads, 64, cfg.head_dim,
                        torch.float32, "cpu")
    seqs = torch.randint(3, 128, (2, 30), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        reference = model(seqs).logits
        cache.acquire()  # slot 0 holds an unrelated request: decode must not read it
        forward.prefill(seqs[:1, :5].flip(1), [5], cache, first_slot=0)
        cache.acquire(), cache.acquire()
        # Right-padded batched prefill: rows of 12 and 9 real tokens.
        prefill = forward.prefill(seqs[:, :12], [12, 9], cache, first_slot=1)
        assert (prefill - reference[[0, 1], [11, 8]]).abs().max() < 1e-4
        positions = [5, 12, 9]
        for _ in range(10):
            fed = torch.stack([seqs[0, 0], seqs[0, positions[1]], seqs[1, positions[2]]])
            logits = forward.decode(fed, cache)
            assert (logits[1] - reference[0, positions[1]]).abs().max() < 1e-4
            assert (logits[2] - reference[1, positions[2]]).abs().max() < 1e-4
            positions = [p + 1 for p in positions]


def test_greedy_output_equals_hf_generate_greedy(hf_model):
    eng = engine()
    prompts = [prompt(s, length=4 + s) for s in range(4)]
    for i, p in enumerate(prompts):
        eng.add(EngineRequest(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=20)))
    done = drain(eng)
    for i, p in enumerate(prompts):
        hf = hf_model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=20,
                               min_new_tokens=20, pad_token_id=0)
        assert done[f"r{i}"][0] == hf[0, len(p):].tolist()
    assert len(set(done["r0"][0])) > 3  # the sharpened model does not just repeat a token


# ---- continuous batching -------------------------------------------------------------------


def test_requests_joining_mid_way_produce_the_same_tokens_as_when_run_alone():
    requests = [EngineRequest(f"r{i}", prompt(10 + i, length=5 + 2 * i), sampled(100 + i))
                for i in range(5)]
    alone = {r.request_id: run_alone(r) for r in requests}
    eng = engine(max_running=3)
    done: dict = {}
    eng.add(requests[0])
    for i, request in enumerate(requests[1:], start=1):
        for _ in range(i * 3):  # stagger: each request joins a batch already decoding
            collect(eng.step(), done)
        eng.add(request)
    while eng.has_work():
        collect(eng.step(), done)
    assert {rid: tokens for rid, (tokens, _, _) in done.items()} == alone


def test_each_step_reports_every_executing_request_once():
    eng = engine(max_running=4)
    for i in range(4):
        eng.add(EngineRequest(f"r{i}", prompt(i), sampled(i, max_tokens=3 + i)))
    lengths = []
    while eng.has_work():
        outputs = eng.step()
        ids = [out.request_id for out in outputs]
        assert len(ids) == len(set(ids)) and all(len(o.new_token_ids) == 1 for o in outputs)
        lengths.append(len(ids))
    assert lengths == [4, 4, 4, 3, 2, 1]  # finished requests leave the batch at once


def test_aborting_a_request_mid_batch_leaves_the_others_unchanged():
    requests = [EngineRequest(f"r{i}", prompt(20 + i), sampled(200 + i)) for i in range(4)]
    alone = {r.request_id: run_alone(r) for r in requests}
    eng = engine()
    for r in requests:
        eng.add(r)
    done: dict = {}
    for _ in range(5):
        collect(eng.step(), done)
    final = eng.abort("r0")  # slot 0: the last slot moves into it
    assert (final.finished, final.finish_reason, final.new_token_ids) == (True, "abort", [])
    del done["r0"]
    while eng.has_work():
        collect(eng.step(), done)
    assert "r0" not in done
    assert {rid: tokens for rid, (tokens, _, _) in done.items()} == {
        rid: tokens for rid, tokens in alone.items() if rid != "r0"}


def test_prefill_split_into_groups_under_the_token_budget_gives_the_same_tokens():
    requests = [EngineRequest(f"r{i}", prompt(40 + i, length=6 + i), sampled(400 + i))
                for i in range(5)]
    alone = {r.request_id: run_alone(r) for r in requests}
    eng = engine(prefill_token_budget=20)  # 5 requests joining at once: groups of 2, 2 and 1
    for r in requests:
        eng.add(r)
    assert {rid: tokens for rid, (tokens, _, _) in drain(eng).items()} == alone


# ---- sampling through the engine -----------------------------------------------------------


def test_stop_token_ends_the_completion_and_is_included():
    p = prompt(3)
    free = run_alone(EngineRequest("a", p, sampled(7, max_tokens=30)))
    stop = free[10]
    first = free.index(stop)
    eng = engine()
    eng.add(EngineRequest("a", p, sampled(7, max_tokens=30, stop_token_ids=(stop,))))
    tokens, logprobs, reason = drain(eng)["a"]
    assert tokens == free[:first + 1] and len(logprobs) == len(tokens)
    assert reason == "stop"


def test_max_tokens_caps_the_completion_with_reason_length():
    tokens, logprobs, reason = drain_one(EngineRequest("a", prompt(4), sampled(1, max_tokens=7)))
    assert len(tokens) == 7 and len(logprobs) == 7 and reason == "length"


def drain_one(request: EngineRequest) -> tuple[list[int], list[float], str]:
    eng = engine()
    eng.add(request)
    return drain(eng)[request.request_id]


def test_top_k_1_equals_greedy():
    p = prompt(5)
    greedy = run_alone(EngineRequest("g", p, SamplingParams(temperature=0.0, max_tokens=20)))
    top1 = run_alone(EngineRequest("k", p, SamplingParams(temperature=1.5, top_k=1,
                                                          max_tokens=20, seed=3)))
    assert top1 == greedy


def test_top_p_restricts_every_token_to_the_nucleus_and_logprob_is_the_policys(hf_model):
    top_p = 0.5
    p = prompt(6)
    tokens, logprobs, _ = drain_one(EngineRequest("a", p, sampled(9, max_tokens=20, top_p=top_p)))
    with torch.inference_mode():
        logits = hf_model(torch.tensor([p + tokens])).logits[0, len(p) - 1:-1]
    policy = logits.log_softmax(-1)
    for step, token in enumerate(tokens):
        probs, order = policy[step].exp().sort(descending=True)
        mass_before = probs.cumsum(0) - probs
        nucleus = set(order[mass_before < top_p].tolist())
        assert token in nucleus
        assert abs(logprobs[step] - policy[step, token].item()) < 1e-4
    unrestricted = run_alone(EngineRequest("b", p, sampled(9, max_tokens=20, top_p=1.0)))
    assert unrestricted != tokens  # the cut changed at least one draw


# ---- resume (migration) --------------------------------------------------------------------


def test_resumed_request_on_a_fresh_engine_continues_as_if_uninterrupted():
    """RLBoost §4.2: a migrated request is prefilled with prompt + generated tokens and continues.

    Equality is exact unless the one-pass prefill and token-by-token decode round a near-tie
    differently; over 48 requests the agreement must stay >= 95% (it is 100% in practice).
    """
    count, max_tokens = 48, 24
    rng = random.Random(0)
    requests = [EngineRequest(f"r{i}", prompt(300 + i, length=rng.randrange(3, 12)),
                              sampled(i, max_tokens, top_k=rng.choice([0, 20]),
                                      temperature=rng.choice([0.7, 1.0])))
                for i in range(count)]
    cut_at = {r.request_id: rng.randrange(1, max_tokens) for r in requests}

    reference = engine(max_running=count)
    for r in requests:
        reference.add(r)
    uninterrupted = drain(reference)

    first_worker = engine(max_running=count)
    for r in requests:
        first_worker.add(r)
    partial: dict = {}
    preempted: set[str] = set()
    while first_worker.has_work():
        collect(first_worker.step(), partial)
        for rid, (tokens, _, _) in partial.items():
            if len(tokens) == cut_at[rid] and rid not in preempted:
                first_worker.abort(rid)  # the worker is preempted for this request
                preempted.add(rid)

    second_worker = engine(max_running=count)
    for r in requests:
        done_tokens = partial[r.request_id][0]
        assert len(done_tokens) == cut_at[r.request_id]
        second_worker.add(EngineRequest(r.request_id, r.prompt_token_ids, r.sampling,
                                        generated_token_ids=done_tokens))
    resumed = drain(second_worker)

    agree = 0
    for r in requests:
        rid = r.request_id
        whole = partial[rid][0] + resumed[rid][0]
        agree += whole == uninterrupted[rid][0]
        assert len(whole) == max_tokens  # max_tokens counts the tokens before the resume
        assert resumed[rid][2] == "length"
    assert agree / count >= 0.95, f"only {agree}/{count} resumed requests continued identically"


# ---- queueing, abort and load ----------------------------------------------------------------


def test_excess_requests_wait_fifo_beyond_max_running():
    eng = engine(max_running=2)
    for i in range(5):
        eng.add(EngineRequest(f"r{i}", prompt(i), sampled(i, max_tokens=2)))
    assert (eng.load().pending, eng.load().executing) == (5, 0)
    first = eng.step()
    assert [o.request_id for o in first] == ["r0", "r1"]
    assert (eng.load().pending, eng.load().executing) == (3, 2)
    second = eng.step()  # r0 and r1 finish, freeing both slots for the next step
    assert all(o.finished for o in second)
    assert [o.request_id for o in eng.step()] == ["r2", "r3"]
    assert (eng.load().pending, eng.load().executing) == (1, 2)


def test_each_step_reports_the_prompt_and_resume_tokens_it_prefilled():
    eng = engine(max_running=2)
    assert eng.last_step_prefill_tokens == 0 and eng.batch_admission == "slots"
    eng.add(EngineRequest("a", prompt(1, length=5), sampled(1, max_tokens=2)))
    eng.add(EngineRequest("b", prompt(2, length=7), sampled(2, max_tokens=6),
                          generated_token_ids=[40, 41, 42]))  # a resume prefills these too
    eng.add(EngineRequest("c", prompt(3, length=4), sampled(3, max_tokens=3)))
    eng.step()
    assert eng.last_step_prefill_tokens == 5 + 7 + 3  # c waits: both slots taken
    eng.step()  # a finishes: pure decode
    assert eng.last_step_prefill_tokens == 0
    eng.step()
    assert eng.last_step_prefill_tokens == 4  # c takes a's slot


def test_abort_pending_and_unknown_requests():
    eng = engine(max_running=1)
    eng.add(EngineRequest("run", prompt(1), sampled(1, max_tokens=4)))
    eng.add(EngineRequest("wait", prompt(2), sampled(2, max_tokens=4)))
    eng.step()
    final = eng.abort("wait")
    assert final.finish_reason == "abort" and eng.load().pending == 0
    done = drain(eng)
    assert set(done) == {"run"} and done["run"][2] == "length"
    with pytest.raises(KeyError, match="run"):  # finished requests are gone
        eng.abort("run")
    with pytest.raises(KeyError, match="nobody"):
        eng.abort("nobody")


def test_load_reports_kv_tokens_held_capacity_and_version():
    eng = engine(max_running=4)
    eng.add(EngineRequest("a", prompt(1, length=6), sampled(1, max_tokens=10)))
    eng.add(EngineRequest("b", prompt(2, length=9), sampled(2, max_tokens=10)))
    assert eng.load().kv_used_tokens == 0
    eng.step()  # prefill holds the prompts; the sampled token enters the cache next step
    load = eng.load()
    assert load.kv_used_tokens == 6 + 9
    assert load.kv_capacity_tokens == 4 * MAX_LEN and load.weight_version == SHARP_VERSION
    eng.step()
    assert eng.load().kv_used_tokens == 6 + 9 + 2
    eng.abort("a")
    assert eng.load().kv_used_tokens == 9 + 1 and eng.load().executing == 1


# ---- weights ---------------------------------------------------------------------------------


def test_weight_load_changes_outputs_and_the_reported_version(hf_model):
    eng = engine()
    greedy = SamplingParams(temperature=0.0, max_tokens=16)
    p = prompt(8)
    eng.add(EngineRequest("before", p, greedy))
    before = drain(eng)["before"][0]
    other = build_model("tiny", seed=1)
    new_weights = sharpened(other)
    eng.load_weights(new_weights, 7)
    assert eng.weight_version == 7 and eng.load().weight_version == 7
    eng.add(EngineRequest("after", p, greedy))
    after = drain(eng)["after"][0]
    assert after != before
    other.load_state_dict(new_weights)
    expected = other.generate(torch.tensor([p]), do_sample=False, max_new_tokens=16,
                              min_new_tokens=16, pad_token_id=0)
    assert after == expected[0, len(p):].tolist()


@pytest.mark.parametrize("bad, message", [
    ({"model.no_such.weight": torch.zeros(3)}, "unknown tensor name"),
    ({"model.norm.weight": torch.zeros(5)}, "shape"),
    ({"model.norm.weight": torch.zeros(64, dtype=torch.int64)}, "floating-point"),
    ({"model.norm.weight": torch.full((64,), float("nan"))}, "NaN"),
])
def test_weight_load_refuses_bad_tensors_atomically(bad, message):
    eng = engine()
    p = prompt(9)
    eng.add(EngineRequest("before", p, SamplingParams(temperature=0.0, max_tokens=12)))
    before = drain(eng)["before"][0]
    good_change = {"model.embed_tokens.weight": torch.randn(128, 64)}
    with pytest.raises(EngineInputError, match=message):
        eng.load_weights({**good_change, **bad}, 9)
    assert eng.weight_version == SHARP_VERSION
    eng.add(EngineRequest("after", p, SamplingParams(temperature=0.0, max_tokens=12)))
    assert drain(eng)["after"][0] == before  # the valid tensor was not copied either


def test_weight_version_must_be_a_non_negative_int():
    eng = engine()
    for version in (-1, 1.5, True):
        with pytest.raises(EngineInputError, match="version"):
            eng.load_weights({}, version)


def test_load_safetensors_roundtrip_and_bad_path(tmp_path):
    path = tmp_path / "v3.safetensors"
    save_file({k: v.contiguous() for k, v in sharpened(build_model("tiny", seed=2)).items()
               if k != "lm_head.weight"}, str(path))  # tied: saved once, like HF checkpoints
    eng = TorchEngine("tiny", seed=0, max_running=2, max_len=MAX_LEN)
    eng.load_safetensors(path, 3)
    assert eng.weight_version == 3
    eng.add(EngineRequest("a", prompt(1), SamplingParams(temperature=0.0, max_tokens=8)))
    reference = build_model("tiny", seed=2)
    reference.load_state_dict(sharpened(reference))
    expected = reference.generate(torch.tensor([prompt(1)]), do_sample=False, max_new_tokens=8,
                                  min_new_tokens=8, pad_token_id=0)
    assert drain(eng)["a"][0] == expected[0, len(prompt(1)):].tolist()
    with pytest.raises(EngineInputError, match="cannot read weights"):
        eng.load_safetensors(tmp_path / "missing.safetensors", 4)


# ---- bad input -------------------------------------------------------------------------------


BAD_REQUESTS = [
    (dict(prompt_token_ids=[]), "empty prompt"),
    (dict(prompt_token_ids=[1, 128]), r"prompt_token_ids\[1\] = 128"),
    (dict(prompt_token_ids=[-1, 5]), r"prompt_token_ids\[0\] = -1"),
    (dict(generated_token_ids=[4, 999]), r"generated_token_ids\[1\] = 999"),
    (dict(sampling=SamplingParams(max_tokens=0)), "max_tokens must be a positive"),
    (dict(sampling=SamplingParams(max_tokens=-3)), "max_tokens must be a positive"),
    (dict(sampling=SamplingParams(temperature=-0.1)), r"temperature must be in \[0, "),
    (dict(sampling=SamplingParams(temperature=float("nan"))), "temperature must be in"),
    (dict(sampling=SamplingParams(temperature=float("inf"))), "temperature must be in"),
    # Finite, but past float32: the step's float32 row could not hold it (the engine died).
    (dict(sampling=SamplingParams(temperature=1e300)), "temperature must be in"),
    (dict(sampling=SamplingParams(top_k=2**64)), "top_k must be an int >= 0"),
    (dict(sampling=SamplingParams(top_p=0.0)), r"top_p must be in \(0, 1\]"),
    (dict(sampling=SamplingParams(top_p=1.5)), r"top_p must be in \(0, 1\]"),
    (dict(sampling=SamplingParams(top_k=-1)), "top_k must be an int >= 0"),
    (dict(sampling=SamplingParams(stop_token_ids=(500,))), r"stop_token_ids\[0\] = 500"),
    (dict(sampling=SamplingParams(max_tokens=MAX_LEN)), "exceeds the context"),
    (dict(sampling=SamplingParams(max_tokens=3), generated_token_ids=[5, 6, 7]),
     "nothing left to generate"),
    (dict(sampling=SamplingParams(stop_token_ids=(2,)), generated_token_ids=[5, 2]),
     "already finished"),
    (dict(request_id=""), "request_id must be a non-empty string"),
]


@pytest.mark.parametrize("fields, message", BAD_REQUESTS)
def test_bad_requests_are_refused_with_a_precise_message(fields, message):
    eng = engine(max_running=2)
    base = dict(request_id="x", prompt_token_ids=[1, 5, 6], sampling=SamplingParams())
    with pytest.raises(EngineInputError, match=message):
        eng.add(EngineRequest(**{**base, **fields}))
    assert not eng.has_work()
    eng.add(EngineRequest("ok", [1, 5, 6], SamplingParams(max_tokens=2)))  # still serving
    assert drain(eng)["ok"][2] == "length"


def test_duplicate_ids_are_refused_while_pending_or_running():
    eng = engine(max_running=1)
    eng.add(EngineRequest("a", prompt(1), sampled(1)))
    eng.add(EngineRequest("b", prompt(2), sampled(2)))
    eng.step()  # a runs, b waits
    for rid in ("a", "b"):
        with pytest.raises(EngineInputError, match=f"request {rid} is already queued or running"):
            eng.add(EngineRequest(rid, prompt(3), sampled(3)))
    eng.abort("a")
    eng.add(EngineRequest("a", prompt(3), sampled(3)))  # an id is free again once it is gone


def test_kv_cache_release_keeps_occupied_slots_compact():
    cache = SlotKVCache(1, 3, 1, 8, 2, torch.float32, "cpu")
    for slot in range(3):
        assert cache.acquire() == slot
        cache.k[0, slot, 0, :slot + 1] = float(slot + 1)
        cache.set_length(slot, slot + 1)
    assert cache.release(0) == 2  # the last slot moved into the hole
    assert cache.host_lengths == [3, 2] and cache.lengths[:2].tolist() == [3, 2]
    assert torch.equal(cache.k[0, 0, 0, :3], torch.full((3, 2), 3.0))
    assert cache.release(1) is None and cache.occupied == 1
    with pytest.raises(IndexError, match="not occupied"):
        cache.release(1)


def test_a_local_checkpoint_directory_serves_like_the_model_it_was_saved_from(tmp_path):
    """`--model /path/to/checkpoint` (save_pretrained layout) is the same path as a preset."""
    source = build_model("tiny", seed=0)
    source.load_state_dict(sharpened(source), strict=False)
    source.save_pretrained(tmp_path / "ckpt")
    from_dir = TorchEngine(str(tmp_path / "ckpt"), max_running=4, max_len=MAX_LEN)
    from_preset = engine(max_running=4)
    for eng in (from_dir, from_preset):
        for i in range(3):
            eng.add(EngineRequest(f"c{i}", prompt(i), sampled(i, max_tokens=16)))
    assert drain(from_dir) == drain(from_preset)
    with pytest.raises(ValueError, match="never downloads"):
        TorchEngine(str(tmp_path / "missing"), max_running=1, max_len=MAX_LEN)


# ---- chunked prefill (ROSE §4.1) -------------------------------------------------------------


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_forward_prefill_from_an_offset_matches_hf_logits_and_decode_continues(preset):
    model = build_model(preset, seed=4)
    model.load_state_dict(sharpened(model, 3.0))
    model.requires_grad_(False)
    forward = DecoderForward(decoder_of(model), max_len=64)
    cfg = model.config
    cache = SlotKVCache(cfg.num_hidden_layers, 2, cfg.num_key_value_heads, 64, cfg.head_dim,
                        torch.float32, "cpu")
    seq = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        reference = model(seq).logits[0]
        cache.acquire()  # slot 0 holds an unrelated request: the chunks must not read it
        forward.prefill(seq[:, :7].flip(1), [7], cache, first_slot=0)
        cache.acquire()
        for start, end in ((0, 5), (5, 6), (6, 17), (17, 30)):
            logits = forward.prefill_from(seq[0, start:end], cache, slot=1, start=start)
            assert (logits[0] - reference[end - 1]).abs().max() < 1e-4
        assert cache.host_lengths == [7, 30]
        for position in range(30, 40):  # decode reads the chunks' keys as a whole prefill's
            logits = forward.decode(torch.stack([seq[0, 0], seq[0, position]]), cache)
            assert (logits[1] - reference[position]).abs().max() < 1e-4


def mixed_requests(count: int, seed: int) -> list[EngineRequest]:
    """Prompts of 1 to 60 tokens, greedy and sampled, a third of them resumed."""
    rng = random.Random(seed)
    requests = []
    for i in range(count):
        resumed = [rng.randrange(3, 128) for _ in range(rng.choice([0, 0, 6]))]
        params = (SamplingParams(temperature=0.0, max_tokens=16 + len(resumed)) if i % 2
                  else sampled(seed + i, max_tokens=16 + len(resumed)))
        requests.append(EngineRequest(f"r{i}", prompt(seed + i, length=rng.randrange(1, 61)),
                                      params, generated_token_ids=resumed))
    return requests


def tokens_of(requests: list[EngineRequest], **engine_kwargs) -> dict[str, list[int]]:
    eng = engine(**engine_kwargs)
    for r in requests:
        eng.add(r)
    return {rid: tokens for rid, (tokens, _, _) in drain(eng).items()}


@pytest.mark.parametrize("chunk", [1, 3, 7, 16])
def test_chunked_prefill_gives_the_same_tokens_as_whole_prompt_prefill(chunk):
    """Exact equality holds in float32: over 200 mixed requests x chunks {1, 2, 3, 5, 7, 16, 33}
    x max_running {1, 5, 16} no token differed from whole-prompt prefill."""
    requests = mixed_requests(24, seed=700)
    whole = tokens_of(requests, max_running=6)
    assert tokens_of(requests, max_running=6, prefill_chunk=chunk) == whole


def test_no_step_prefills_more_than_the_chunk_and_a_long_prompt_waits_ceil_len_over_chunk_steps():
    chunk, length = 7, 40
    eng = engine(max_running=4, prefill_chunk=chunk)
    eng.add(EngineRequest("long", prompt(1, length=length), sampled(1, max_tokens=4)))
    prefilled = []
    while not (outputs := eng.step()):
        prefilled.append(eng.last_step_prefill_tokens)
        assert eng.has_work() and (eng.load().executing, eng.load().pending) == (1, 0)
        assert eng.load().kv_used_tokens == sum(prefilled)
    prefilled.append(eng.last_step_prefill_tokens)
    assert prefilled == [7, 7, 7, 7, 7, 5] and len(prefilled) == math.ceil(length / chunk)
    assert [o.request_id for o in outputs] == ["long"]

    requests = mixed_requests(12, seed=800)
    eng = engine(max_running=5, prefill_chunk=chunk)
    for r in requests:
        eng.add(r)
    total = 0
    while eng.has_work():
        eng.step()
        assert 0 <= eng.last_step_prefill_tokens <= chunk
        total += eng.last_step_prefill_tokens
    assert total == sum(len(r.prompt_token_ids) + len(r.generated_token_ids) for r in requests)


def test_running_requests_keep_decoding_one_token_per_step_while_a_long_prompt_is_chunk_prefilled():
    short = [EngineRequest(f"s{i}", prompt(60 + i, length=4), sampled(60 + i, max_tokens=20))
             for i in range(2)]
    long = EngineRequest("long", prompt(70, length=60), sampled(70, max_tokens=12))
    eng = engine(max_running=4, prefill_chunk=8)
    for r in short:
        eng.add(r)
    done: dict = {}
    collect(eng.step(), done)  # both short prompts fit in one chunk
    assert set(done) == {"s0", "s1"}
    eng.add(long)
    for _ in range(7):  # 60 tokens in chunks of 8: the long prompt's first token comes in step 8
        outputs = eng.step()
        assert sorted((o.request_id, len(o.new_token_ids)) for o in outputs) == [
            ("s0", 1), ("s1", 1)]
        assert eng.last_step_prefill_tokens == 8
        collect(outputs, done)
    outputs = eng.step()
    assert sorted(o.request_id for o in outputs) == ["long", "s0", "s1"]
    assert eng.last_step_prefill_tokens == 4
    collect(outputs, done)
    while eng.has_work():
        collect(eng.step(), done)
    expected = {r.request_id: run_alone(r) for r in [*short, long]}
    assert {rid: tokens for rid, (tokens, _, _) in done.items()} == expected


def test_aborting_a_request_mid_prefill_frees_its_slot_and_leaves_the_others_unchanged():
    running = [EngineRequest(f"r{i}", prompt(80 + i, length=3), sampled(80 + i, max_tokens=16))
               for i in range(2)]
    eng = engine(max_running=3, prefill_chunk=6)
    for r in running:
        eng.add(r)
    done: dict = {}
    collect(eng.step(), done)  # both prompts fit in one chunk
    eng.add(EngineRequest("long", prompt(90, length=50), sampled(90)))
    for _ in range(3):
        collect(eng.step(), done)
    held = eng.load().kv_used_tokens
    final = eng.abort("long")
    assert (final.finished, final.finish_reason, final.new_token_ids) == (True, "abort", [])
    assert eng.load().executing == 2 and eng.load().kv_used_tokens == held - 18
    late = EngineRequest("late", prompt(91, length=5), sampled(91, max_tokens=8))
    eng.add(late)  # takes the freed slot at once: 5 tokens fit in one chunk
    collect(eng.step(), done)
    assert "late" in done and eng.load().executing == 3
    while eng.has_work():
        collect(eng.step(), done)
    assert "long" not in done
    assert {rid: tokens for rid, (tokens, _, _) in done.items()} == {
        r.request_id: run_alone(r) for r in [*running, late]}
    with pytest.raises(KeyError, match="long"):
        eng.abort("long")


def test_running_requests_leaving_while_one_is_mid_prefill_keep_it_out_of_the_decode_batch():
    """Finished and aborted running requests free slots below the request mid-prefill; it must
    move down with them and still continue exactly."""
    running = [EngineRequest(f"r{i}", prompt(100 + i, length=2), sampled(100 + i, max_tokens=2 + i))
               for i in range(3)]
    long = EngineRequest("long", prompt(110, length=45), sampled(110, max_tokens=10))
    eng = engine(max_running=4, prefill_chunk=7)
    for r in [*running, long]:
        eng.add(r)
    done: dict = {}
    collect(eng.step(), done)  # 3 x 2 prompt tokens, then the long prompt's first token
    assert sorted(done) == ["r0", "r1", "r2"] and eng.load().executing == 4
    eng.abort("r2")  # the last running slot: the request mid-prefill moves down one
    del done["r2"]
    for _ in range(2):  # r0 (slot 0), then r1 finish while the long prompt is mid-prefill
        collect(eng.step(), done)
        assert "long" not in done
    assert eng.load().executing == 1
    while eng.has_work():
        collect(eng.step(), done)
    assert {rid: tokens for rid, (tokens, _, _) in done.items()} == {
        r.request_id: run_alone(r) for r in [running[0], running[1], long]}


def test_resumed_requests_chunk_prompt_plus_generated_tokens_and_continue_exactly():
    original = EngineRequest("a", prompt(120, length=13), sampled(120, max_tokens=20))
    uninterrupted = run_alone(original)
    resumed = EngineRequest("a", original.prompt_token_ids, original.sampling,
                            generated_token_ids=uninterrupted[:9])
    eng = engine(prefill_chunk=5)
    eng.add(resumed)
    steps = 0
    while not (outputs := eng.step()):
        steps += 1
    assert steps + 1 == math.ceil((13 + 9) / 5) and eng.last_step_prefill_tokens == 2
    done: dict = {}
    collect(outputs, done)
    while eng.has_work():
        collect(eng.step(), done)
    assert uninterrupted[:9] + done["a"][0] == uninterrupted


def test_negative_prefill_chunk_is_refused():
    with pytest.raises(ValueError, match="prefill_chunk must be >= 0"):
        TorchEngine("tiny", max_running=1, max_len=MAX_LEN, prefill_chunk=-1)


def test_the_worker_config_passes_prefill_chunk_to_its_engine():
    from rlharvest.services.rollout_worker.config import WorkerConfig
    from rlharvest.services.rollout_worker.main import build_engine

    assert WorkerConfig().prefill_chunk == 0
    eng = build_engine(WorkerConfig(max_running=2, max_len=MAX_LEN, prefill_chunk=4))
    eng.add(EngineRequest("a", prompt(1, length=10), sampled(1, max_tokens=2)))
    assert eng.step() == [] and eng.last_step_prefill_tokens == 4
