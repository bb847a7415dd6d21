"""A decoder forward pass (Qwen3, Qwen2, Llama) over a slot KV cache, reading the weights of a
``DecoderWeights`` module (transformers' names and shapes, without its modeling code).

The module is the weight store (``load_weights`` copies into its parameters, names as in its
state_dict); this file only computes. To keep the decode step to a few large ops, q/k/v and
gate/up projections run as one fused matmul each. Instead of keeping fused *copies* (twice the
memory, and a refresh after every weight load), the module's q/k/v and gate/up parameters are
re-pointed at row slices of one fused tensor per layer, so an in-place copy into a parameter
updates the fused weight too.

Math follows transformers' ``modeling_qwen3`` / ``modeling_qwen2`` / ``modeling_llama``: pre-norm
blocks, rotate-half RoPE, GQA, SwiGLU MLP, final norm, lm_head (tied or not). The three families
differ only in parts each layer either has or not, so they are read from the module rather than
written per family: per-head RMSNorm on q and k (Qwen3), q/k/v biases (Qwen2; Llama and Qwen3 with
``attention_bias``), an o_proj bias (Llama ``attention_bias``), MLP biases (Llama ``mlp_bias``).
RoPE frequencies come from ``decoder_weights.inv_freq`` (static scalings: linear, llama3);
scalings that depend on the sequence length are refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rlharvest.models.decoder_weights import DecoderConfig, DecoderWeights, inv_freq
from rlharvest.services.rollout_worker.kv_cache import KVCache


@dataclass
class _LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor  # [(H + 2 * KVH) * head_dim, D], rows shared with q/k/v_proj.weight
    qkv_bias: torch.Tensor | None  # shared with q/k/v_proj.bias, when the family has them
    q_norm: torch.Tensor | None  # the module's parameters (read on refresh); Qwen3 only
    k_norm: torch.Tensor | None
    qk_norm: torch.Tensor | None  # [H + KVH, head_dim]: q_norm per q head, then k_norm per k head
    o: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: torch.Tensor  # [2 * I, D], rows shared with gate_proj/up_proj.weight
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None


def _fuse(linears: list[torch.nn.Module], attr: str) -> torch.Tensor:
    """Concatenates the linears' ``attr`` (weight or bias) and re-points each at its slice."""
    fused = torch.cat([getattr(lin, attr).detach() for lin in linears], dim=0).contiguous()
    start = 0
    for lin in linears:
        rows = getattr(lin, attr).shape[0]
        getattr(lin, attr).data = fused[start:start + rows]
        start += rows
    return fused


def _fuse_bias(linears: list[torch.nn.Module]) -> torch.Tensor | None:
    present = [lin.bias is not None for lin in linears]
    if not any(present):
        return None
    if not all(present):
        raise ValueError("some of the fused projections have a bias and some not; unsupported")
    return _fuse(linears, "bias")


def _rotate_half_matrix(head_dim: int, dtype: torch.dtype, device) -> torch.Tensor:
    """R with x @ R == cat(-x2, x1) (HF's rotate_half). One small matmul instead of a slice,
    a negation and a cat; exact, since each output is one input times +-1 plus zeros."""
    half = head_dim // 2
    rotate = torch.zeros(head_dim, head_dim, dtype=dtype, device=device)
    rotate[torch.arange(half) + half, torch.arange(half)] = -1
    rotate[torch.arange(half), torch.arange(half) + half] = 1
    return rotate


def check_servable(cfg: DecoderConfig, max_len: int) -> None:
    """ValueError naming what TorchEngine cannot serve in this model config (read before any
    weights load, so `rlharvest train` can refuse a model in a second)."""
    # The family itself was checked when the config was read (DecoderConfig.from_dict).
    if cfg.use_sliding_window:
        raise ValueError("sliding-window attention (use_sliding_window) is not supported by "
                         "TorchEngine")
    if cfg.hidden_act != "silu":
        raise ValueError(f"expected a SwiGLU (silu) MLP, got hidden_act {cfg.hidden_act!r}")
    inv_freq(cfg)  # refuses the rope types that rescale with the length
    if max_len > cfg.max_position_embeddings:
        raise ValueError(f"max_len {max_len} exceeds the model's context "
                         f"({cfg.max_position_embeddings} positions); lower max_len")


