"""ZeRO/data-parallel shards: how many training ranks publish one version without gathering it.

Rank ``r`` of ``n`` holds elements ``[r * k, (r + 1) * k)`` of every tensor flattened, with
``k = ceil(numel / n)``; the last ranks' slices run past the end and are padded with zeros. This
is DeepSpeed ZeRO-3's own parameter partitioning (each parameter's ``ds_tensor``), so a ZeRO-3
rank publishes the partition it already holds and nobody gathers the model; at ZeRO 0-2 every
rank holds the whole model and publishes the same slice of it, which splits the serializing and
sending n ways. The agent stages the n shards (``shard_staging.py``, layout ``dp``) and joins
them once every rank has published: one copy, on the agent, off the trainer's path.

Pure: no I/O. Unlike a TP shard (``sharding.py``), a flat shard is no tensor a worker could use
on its own, so the agent stores the joined tensors and serves them like a whole publish.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from rlharvest.common.errors import InvalidArgument


class FlatShardError(InvalidArgument, ValueError):
    """Shards that cannot be joined into the tensor they claim to be; the message says why."""


def shard_len(numel: int, size: int) -> int:
    """Elements in each rank's slice of a tensor of ``numel`` elements over ``size`` ranks."""
    if size < 1:
        raise FlatShardError(f"a shard group has at least one rank, got {size}")
    return -(-numel // size)


def shard_range(numel: int, rank: int, size: int) -> tuple[int, int]:
    """[start, stop) of the real (unpadded) elements rank ``rank`` holds; may be empty."""
    if not 0 <= rank < size:
        raise FlatShardError(f"rank {rank} is not one of {size} ranks")
    k = shard_len(numel, size)
    return min(rank * k, numel), min((rank + 1) * k, numel)


def flat_shard(tensor: torch.Tensor, rank: int, size: int,
               dtype: torch.dtype | None = None) -> torch.Tensor:
    """Rank ``rank``'s slice of ``tensor``: a new 1-D CPU tensor, zero-padded to ``shard_len``,
    in ``dtype`` (None: the tensor's own; the cast rides on the one copy)."""
    flat = tensor.detach().reshape(-1)
    start, stop = shard_range(flat.numel(), rank, size)
    out = torch.empty(shard_len(flat.numel(), size), dtype=dtype or tensor.dtype)
    out[:stop - start].copy_(flat[start:stop])
    out[stop - start:].zero_()  # only the padding: one pass over the slice, not two
    return out


def flat_shards(tensors: Mapping[str, torch.Tensor], rank: int, size: int,
                dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s slice of every tensor (copies: the version stays as it was); floating
    tensors in ``dtype`` when given (the serving dtype), the others as they are."""
    return {name: flat_shard(t, rank, size, dtype if t.is_floating_point() else None)
            for name, t in tensors.items()}


def check_shard_shape(name: str, shard_shape: Sequence[int], full_shape: Sequence[int],
                      size: int) -> None:
    """A shard of ``name`` is 1-D and exactly one rank's slice long (padding included)."""
    want = (shard_len(math.prod(full_shape), size),)
    if tuple(shard_shape) != want:
        raise FlatShardError(f"the flat shard of {name} has shape {tuple(shard_shape)}, but a "
                             f"tensor of shape {tuple(full_shape)} over {size} ranks has shards "
                             f"of shape {want}")


def join_flat(name: str, parts: Sequence[torch.Tensor], full_shape: Sequence[int]) -> torch.Tensor:
    """The whole tensor from every rank's slice, in rank order (a copy); the padding is dropped."""
    numel = math.prod(full_shape)
    for part in parts:
        check_shard_shape(name, part.shape, full_shape, len(parts))
    return torch.cat([p.reshape(-1) for p in parts])[:numel].reshape(tuple(full_shape))
