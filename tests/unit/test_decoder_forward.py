"""The torch engine on each supported family (Qwen3, Qwen2, Llama): the forward equals
transformers' own, and continuous batching and exact resume hold for every family, from a
checkpoint directory saved with ``save_pretrained`` (the path a user's checkpoint takes)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from rlharvest.models.decoder_weights import DecoderConfig
from rlharvest.common.engine_types import EngineRequest, SamplingParams
from rlharvest.services.rollout_worker.decoder_forward import DecoderForward, check_servable
from rlharvest.services.rollout_worker.kv_cache import SlotKVCache
from rlharvest.services.rollout_worker.torch_engine import TorchEngine
from tests.builders import decoder_of, drain_tokens

VOCAB = 320
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
             rms_norm_eps=1e-6, tie_word_embeddings=False)
CONFIGS = {
    "qwen3": lambda: Qwen3Config(**SHAPE, head_dim=16),
    "qwen3-bias": lambda: Qwen3Config(**SHAPE, head_dim=16, attention_bias=True),
    "qwen2": lambda: Qwen2Config(**SHAPE),  # q/k/v biases, head_dim derived
    "llama": lambda: LlamaConfig(**SHAPE),
    "llama-biases": lambda: LlamaConfig(**SHAPE, attention_bias=True, mlp_bias=True),
    "llama3-rope": lambda: LlamaConfig(**SHAPE, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
}


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def sharp_model(name: str):
    """A seeded model whose matrices are scaled up, so greedy and sampled tokens vary."""
    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_config(CONFIGS[name](), dtype=torch.float32).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(3.0 if param.dim() == 2 else 1.0)
            if param.dim() == 1 and "norm" not in "".join(n for n, p in model.named_parameters()
                                                          if p is param):
                param.normal_(0, 0.5)  # biases: nonzero, so a forgotten one shows
    return model.requires_grad_(False)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("families")
    paths = {}
    for name in ("qwen3", "qwen2", "llama-biases"):
        sharp_model(name).save_pretrained(root / name, safe_serialization=True)
        paths[name] = str(root / name)
    return paths


@pytest.mark.parametrize("name", list(CONFIGS))
def test_prefill_and_decode_equal_the_transformers_forward(name):
    model = sharp_model(name)
    cfg = model.config
    forward = DecoderForward(decoder_of(model), max_len=64)
    cache = SlotKVCache(cfg.num_hidden_layers, 2, cfg.num_key_value_heads, 64, forward.head_dim,
                        torch.float32, "cpu")
    seqs = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        reference = model(seqs).logits
        cache.acquire(), cache.acquire()
        prefill = forward.prefill(seqs[:, :20], [20, 14], cache, first_slot=0)
        torch.testing.assert_close(prefill, reference[[0, 1], [19, 13]], atol=1e-4, rtol=1e-4)
        positions = [20, 14]
        for _ in range(12):  # decode well past the prefill: positions and RoPE per row
            fed = torch.stack([seqs[0, positions[0]], seqs[1, positions[1]]])
            logits = forward.decode(fed, cache)
            torch.testing.assert_close(logits, reference[[0, 1], positions], atol=1e-4, rtol=1e-4)
            positions = [p + 1 for p in positions]


def request(rid: str, seed: int, generated: list[int] | None = None) -> EngineRequest:
    prompt = [(seed * 37 + i * 11) % VOCAB for i in range(9)]
    return EngineRequest(rid, prompt, SamplingParams(temperature=1.0, top_p=0.95, max_tokens=20,
                                                     seed=seed), list(generated or []))


@pytest.mark.parametrize("name", ["qwen3", "qwen2", "llama-biases"])
def test_batching_and_resume_from_a_checkpoint_directory_keep_every_token(checkpoints, name):
    alone = {}
    for seed in range(4):
        eng = TorchEngine(checkpoints[name], max_running=4, max_len=64)
        eng.add(request(f"r{seed}", seed))
        alone.update(drain_tokens(eng))
    assert len({tuple(t) for t in alone.values()}) == 4, "completions should differ by seed"
    # Continuous batching: two start, two join after three steps; each equals its run alone.
    batched = TorchEngine(checkpoints[name], max_running=4, max_len=64)
    batched.add(request("r0", 0)), batched.add(request("r1", 1))
    got: dict[str, list[int]] = {}
    for _ in range(3):
        for out in batched.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
    batched.add(request("r2", 2)), batched.add(request("r3", 3))
    for rid, tokens in drain_tokens(batched).items():
        got.setdefault(rid, []).extend(tokens)
    assert got == alone
    # Resume: a fresh engine given the first 7 tokens continues with the uninterrupted rest.
    resumed = TorchEngine(checkpoints[name], max_running=4, max_len=64)
    resumed.add(request("r1", 1, alone["r1"][:7]))
    assert alone["r1"][:7] + drain_tokens(resumed)["r1"] == alone["r1"]


def test_a_weight_load_reaches_the_fused_biases(checkpoints):
    eng = TorchEngine(checkpoints["qwen2"], max_running=2, max_len=64)
    before = drain_one(eng, "a")
    zeroed = {name: torch.zeros_like(value) for name, value in
              AutoModelForCausalLM.from_pretrained(checkpoints["qwen2"]).state_dict().items()
              if name.endswith("k_proj.bias") or name.endswith("v_proj.bias")}
    eng.load_weights(zeroed, 1)
    after = drain_one(eng, "b")
    reference = AutoModelForCausalLM.from_pretrained(checkpoints["qwen2"])
    reference.load_state_dict(zeroed, strict=False)
    fresh = TorchEngine(checkpoints["qwen2"], max_running=2, max_len=64)
    fresh.load_weights(reference.state_dict(), 1)
    assert after != before and after == drain_one(fresh, "c")


def drain_one(engine: TorchEngine, rid: str) -> list[int]:
    engine.add(request(rid, 5))
    return drain_tokens(engine)[rid]


@pytest.mark.parametrize("config, message", [
    (lambda: Qwen2Config(**SHAPE, use_sliding_window=True), "sliding-window"),
    (lambda: LlamaConfig(**SHAPE, hidden_act="gelu"), "silu"),
    (lambda: LlamaConfig(**SHAPE, rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                   "rope_theta": 10000.0}), "'dynamic'"),
])
def test_unsupported_variants_are_refused_naming_what(config, message):
    with pytest.raises(ValueError, match=message):
        check_servable(DecoderConfig.from_dict(config().to_dict()), 64)


def test_another_family_is_refused_with_the_supported_list():
    from transformers import GPT2Config

    config = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)
    with pytest.raises(ValueError, match="qwen3, qwen2, llama families; got model_type 'gpt2'"):
        DecoderConfig.from_dict(config.to_dict())
