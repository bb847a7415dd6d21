"""Flat ZeRO/DP shards (flat_shards.py): the slicing is DeepSpeed ZeRO-3's, and joining undoes it."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from rlharvest.services.transfer_agent.flat_shards import (
    FlatShardError,
    flat_shard,
    join_flat,
    shard_len,
    shard_range,
)


@settings(max_examples=200, deadline=None)
@given(shape=st.lists(st.integers(0, 7), min_size=0, max_size=3), size=st.integers(1, 9))
def test_every_rank_slice_joined_in_rank_order_is_the_tensor(shape, size):
    tensor = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    parts = [flat_shard(tensor, rank, size) for rank in range(size)]
    assert all(p.shape == (shard_len(tensor.numel(), size),) for p in parts)
    assert torch.equal(join_flat("w", parts, shape), tensor)
    covered = [i for rank in range(size) for i in range(*shard_range(tensor.numel(), rank, size))]
    assert covered == list(range(tensor.numel()))  # each element once, in order


def test_the_last_slice_is_zero_padded_like_a_zero3_partition():
    # ZeRO-3 aligns numel up to a multiple of the world size: 10 over 4 ranks -> 3 each, 2 pad.
    part = flat_shard(torch.arange(1, 11, dtype=torch.float32), 3, 4)
    assert part.tolist() == [10.0, 0.0, 0.0]


def test_a_shard_is_a_copy_the_next_update_does_not_reach():
    tensor = torch.ones(8)
    part = flat_shard(tensor, 0, 2)
    tensor.add_(1)
    assert part.tolist() == [1.0] * 4


def test_shards_of_the_wrong_length_or_group_are_refused_by_name():
    parts = [torch.zeros(3), torch.zeros(2)]
    with pytest.raises(FlatShardError, match=r"flat shard of emb has shape \(2,\).*\(3,\)"):
        join_flat("emb", parts, (2, 3))
    with pytest.raises(FlatShardError, match="rank 2 is not one of 2 ranks"):
        shard_range(6, 2, 2)
    with pytest.raises(FlatShardError, match="at least one rank"):
        shard_len(6, 0)