class DecoderForward:
    """Prefill and batched decode of a Qwen3, Qwen2 or Llama model over a ``KVCache`` (slots
    or pages).

    Call ``refresh()`` after changing the module's parameters in place (derived tensors).
    """

    def __init__(self, model: DecoderWeights, max_len: int) -> None:
        cfg = model.config
        check_servable(cfg, max_len)
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.eps = cfg.rms_norm_eps
        self.num_layers = cfg.num_hidden_layers
        inner = model.model
        self.scale = self.head_dim ** -0.5
        self.embed = inner.embed_tokens.weight
        self.final_norm = inner.norm.weight
        self.lm_head = model.lm_head.weight
        self.layers = [self._layer_weights(layer) for layer in inner.layers]
        device = self.embed.device
        if device.type == "cuda":
            # cuDNN's SDPA builds a graph for every new shape, and decode's key length grows
            # every step: measured on an H200 (tools/gpu_profile.py), 2 ms of host time per call,
            # 65% of an 8B decode step. The flash / memory-efficient kernels have no such cost.
            torch.backends.cuda.enable_cudnn_sdp(False)
        positions = torch.arange(max_len, device=device, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq(cfg).to(device)
        angles = torch.cat((freqs, freqs), dim=-1)
        dtype = self.embed.dtype
        self.cos = angles.cos().to(dtype)  # [max_len, head_dim]; static ropes scale by 1
        self.sin = angles.sin().to(dtype)
        self.key_positions = torch.arange(max_len, device=device)
        self.rotate_half = _rotate_half_matrix(self.head_dim, dtype, device)
        self.refresh()

    @staticmethod
    def _layer_weights(layer) -> _LayerWeights:
        attn, mlp = layer.self_attn, layer.mlp
        qkv, gate_up = [attn.q_proj, attn.k_proj, attn.v_proj], [mlp.gate_proj, mlp.up_proj]
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        return _LayerWeights(
            input_norm=layer.input_layernorm.weight,
            qkv_bias=_fuse_bias(qkv), qkv=_fuse(qkv, "weight"),
            q_norm=None if q_norm is None else q_norm.weight,
            k_norm=None if k_norm is None else k_norm.weight,
            qk_norm=None,  # set by refresh()
            o=attn.o_proj.weight, o_bias=attn.o_proj.bias,
            post_norm=layer.post_attention_layernorm.weight,
            gate_up_bias=_fuse_bias(gate_up), gate_up=_fuse(gate_up, "weight"),
            down=mlp.down_proj.weight, down_bias=mlp.down_proj.bias,
        )

    def refresh(self) -> None:
        for w in self.layers:
            if w.q_norm is not None and w.k_norm is not None:
                w.qk_norm = torch.cat([w.q_norm.detach().expand(self.heads, -1),
                                       w.k_norm.detach().expand(self.kv_heads, -1)])

    # ---- shared pieces ---------------------------------------------------------------------

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, weight.shape, weight, self.eps)

    def _qkv(self, w: _LayerWeights, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """h [..., D] -> q [..., H, hd], k and v [..., KVH, hd], with q/k normed and rotated."""
        qkv = F.linear(h, w.qkv, w.qkv_bias).unflatten(
            -1, (self.heads + 2 * self.kv_heads, self.head_dim))
        qk = qkv[..., :self.heads + self.kv_heads, :]
        if w.qk_norm is not None:  # Qwen3's per-head RMSNorm, before RoPE
            qk = F.rms_norm(qk, (self.head_dim,), eps=self.eps) * w.qk_norm
        qk = qk * cos + (qk @ self.rotate_half) * sin  # RoPE
        v = qkv[..., self.heads + self.kv_heads:, :]
        return qk[..., :self.heads, :], qk[..., self.heads:, :], v

    def _mlp(self, w: _LayerWeights, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(self._norm(x, w.post_norm), w.gate_up, w.gate_up_bias).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, w.down, w.down_bias)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self._norm(x, self.final_norm), self.lm_head)

    # ---- prefill ---------------------------------------------------------------------------

    def prefill(self, token_ids: torch.Tensor, lengths: list[int], cache: KVCache,
                first_slot: int) -> torch.Tensor:
        """Runs whole sequences (right-padded to one length) into slots first_slot.. and
        returns the logits at each sequence's last real token, [N, V].

        Right padding needs no padding mask: a real query at position i only attends to keys
        <= i, which are all real. The padded tail's keys land in the cache beyond the slot's
        length, where decode masks them and later tokens overwrite them.
        """
        count, seq = token_ids.shape
        cos, sin = self.cos[:seq, None, :], self.sin[:seq, None, :]
        x = F.embedding(token_ids, self.embed)
        for layer, w in enumerate(self.layers):
            q, k, v = self._qkv(w, self._norm(x, w.input_norm), cos, sin)
            k, v = k.transpose(1, 2), v.transpose(1, 2)  # [N, KVH, T, hd]
            cache.store_prefill(layer, first_slot, k, v, lengths)
            attn = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, is_causal=True,
                                                  scale=self.scale, enable_gqa=True)
            x = x + F.linear(attn.transpose(1, 2).flatten(2), w.o, w.o_bias)
            x = x + self._mlp(w, x)
        for i, length in enumerate(lengths):
            cache.set_length(first_slot + i, length)
        last = torch.tensor(lengths, device=x.device) - 1
        return self._logits(x[torch.arange(count, device=x.device), last])

    def prefill_from(self, token_ids: torch.Tensor, cache: KVCache, slot: int,
                     start: int) -> torch.Tensor:
        """Runs one sequence's tokens at positions [start, start + T) into ``slot``, whose cache
        already holds positions [0, start) (a chunked prefill's next chunk), and returns the
        logits at the last of them, [1, V].

        A chunk's queries attend to the slot's cached keys plus causally within the chunk. With
        start == 0 that is the whole-prompt path above (its causal kernel), so a first chunk
        runs exactly as an unchunked prefill of the same tokens.
        """
        seq = token_ids.shape[0]
        if start == 0:
            return self.prefill(token_ids[None], [seq], cache, slot)
        end = start + seq
        cos, sin = self.cos[start:end, None, :], self.sin[start:end, None, :]
        # Query at position start + i sees keys 0 .. start + i. SDPA's is_causal aligns the
        # diagonal top-left (query i sees keys <= i) when there are more keys than queries, so the
        # mask is explicit.
        query_positions = self.key_positions[start:end]
        mask = self.key_positions[:end][None, :] <= query_positions[:, None]  # [T, end]
        x = F.embedding(token_ids[None], self.embed)
        for layer, w in enumerate(self.layers):
            q, k, v = self._qkv(w, self._norm(x, w.input_norm), cos, sin)
            cache.store_chunk(layer, slot, start, k[0].transpose(0, 1), v[0].transpose(0, 1))
            keys, values = cache.window(layer, slot, 1, end)  # [1, KVH, end, hd]
            attn = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values,
                                                  attn_mask=mask, scale=self.scale,
                                                  enable_gqa=True)
            x = x + F.linear(attn.transpose(1, 2).flatten(2), w.o, w.o_bias)
            x = x + self._mlp(w, x)
        cache.set_length(slot, end)
        return self._logits(x[:, -1])

    # ---- decode ----------------------------------------------------------------------------

    def decode(self, token_ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Feeds one token to each of the first ``len(token_ids)`` slots; returns logits [n, V].

        Decode attention groups the query heads that share a KV head as that head's "query
        positions" ([n, KVH, H/KVH, hd] against [n, KVH, L, hd]): exact GQA without repeating K/V.
        """
        count = token_ids.shape[0]
        positions = cache.lengths[:count]
        longest = max(cache.host_lengths[:count]) + 1
        visible = self.key_positions[:longest][None, :] <= positions[:, None]
        mask = visible[:, None, None, :]
        cos, sin = self.cos[positions][:, None, :], self.sin[positions][:, None, :]
        x = F.embedding(token_ids, self.embed)
        group = self.heads // self.kv_heads
        for layer, w in enumerate(self.layers):
            q, k, v = self._qkv(w, self._norm(x, w.input_norm), cos, sin)
            cache.store_tokens(layer, positions, k, v)
            keys, values = cache.window(layer, 0, count, longest)
            attn = F.scaled_dot_product_attention(
                q.unflatten(1, (self.kv_heads, group)), keys, values, attn_mask=mask,
                scale=self.scale)
            x = x + F.linear(attn.flatten(1), w.o, w.o_bias)
            x = x + self._mlp(w, x)
        cache.advance(count)
        return self._logits(x)
