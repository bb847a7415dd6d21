"""The rollout engine's weights: Qwen3, Qwen2 and Llama causal LMs as a plain module tree with
transformers' state_dict names, loaded without importing transformers' modeling code.

Why: a rollout worker computes its own forward (``decoder_forward.py``) and needs the weights
only; importing transformers' modeling modules costs ~3 s of CPU in every worker process
(torch._dynamo, masking utilities), paid again by every spot replacement before it serves.

Names, shapes and biases follow ``modeling_qwen3`` / ``modeling_qwen2`` / ``modeling_llama``
(tests/unit/test_decoder_weights.py checks them against transformers for every family). Seeded
presets take their values from ``preset_state``, which the trainer loads into its transformers
module too (``tiny_model.build_model``), so weight version 0 is the same on both sides by
construction rather than by two inits agreeing.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rlharvest.models.model_presets import PRESETS
from rlharvest.models.tokenizer import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen2", "llama")
# RoPE types whose frequencies are fixed at load time (their attention scaling is 1).
STATIC_ROPE = ("default", "linear", "llama3")
# The presets' shared config: a Qwen3 on the built-in tokenizer (``tiny_model.tiny_config``
# hands the same to transformers).
PRESET_CONFIG: dict[str, Any] = dict(
    model_type="qwen3", vocab_size=VOCAB_SIZE, max_position_embeddings=1024, rms_norm_eps=1e-6,
    rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
    pad_token_id=PAD_ID, initializer_range=0.02)
# Buffers some older checkpoints saved; transformers recomputes them and so does this module.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class DecoderConfig:
    """What the engine reads of a model's config.json; absent keys take transformers' defaults
    for the family."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    hidden_act: str
    use_sliding_window: bool
    attention_bias: bool  # q/k/v and o_proj (Qwen3, Llama); Qwen2 has q/k/v biases always
    mlp_bias: bool  # Llama only
    rope: dict[str, Any] = field(default_factory=dict)  # rope_type, rope_theta, scaling keys
    pad_token_id: int | None = None
    initializer_range: float = 0.02

    @property
    def qkv_bias(self) -> bool:
        return self.model_type == "qwen2" or self.attention_bias

    @property
    def o_bias(self) -> bool:
        return self.model_type != "qwen2" and self.attention_bias

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> DecoderConfig:
        model_type = str(d.get("model_type", ""))
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"TorchEngine runs the {', '.join(SUPPORTED_MODEL_TYPES)} "
                             f"families; got model_type {model_type!r}")
        heads = int(d["num_attention_heads"])
        rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
        rope["rope_type"] = rope.get("rope_type", rope.get("type", "default"))
        rope["rope_theta"] = float(rope.get("rope_theta") or d.get("rope_theta") or 10000.0)
        return cls(
            model_type=model_type, vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]), intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]), num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or _default_head_dim(d, model_type, heads)),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(d.get("max_position_embeddings",
                                              2048 if model_type == "llama" else 32768)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            hidden_act=str(d.get("hidden_act", "silu")),
            use_sliding_window=bool(d.get("use_sliding_window", False)),
            attention_bias=bool(d.get("attention_bias", False)),
            mlp_bias=model_type == "llama" and bool(d.get("mlp_bias", False)),
            rope=rope, pad_token_id=d.get("pad_token_id"),
            initializer_range=float(d.get("initializer_range", 0.02)),
        )


def _default_head_dim(d: Mapping[str, Any], model_type: str, heads: int) -> int:
    """transformers' default when config.json omits head_dim: Qwen3Config's 128; Qwen2 and
    Llama derive it from the hidden size."""
    if model_type == "qwen3" and "head_dim" not in d:
        return 128
    return int(d["hidden_size"]) // heads


def preset_config_dict(preset: str) -> dict[str, Any]:
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; choose one of {sorted(PRESETS)}")
    return {**PRESET_CONFIG, **PRESETS[preset]}


def decoder_config(model: str) -> DecoderConfig:
    """The config of a preset or a local checkpoint directory, without loading weights."""
    if model in PRESETS:
        return DecoderConfig.from_dict(preset_config_dict(model))
    path = Path(model)
    if not path.is_dir():
        raise ValueError(f"model {model!r} is neither a preset ({sorted(PRESETS)}) nor a local "
                         "checkpoint directory; rlharvest never downloads weights")
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{model} is not a usable model directory (config.json): "
                         f"{exc}") from exc
    try:
        return DecoderConfig.from_dict(raw)
    except (KeyError, TypeError) as exc:
        raise ValueError(f"{model}/config.json lacks or garbles {exc}") from exc


