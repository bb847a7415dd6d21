"""Tensor-parallel shard slicing for the Qwen3 family (ROSE §4.2 "Shard-aware Weight Transfer").

ROSE infers each parameter's sharding rule from its module type and shape, computes per-rank
slice ranges, and lets a serving rank pull only its own slice, even when training and serving use
different TP degrees. The rules are Megatron/vLLM's:

- column-parallel (output features split, dim 0): q/k/v_proj, gate/up_proj (dense and MoE
  experts), and the vocabulary-parallel embed_tokens / lm_head;
- row-parallel (input features split, dim 1): o_proj, down_proj; their biases are replicated
  because they are added once, after the all-reduce;
- replicated: every norm (RMSNorm weights, q_norm/k_norm) and the MoE router.

HF names are used, with q/k/v and gate/up unfused: vLLM fuses them itself when it loads HF names,
and a fused tensor's TP shard is not one contiguous slice of the fused tensor. Deviations: splits
must be even (vLLM pads the vocabulary instead; we refuse and say so), and when tp_size exceeds
the number of KV heads vLLM replicates k/v heads while this module would split inside a head —
callers must keep tp_size <= num_key_value_heads. Pipeline stages are not handled here.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

import torch

from rlharvest.common.errors import InvalidArgument


class ShardingError(InvalidArgument, ValueError):
    """A tensor that cannot be sharded as asked; the message says why and what to change."""


class Layout(Enum):
    COLUMN = "column"  # split on dim 0
    ROW = "row"  # split on dim 1
    REPLICATED = "replicated"


# (pattern on the full parameter name, layout). First match wins, so biases come before weights.
_RULES: tuple[tuple[re.Pattern[str], Layout], ...] = tuple(
    (re.compile(pattern), layout) for pattern, layout in (
        (r"(^|\.)(o_proj|down_proj)\.bias$", Layout.REPLICATED),
        (r"(^|\.)(o_proj|down_proj)\.weight$", Layout.ROW),
        (r"(^|\.)(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$", Layout.COLUMN),
        (r"(^|\.)(embed_tokens|lm_head)\.weight$", Layout.COLUMN),
        (r"(^|\.)[a-z_]*norm\.weight$", Layout.REPLICATED),
        (r"(^|\.)mlp\.gate\.weight$", Layout.REPLICATED),  # MoE router: every rank routes
    )
)


@dataclass(frozen=True)
class ShardRange:
    """Rank ``tp_rank``'s slice: [start, stop) along ``dim``; dim None means the whole tensor."""

    dim: int | None
    start: int
    stop: int


@dataclass(frozen=True)
class ShardPiece:
    """Rows [src_start, src_stop) of source shard ``src_rank`` (local coordinates along the split
    dim) land at [dst_start, dst_stop) of the destination shard."""

    src_rank: int
    src_start: int
    src_stop: int
    dst_start: int
    dst_stop: int


def layout_of(name: str, shape: Sequence[int]) -> Layout:
    """The TP layout of a Qwen3 parameter, checked against its rank."""
    for pattern, layout in _RULES:
        if pattern.search(name):
            needed = {Layout.COLUMN: 1, Layout.ROW: 2, Layout.REPLICATED: 0}[layout]
            if len(shape) < needed:
                raise ShardingError(f"{name} looks {layout.value}-parallel but has shape "
                                    f"{tuple(shape)}; it needs at least {needed} dims")
            return layout
    raise ShardingError(f"no tensor-parallel rule for parameter {name!r} {tuple(shape)}; it is "
                        "not a Qwen3 parameter — add a rule to sharding._RULES")


def split_dim(layout: Layout) -> int | None:
    return {Layout.COLUMN: 0, Layout.ROW: 1, Layout.REPLICATED: None}[layout]


def shard_range(name: str, shape: Sequence[int], tp_rank: int, tp_size: int) -> ShardRange:
    _check_rank(tp_rank, tp_size)
    dim = split_dim(layout_of(name, shape))
    if dim is None:
        return ShardRange(None, 0, shape[0] if shape else 1)
    size = shape[dim]
    if size % tp_size:
        raise ShardingError(f"{name} has {size} elements along dim {dim} (shape {tuple(shape)}), "
                            f"not divisible by tp_size={tp_size}; pick a tp_size dividing {size}")
    per_rank = size // tp_size
    return ShardRange(dim, tp_rank * per_rank, (tp_rank + 1) * per_rank)


