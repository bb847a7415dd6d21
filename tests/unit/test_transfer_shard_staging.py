"""Staging a training side's TP shards until every rank of a version has published (ROSE §4.2)."""

from __future__ import annotations

import pytest
import torch

from rlharvest.services.transfer_agent.shard_staging import ShardStaging, ShardStagingError

SIGNATURE = {"model.layers.0.self_attn.q_proj.weight": ("float32", (4, 8))}


def shard(rank: int) -> dict[str, torch.Tensor]:
    return {"model.layers.0.self_attn.q_proj.weight": torch.full((4, 8), float(rank))}


def test_the_version_is_complete_only_when_every_rank_has_published_in_any_order():
    staging = ShardStaging(byte_budget=1 << 20)
    for rank in (2, 0):
        staging.admit(7, rank, 3, SIGNATURE, 128)
        assert staging.add(7, rank, shard(rank)) is None
    assert staging.missing(7) == [1]
    staging.admit(7, 1, 3, SIGNATURE, 128)
    shards = staging.add(7, 1, shard(1))
    assert [s["model.layers.0.self_attn.q_proj.weight"][0, 0].item() for s in shards] == [0, 1, 2]
    assert staging.staged_versions == () and staging.missing(7) == []


def test_a_rank_published_twice_or_at_another_tp_size_is_refused():
    staging = ShardStaging(byte_budget=1 << 20)
    staging.admit(1, 0, 2, SIGNATURE, 128)
    with pytest.raises(ShardStagingError, match="already published") as err:
        staging.admit(1, 0, 2, SIGNATURE, 128)  # its first stream is still arriving
    assert err.value.code == "ALREADY_EXISTS"
    with pytest.raises(ShardStagingError, match="at tp_size 4, but other ranks did at tp_size 2"):
        staging.admit(1, 1, 4, SIGNATURE, 128)
    with pytest.raises(ShardStagingError, match="not a rank of a TP group"):
        staging.admit(2, 2, 2, SIGNATURE, 128)


def test_ranks_disagreeing_on_tensors_shapes_or_dtypes_are_refused():
    staging = ShardStaging(byte_budget=1 << 20)
    staging.admit(1, 0, 2, SIGNATURE, 128)
    with pytest.raises(ShardStagingError, match="differs from the ranks already staged"):
        staging.admit(1, 1, 2, {"model.norm.weight": ("float32", (8,))}, 32)
    name = next(iter(SIGNATURE))
    with pytest.raises(ShardStagingError, match=r"float32\(2, 8\) but the ranks already staged"):
        staging.admit(1, 1, 2, {name: ("float32", (2, 8))}, 64)
    with pytest.raises(ShardStagingError, match="bfloat16"):
        staging.admit(1, 1, 2, {name: ("bfloat16", (4, 8))}, 64)


def test_a_failed_stream_frees_its_rank_to_publish_again():
    staging = ShardStaging(byte_budget=256)
    staging.admit(1, 0, 2, SIGNATURE, 200)
    staging.abandon(1, 0, 200)
    assert staging.staged_versions == ()
    staging.admit(1, 0, 2, SIGNATURE, 200)  # the budget was given back too
    assert staging.add(1, 0, shard(0)) is None


def test_stale_shards_are_bounded_by_the_budget_and_dropped_once_a_newer_version_is_held():
    staging = ShardStaging(byte_budget=300)
    staging.admit(1, 0, 2, SIGNATURE, 200)
    staging.add(1, 0, shard(0))  # rank 1 of version 1 never comes
    with pytest.raises(ShardStagingError, match=r"wait for ranks \{1: \[1\]\}") as err:
        staging.admit(2, 0, 2, SIGNATURE, 200)
    assert err.value.code == "RESOURCE_EXHAUSTED"
    assert staging.drop_through(1) == [1]
    staging.admit(2, 0, 2, SIGNATURE, 200)
    assert staging.staged_versions == (2,)