def inv_freq(cfg: DecoderConfig) -> torch.Tensor:
    """RoPE's inverse frequencies (float32) for the static rope types, as transformers'
    ``ROPE_INIT_FUNCTIONS`` compute them; refused types raise ValueError."""
    rope = cfg.rope
    kind = rope["rope_type"]
    if kind not in STATIC_ROPE:
        raise ValueError(f"rope_type {kind!r} is not supported by TorchEngine (supported: "
                         f"{', '.join(STATIC_ROPE)})")
    if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial rotary embeddings are not supported by TorchEngine")
    dim = cfg.head_dim
    base = rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    freq = 1.0 / base
    if kind == "linear":
        return freq / float(rope["factor"])
    if kind == "llama3":
        return _llama3_scaled(freq, rope)
    return freq


def _llama3_scaled(freq: torch.Tensor, rope: Mapping[str, Any]) -> torch.Tensor:
    """Llama 3.1's frequency-dependent scaling: long wavelengths divided by ``factor``, short
    ones kept, a smooth blend between."""
    factor = float(rope["factor"])
    low, high = float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
    old_context = float(rope["original_max_position_embeddings"])
    wavelen = 2 * math.pi / freq
    scaled = torch.where(wavelen > old_context / low, freq / factor, freq)
    smooth = (old_context / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_context / high) & ~(wavelen > old_context / low)
    return torch.where(medium, blended, scaled)


class _Weights(nn.Module):
    """Uninitialized parameters, allocated where the module is built: no init pass over weights
    that are about to be overwritten (nn.Linear's costs seconds on a real model, and on the
    meta device it imports ~900 modules)."""

    weight: nn.Parameter
    bias: nn.Parameter | None

    def __init__(self, shapes: dict[str, tuple[int, ...] | None], dtype: torch.dtype,
                 device: str | torch.device) -> None:
        super().__init__()
        for name, shape in shapes.items():
            self.register_parameter(name, None if shape is None else nn.Parameter(
                torch.empty(shape, dtype=dtype, device=device), requires_grad=False))


_Where = tuple[torch.dtype, "str | torch.device"]


def _linear(d_in: int, d_out: int, bias: bool, where: _Where) -> _Weights:
    return _Weights({"weight": (d_out, d_in), "bias": (d_out,) if bias else None}, *where)


def _norm(dim: int, where: _Where) -> _Weights:
    return _Weights({"weight": (dim,)}, *where)


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig, where: _Where) -> None:
        super().__init__()
        q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        self.q_proj = _linear(cfg.hidden_size, q, cfg.qkv_bias, where)
        self.k_proj = _linear(cfg.hidden_size, kv, cfg.qkv_bias, where)
        self.v_proj = _linear(cfg.hidden_size, kv, cfg.qkv_bias, where)
        self.o_proj = _linear(q, cfg.hidden_size, cfg.o_bias, where)
        if cfg.model_type == "qwen3":  # per-head RMSNorm on q and k
            self.q_norm = _norm(cfg.head_dim, where)
            self.k_norm = _norm(cfg.head_dim, where)


class MLP(nn.Module):
    def __init__(self, cfg: DecoderConfig, where: _Where) -> None:
        super().__init__()
        d, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = _linear(d, i, cfg.mlp_bias, where)
        self.up_proj = _linear(d, i, cfg.mlp_bias, where)
        self.down_proj = _linear(i, d, cfg.mlp_bias, where)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig, where: _Where) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, where)
        self.mlp = MLP(cfg, where)
        self.input_layernorm = _norm(cfg.hidden_size, where)
        self.post_attention_layernorm = _norm(cfg.hidden_size, where)


class DecoderModel(nn.Module):
    def __init__(self, cfg: DecoderConfig, where: _Where) -> None:
        super().__init__()
        self.embed_tokens = _Weights({"weight": (cfg.vocab_size, cfg.hidden_size)}, *where)
        self.layers = nn.ModuleList(DecoderLayer(cfg, where) for _ in range(cfg.num_hidden_layers))
        self.norm = _norm(cfg.hidden_size, where)


