"""A Qwen3 forward pass over a slot KV cache, reading the weights of a transformers Qwen3 module.

The HF module is the weight store (``load_weights`` copies into its parameters, names as in its
state_dict); this file only computes. To keep the decode step to a few large ops, q/k/v and
gate/up projections run as one fused matmul each. Instead of keeping fused *copies* (twice the
memory, and a refresh after every weight load), the module's q/k/v and gate/up parameters are
re-pointed at row slices of one fused tensor per layer, so an in-place copy into a parameter
updates the fused weight too. The HF module keeps working unchanged on those views.

Math follows transformers' ``modeling_qwen3``: pre-norm blocks, per-head RMSNorm on q and k,
rotate-half RoPE, GQA, SwiGLU MLP, final norm, lm_head (tied or not).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from rlharvest.services.rollout_worker.kv_cache import SlotKVCache


@dataclass
class _LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor  # [(H + 2 * KVH) * head_dim, D], rows shared with q/k/v_proj.weight
    q_norm: torch.Tensor  # the module's parameters (read on refresh)
    k_norm: torch.Tensor
    qk_norm: torch.Tensor  # [H + KVH, head_dim]: q_norm for every q head, then k_norm per k head
    o: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor  # [2 * I, D], rows shared with gate_proj/up_proj.weight
    down: torch.Tensor


def _fuse_rows(linears: list[torch.nn.Linear]) -> torch.Tensor:
    """Concatenates the linears' weights and re-points each weight at its slice of the result."""
    fused = torch.cat([lin.weight.detach() for lin in linears], dim=0).contiguous()
    start = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight.data = fused[start:start + rows]
        start += rows
    return fused


def _rotate_half_matrix(head_dim: int, dtype: torch.dtype, device) -> torch.Tensor:
    """R with x @ R == cat(-x2, x1) (HF's rotate_half). One small matmul instead of a slice,
    a negation and a cat; exact, since each output is one input times +-1 plus zeros."""
    half = head_dim // 2
    rotate = torch.zeros(head_dim, head_dim, dtype=dtype, device=device)
    rotate[torch.arange(half) + half, torch.arange(half)] = -1
    rotate[torch.arange(half), torch.arange(half) + half] = 1
    return rotate