def shard_slice(name: str, shape: Sequence[int], tp_rank: int,
                tp_size: int) -> tuple[slice, ...]:
    """Index that cuts rank ``tp_rank``'s shard out of the full tensor: ``full[index]``."""
    rng = shard_range(name, shape, tp_rank, tp_size)
    if rng.dim is None:
        return (slice(None),) * len(shape)
    return (slice(None),) * rng.dim + (slice(rng.start, rng.stop),)


def shard_shape(name: str, shape: Sequence[int], tp_size: int) -> tuple[int, ...]:
    rng = shard_range(name, shape, 0, tp_size)
    if rng.dim is None:
        return tuple(shape)
    return tuple(rng.stop - rng.start if d == rng.dim else n for d, n in enumerate(shape))


def take_shard(name: str, full: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """Rank ``tp_rank``'s shard as a view of ``full`` (no copy)."""
    return full[shard_slice(name, full.shape, tp_rank, tp_size)]


def full_shape(name: str, shard: Sequence[int], tp_size: int) -> tuple[int, ...]:
    """The full tensor's shape, given one shard's shape at ``tp_size``."""
    dim = split_dim(layout_of(name, shard))
    return tuple(n * tp_size if d == dim else n for d, n in enumerate(shard))


def gather_shards(name: str, shards: Sequence[torch.Tensor]) -> torch.Tensor:
    """Inverse of ``take_shard`` over all ranks: shards[r] is rank r's shard at TP len(shards)."""
    if not shards:
        raise ShardingError(f"gather_shards({name!r}) got no shards; pass one per TP rank")
    first = shards[0]
    for rank, shard in enumerate(shards):
        if shard.shape != first.shape or shard.dtype != first.dtype:
            raise ShardingError(f"{name}: shard {rank} is {shard.dtype}{tuple(shard.shape)} but "
                                f"shard 0 is {first.dtype}{tuple(first.shape)}; shards of one "
                                "tensor must match — were they taken at the same TP size?")
    dim = split_dim(layout_of(name, first.shape))
    if dim is None:
        return first.clone()
    return torch.cat(list(shards), dim=dim)


def remap_pieces(name: str, full: Sequence[int], src_tp_size: int, dst_rank: int,
                 dst_tp_size: int) -> list[ShardPiece]:
    """Which parts of which source shards (TP ``src_tp_size``) make up destination shard
    ``dst_rank`` at TP ``dst_tp_size``. A replicated tensor comes whole from source rank 0."""
    dst = shard_range(name, full, dst_rank, dst_tp_size)
    shard_range(name, full, 0, src_tp_size)  # validates divisibility for the source side
    if dst.dim is None:
        return [ShardPiece(0, 0, dst.stop, 0, dst.stop)]
    src_len = full[dst.dim] // src_tp_size
    pieces = []
    for src_rank in range(dst.start // src_len, (dst.stop - 1) // src_len + 1):
        lo = max(dst.start, src_rank * src_len)
        hi = min(dst.stop, (src_rank + 1) * src_len)
        pieces.append(ShardPiece(src_rank, lo - src_rank * src_len, hi - src_rank * src_len,
                                 lo - dst.start, hi - dst.start))
    return pieces


def reshard(name: str, source_shards: Sequence[torch.Tensor], dst_rank: int,
            dst_tp_size: int) -> torch.Tensor:
    """Destination shard ``dst_rank`` at ``dst_tp_size`` built from a training side's shards
    (source_shards[r] is training rank r's shard), without gathering the full tensor."""
    if not source_shards:
        raise ShardingError(f"reshard({name!r}) got no source shards; pass one per training rank")
    src_tp_size = len(source_shards)
    full = full_shape(name, source_shards[0].shape, src_tp_size)
    pieces = remap_pieces(name, full, src_tp_size, dst_rank, dst_tp_size)
    dim = split_dim(layout_of(name, full))
    if dim is None:
        return source_shards[0]
    parts = [source_shards[p.src_rank].narrow(dim, p.src_start, p.src_stop - p.src_start)
             for p in pieces]
    # One piece is a view of a source shard; a copy is made only when pieces must be joined.
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def _check_rank(tp_rank: int, tp_size: int) -> None:
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ShardingError(f"tp_rank={tp_rank} is not a rank of tp_size={tp_size}; "
                            "ranks run from 0 to tp_size - 1")