class DecoderWeights(nn.Module):
    """The weights of a causal LM under transformers' names (``model.layers.0.self_attn.
    q_proj.weight``, ``lm_head.weight``), uninitialized until loaded; tied embeddings are one
    parameter, as there."""

    def __init__(self, cfg: DecoderConfig, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu") -> None:
        super().__init__()
        where: _Where = (dtype, device)
        self.config = cfg
        self.model = DecoderModel(cfg, where)
        self.lm_head = _linear(cfg.hidden_size, cfg.vocab_size, False, where)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight


def preset_state(preset: str, seed: int, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """A preset's seeded initial weights, by state_dict name: transformers' init distribution
    (linear and embedding weights N(0, initializer_range), biases 0, norms 1, the padding
    token's embedding 0) from one generator, in state_dict order. Tied names share a tensor.

    The generator is ``device``'s: the values are a function of (preset, seed, device type).
    Why not always the CPU's: the 8B preset's 8 billion draws take a CPU generator over a minute
    per process, a GPU's a fraction of a second. So version 0 agrees between a trainer and a
    worker on the same device type (the tests' CPU pairs); a GPU worker beside a CPU trainer
    must start from a checkpoint or the trainer's first published version."""
    return dict(_preset_values(preset, seed, dtype, device))


def _preset_values(preset: str, seed: int, dtype: torch.dtype, device: str | torch.device
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """``preset_state``'s (name, tensor) pairs one at a time, so a loader can copy each and let
    it go (an 8B model's state beside its module would double the memory it needs)."""
    cfg = decoder_config(preset)
    shapes = DecoderWeights(cfg, torch.float32, "meta").state_dict()
    gen = torch.Generator(device=torch.device(device)).manual_seed(seed)
    embedding: torch.Tensor | None = None
    for name, like in shapes.items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            assert embedding is not None  # state_dict order: the embedding comes first
            yield name, embedding
            continue
        if name.endswith("norm.weight"):
            value = torch.ones(like.shape, device=device)
        elif name.endswith(".bias"):
            value = torch.zeros(like.shape, device=device)
        else:
            value = torch.normal(0.0, cfg.initializer_range, like.shape, generator=gen,
                                 device=device)
        if name == "model.embed_tokens.weight" and cfg.pad_token_id is not None:
            value[cfg.pad_token_id] = 0
        value = value.to(dtype)
        if name == "model.embed_tokens.weight" and cfg.tie_word_embeddings:
            embedding = value  # the head's too: kept until the head's turn, only when tied
        yield name, value


def _checkpoint_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise ValueError(f"{path} holds no safetensors weights (model.safetensors or "
                         "model.safetensors.index.json); save the checkpoint with "
                         "safe_serialization=True")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        tensors.update(load_file(path / name))
    return tensors


def load_decoder(model: str, seed: int = 0, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu") -> DecoderWeights:
    """A preset's seeded weights or a local checkpoint's, in ``dtype`` on ``device``."""
    cfg = decoder_config(model)
    net = DecoderWeights(cfg, dtype, device)
    if model in PRESETS:  # the right names and shapes by construction
        live = net.state_dict(keep_vars=True)
        with torch.no_grad():
            for name, value in _preset_values(model, seed, dtype, device):
                live[name].copy_(value)
        return net
    state = _checkpoint_tensors(Path(model))
    names = net.state_dict(keep_vars=True)
    # Tied: the head is the embedding's tensor, and the embedding's values win (as in
    # transformers), so the head is neither required nor copied.
    targets = {name: tensor for name, tensor in names.items()
               if not (cfg.tie_word_embeddings and name == "lm_head.weight")}
    missing = [name for name in targets if name not in state]
    unexpected = [name for name in state if name not in names
                  and not name.endswith(_IGNORED_SUFFIXES)]
    if missing or unexpected:
        raise ValueError(f"{model}: the weights do not fit a {cfg.model_type} of this config: "
                         f"missing {missing[:5]}, unexpected {unexpected[:5]}")
    with torch.no_grad():
        for name, target in targets.items():
            if state[name].shape != target.shape:
                raise ValueError(f"{model}: {name} has shape {tuple(state[name].shape)}, "
                                 f"the config says {tuple(target.shape)}")
            target.copy_(state[name])
    return net