class Qwen3Forward:
    """Prefill and batched decode of a Qwen3 model over a ``SlotKVCache``.

    Call ``refresh()`` after changing the module's parameters in place (derived tensors).
    """

    def __init__(self, model: PreTrainedModel, max_len: int) -> None:
        cfg = model.config
        self._check_supported(cfg, max_len)
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.eps = cfg.rms_norm_eps
        self.num_layers = cfg.num_hidden_layers
        inner = model.model
        self.scale = inner.layers[0].self_attn.scaling
        self.embed = inner.embed_tokens.weight
        self.final_norm = inner.norm.weight
        self.lm_head = model.lm_head.weight
        self.layers = [self._layer_weights(layer) for layer in inner.layers]
        device = self.embed.device
        rotary = inner.rotary_emb
        positions = torch.arange(max_len, device=device, dtype=torch.float32)
        freqs = positions[:, None] * rotary.inv_freq.to(device=device, dtype=torch.float32)
        angles = torch.cat((freqs, freqs), dim=-1)
        dtype = self.embed.dtype
        self.cos = (angles.cos() * rotary.attention_scaling).to(dtype)  # [max_len, head_dim]
        self.sin = (angles.sin() * rotary.attention_scaling).to(dtype)
        self.key_positions = torch.arange(max_len, device=device)
        self.rotate_half = _rotate_half_matrix(self.head_dim, dtype, device)
        self.refresh()

    @staticmethod
    def _check_supported(cfg, max_len: int) -> None:
        if cfg.model_type != "qwen3":
            raise ValueError(f"TorchEngine runs Qwen3 models; got model_type {cfg.model_type!r}")
        if getattr(cfg, "use_sliding_window", False):
            raise ValueError("sliding-window attention is not supported by TorchEngine")
        if cfg.hidden_act != "silu":
            raise ValueError(f"expected a SwiGLU (silu) MLP, got hidden_act {cfg.hidden_act!r}")
        rope_type = (getattr(cfg, "rope_parameters", None) or {}).get("rope_type", "default")
        if rope_type not in ("default", "linear"):  # dynamic types rescale with the length
            raise ValueError(f"rope_type {rope_type!r} is not supported by TorchEngine")
        if max_len > cfg.max_position_embeddings:
            raise ValueError(f"max_len {max_len} exceeds the model's context "
                             f"({cfg.max_position_embeddings} positions); lower max_len")

    @staticmethod
    def _layer_weights(layer) -> _LayerWeights:
        attn, mlp = layer.self_attn, layer.mlp
        return _LayerWeights(
            input_norm=layer.input_layernorm.weight,
            qkv=_fuse_rows([attn.q_proj, attn.k_proj, attn.v_proj]),
            q_norm=attn.q_norm.weight, k_norm=attn.k_norm.weight,
            qk_norm=attn.q_norm.weight,  # placeholder until refresh()
            o=attn.o_proj.weight,
            post_norm=layer.post_attention_layernorm.weight,
            gate_up=_fuse_rows([mlp.gate_proj, mlp.up_proj]),
            down=mlp.down_proj.weight,
        )

    def refresh(self) -> None:
        for w in self.layers:
            w.qk_norm = torch.cat([w.q_norm.detach().expand(self.heads, -1),
                                   w.k_norm.detach().expand(self.kv_heads, -1)])

    # ---- shared pieces ---------------------------------------------------------------------

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, weight.shape, weight, self.eps)

    def _qkv(self, w: _LayerWeights, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """h [..., D] -> q [..., H, hd], k and v [..., KVH, hd], with q/k normed and rotated."""
        qkv = F.linear(h, w.qkv).unflatten(-1, (self.heads + 2 * self.kv_heads, self.head_dim))
        qk = F.rms_norm(qkv[..., :self.heads + self.kv_heads, :], (self.head_dim,), eps=self.eps)
        qk = qk * w.qk_norm
        qk = qk * cos + (qk @ self.rotate_half) * sin  # RoPE
        v = qkv[..., self.heads + self.kv_heads:, :]
        return qk[..., :self.heads, :], qk[..., self.heads:, :], v

    def _mlp(self, w: _LayerWeights, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(self._norm(x, w.post_norm), w.gate_up).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, w.down)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self._norm(x, self.final_norm), self.lm_head)

    # ---- prefill ---------------------------------------------------------------------------

    def prefill(self, token_ids: torch.Tensor, lengths: list[int], cache: SlotKVCache,
                first_slot: int) -> torch.Tensor:
        """Runs whole sequences (right-padded to one length) into slots first_slot.. and
        returns the logits at each sequence's last real token, [N, V].

        Right padding needs no padding mask: a real query at position i only attends to keys
        <= i, which are all real. The padded tail's keys land in the cache beyond the slot's
        length, where decode masks them and later tokens overwrite them.
        """
        count, seq = token_ids.shape
        slots = slice(first_slot, first_slot + count)
        cos, sin = self.cos[:seq, None, :], self.sin[:seq, None, :]
        x = F.embedding(token_ids, self.embed)
        for layer, w in enumerate(self.layers):
            q, k, v = self._qkv(w, self._norm(x, w.input_norm), cos, sin)
            k, v = k.transpose(1, 2), v.transpose(1, 2)  # [N, KVH, T, hd]
            cache.k[layer, slots, :, :seq] = k
            cache.v[layer, slots, :, :seq] = v
            attn = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, is_causal=True,
                                                  scale=self.scale, enable_gqa=True)
            x = x + F.linear(attn.transpose(1, 2).flatten(2), w.o)
            x = x + self._mlp(w, x)
        for i, length in enumerate(lengths):
            cache.set_length(first_slot + i, length)
        last = torch.tensor(lengths, device=x.device) - 1
        return self._logits(x[torch.arange(count, device=x.device), last])

    # ---- decode ----------------------------------------------------------------------------

    def decode(self, token_ids: torch.Tensor, cache: SlotKVCache) -> torch.Tensor:
        """Feeds one token to each of the first ``len(token_ids)`` slots; returns logits [n, V].

        Decode attention groups the query heads that share a KV head as that head's "query
        positions" ([n, KVH, H/KVH, hd] against [n, KVH, L, hd]): exact GQA without repeating K/V.
        """
        count = token_ids.shape[0]
        positions = cache.lengths[:count]
        longest = max(cache.host_lengths[:count]) + 1
        rows = torch.arange(count, device=token_ids.device)
        visible = self.key_positions[:longest][None, :] <= positions[:, None]
        mask = visible[:, None, None, :]
        cos, sin = self.cos[positions][:, None, :], self.sin[positions][:, None, :]
        x = F.embedding(token_ids, self.embed)
        group = self.heads // self.kv_heads
        for layer, w in enumerate(self.layers):
            q, k, v = self._qkv(w, self._norm(x, w.input_norm), cos, sin)
            cache_k, cache_v = cache.k[layer], cache.v[layer]
            cache_k[rows, :, positions] = k
            cache_v[rows, :, positions] = v
            attn = F.scaled_dot_product_attention(
                q.unflatten(1, (self.kv_heads, group)), cache_k[:count, :, :longest],
                cache_v[:count, :, :longest], attn_mask=mask, scale=self.scale)
            x = x + F.linear(attn.flatten(1), w.o)
            x = x + self._mlp(w, x)
        cache.advance(count)
        return self._logits(x)
