"""The engine's weight store stands in for transformers' modules: the same names, shapes and
RoPE frequencies for every family, the same tensors from a saved checkpoint, the trainer's exact
preset init, precise refusals, and a worker that never imports transformers' modeling code."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LlamaConfig

from rlharvest.models.decoder_weights import (
    DecoderConfig,
    DecoderWeights,
    decoder_config,
    inv_freq,
    load_decoder,
    preset_state,
)
from rlharvest.models.tiny_model import build_model
from tests.unit.test_decoder_forward import CONFIGS, SHAPE, sharp_model


@pytest.mark.parametrize("name", list(CONFIGS))
def test_names_shapes_and_rope_frequencies_equal_transformers(name):
    reference = AutoModelForCausalLM.from_config(CONFIGS[name]())
    ours = DecoderWeights(DecoderConfig.from_dict(reference.config.to_dict()))
    theirs = reference.state_dict()
    assert {k: v.shape for k, v in ours.state_dict().items()} == \
        {k: v.shape for k, v in theirs.items()}
    torch.testing.assert_close(inv_freq(ours.config), reference.model.rotary_emb.inv_freq,
                               rtol=0, atol=0)
    assert reference.model.rotary_emb.attention_scaling == 1.0


def test_linear_rope_scaling_divides_every_frequency():
    cfg = LlamaConfig(**SHAPE, rope_parameters={"rope_type": "linear", "factor": 4.0,
                                                "rope_theta": 10000.0})
    reference = AutoModelForCausalLM.from_config(cfg)
    ours = DecoderConfig.from_dict(cfg.to_dict())
    torch.testing.assert_close(inv_freq(ours), reference.model.rotary_emb.inv_freq, rtol=0,
                               atol=0)


@pytest.mark.parametrize("name", ["qwen3", "qwen2", "llama-biases"])
def test_a_saved_checkpoint_loads_exactly_the_tensors_transformers_saved(name, tmp_path):
    model = sharp_model(name)
    model.save_pretrained(tmp_path, safe_serialization=True)
    loaded = load_decoder(str(tmp_path))
    assert loaded.config.model_type == name.split("-")[0]
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key


def test_tied_embeddings_are_one_tensor_and_a_checkpoint_may_omit_the_head(tmp_path):
    weights = load_decoder("tiny", seed=3)
    assert weights.lm_head.weight is weights.model.embed_tokens.weight
    build_model("tiny", seed=3).save_pretrained(tmp_path, safe_serialization=True)
    assert torch.equal(load_decoder(str(tmp_path)).lm_head.weight,
                       weights.model.embed_tokens.weight)


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_the_trainer_and_the_engine_start_from_the_same_preset_weights(preset):
    trainer = build_model(preset, seed=5).state_dict()
    engine = load_decoder(preset, seed=5).state_dict()
    assert trainer.keys() == engine.keys()
    assert all(torch.equal(trainer[k], engine[k]) for k in trainer)
    other = preset_state(preset, seed=6)
    assert not torch.equal(other["model.embed_tokens.weight"],
                           engine["model.embed_tokens.weight"])
    # transformers' init distribution: N(0, 0.02) matrices, unit norms, a zero padding row.
    embed = engine["model.embed_tokens.weight"]
    assert 0.015 < float(embed[1:].std()) < 0.025
    assert torch.equal(embed[decoder_config(preset).pad_token_id], torch.zeros(embed.shape[1]))
    assert all(torch.equal(v, torch.ones_like(v)) for k, v in engine.items() if "norm" in k)


def _checkpoint(tmp_path, state: dict[str, torch.Tensor]):
    build_model("tiny").config.to_json_file(tmp_path / "config.json")
    save_file({k: v.contiguous() for k, v in state.items()}, tmp_path / "model.safetensors")
    return str(tmp_path)


def test_weights_that_do_not_fit_the_config_are_refused_naming_them(tmp_path):
    state = dict(preset_state("tiny", 0))
    del state["lm_head.weight"]
    short = {k: v for k, v in state.items() if "layers.1.mlp.up_proj" not in k}
    (tmp_path / "a").mkdir()
    with pytest.raises(ValueError, match=r"missing \['model.layers.1.mlp.up_proj.weight'\]"):
        load_decoder(_checkpoint(tmp_path / "a", short))
    wrong = {**state, "model.norm.weight": torch.ones(3)}
    (tmp_path / "b").mkdir()
    with pytest.raises(ValueError, match=r"model.norm.weight has shape \(3,\)"):
        load_decoder(_checkpoint(tmp_path / "b", wrong))
    extra = {**state, "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8),
             "model.vision_tower.weight": torch.ones(2)}
    (tmp_path / "c").mkdir()
    with pytest.raises(ValueError, match=r"unexpected \['model.vision_tower.weight'\]"):
        load_decoder(_checkpoint(tmp_path / "c", extra))


def test_a_directory_without_safetensors_or_config_is_refused(tmp_path):
    with pytest.raises(ValueError, match="not a usable model directory"):
        decoder_config(str(tmp_path))
    build_model("tiny").config.to_json_file(tmp_path / "config.json")
    with pytest.raises(ValueError, match="no safetensors weights"):
        load_decoder(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    with pytest.raises(ValueError, match="lacks or garbles 'num_attention_heads'"):
        decoder_config(str(tmp_path))
    with pytest.raises(ValueError, match="neither a preset"):
        decoder_config(str(tmp_path / "nowhere"))


def test_a_rollout_engine_never_imports_transformers_modeling_code():
    probe = ("import sys\n"
             "from rlharvest.services.rollout_worker.torch_engine import TorchEngine\n"
             "TorchEngine('tiny', max_running=1, max_len=32)\n"
             "print(sorted(m for m in sys.modules if m.startswith('transformers')))\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout


@pytest.mark.parametrize("model_type, expected", [("qwen3", 128), ("qwen2", 64), ("llama", 64)])
def test_a_config_without_head_dim_takes_the_familys_default(model_type, expected):
    from transformers import AutoConfig

    raw = {"model_type": model_type, "vocab_size": 32, "hidden_size": 256,
           "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4}
    theirs = AutoConfig.for_model(**raw)
    assert (getattr(theirs, "head_dim", None) or 256 // 4) == expected  # transformers' reading
    assert DecoderConfig.from_dict(raw).head_dim == expected


# The released models' parameter counts (their model cards: Qwen3-0.6B 0.6B with tied
# embeddings, Qwen3-8B 8.2B), counted on the meta device: nothing is allocated.
@pytest.mark.parametrize("preset,params", [("qwen3-0.6b", 596_049_920),
                                           ("qwen3-8b", 8_190_735_360)])
def test_the_qwen3_shaped_presets_have_the_released_models_shapes(preset, params):
    from transformers import Qwen3Config

    from rlharvest.models.decoder_weights import preset_config_dict

    ours = DecoderWeights(decoder_config(preset), device="meta")
    assert sum(p.numel() for p in ours.parameters()) == params
    with torch.device("meta"):
        reference = AutoModelForCausalLM.from_config(Qwen3Config(**preset_config_dict(preset)))
    assert {k: v.shape for k, v in ours.state_dict().items()} == \
        {k: v.shape for k, v in reference.state_dict().items()}
    cfg = decoder_config(preset)
    assert (cfg.vocab_size, cfg.num_key_value_heads, cfg.head_dim) == (151936, 8, 128)


def test_a_preset_loaded_tensor_by_tensor_has_preset_states_values_tied_head_included():
    # load_decoder copies each generated tensor and drops it (an 8B state beside its module
    # would double the memory); the values must still be preset_state's.
    weights = load_decoder("small", seed=2, dtype=torch.bfloat16)
    state = preset_state("small", 2, torch.bfloat16)
    assert all(torch.equal(state[k], v) for k, v in weights.state_dict().items())
    assert weights.lm_head.weight is weights.model.embed_tokens.weight
