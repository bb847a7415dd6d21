"""Staging a training side's TP shards until every rank of a version has published (ROSE §4.2)."""

from __future__ import annotations

import time

import grpc
import pytest
import torch

from rlharvest.services.transfer_agent.shard_staging import ShardStaging, ShardStagingError

SIGNATURE = {"model.layers.0.self_attn.q_proj.weight": ("float32", (4, 8))}


def shard(rank: int) -> dict[str, torch.Tensor]:
    return {"model.layers.0.self_attn.q_proj.weight": torch.full((4, 8), float(rank))}


def stage(staging: ShardStaging, version: int, rank: int, tp_size: int = 2, nbytes: int = 128,
          run: int = 0, value: float | None = None):
    """Admit and add one rank's shard; returns what add returns."""
    admission = staging.admit(version, rank, tp_size, SIGNATURE, nbytes, run)
    tensors = shard(rank) if value is None else {
        "model.layers.0.self_attn.q_proj.weight": torch.full((4, 8), value)}
    return staging.add(admission, tensors)


def values(shards) -> list[float]:
    return [s["model.layers.0.self_attn.q_proj.weight"][0, 0].item() for s in shards]


def test_the_version_is_complete_only_when_every_rank_has_published_in_any_order():
    staging = ShardStaging(byte_budget=1 << 20)
    for rank in (2, 0):
        assert stage(staging, 7, rank, tp_size=3) is None
    assert staging.missing(7) == [1]
    shards = stage(staging, 7, 1, tp_size=3)
    assert values(shards) == [0, 1, 2]
    assert staging.staged_versions == () and staging.missing(7) == []


def test_a_rank_arriving_twice_at_once_or_at_another_tp_size_is_refused():
    staging = ShardStaging(byte_budget=1 << 20)
    staging.admit(1, 0, 2, SIGNATURE, 128)
    with pytest.raises(ShardStagingError, match="already arriving on another stream") as err:
        staging.admit(1, 0, 2, SIGNATURE, 128)  # its first stream is still arriving
    assert err.value.code is grpc.StatusCode.ALREADY_EXISTS
    with pytest.raises(ShardStagingError, match="at tp_size 4, but other ranks did at tp_size 2"):
        staging.admit(1, 1, 4, SIGNATURE, 128)
    with pytest.raises(ShardStagingError, match="tp_rank 2 of tp_size 2 is not a rank of a "
                                                "shard group"):
        staging.admit(2, 2, 2, SIGNATURE, 128)


def test_tp_and_dp_shards_of_one_version_never_mix():
    staging = ShardStaging(byte_budget=1 << 20)
    staging.admit(1, 0, 2, SIGNATURE, 128, layout="dp")
    with pytest.raises(ShardStagingError, match="as tp shards, but other ranks did as dp"):
        staging.admit(1, 1, 2, SIGNATURE, 128, layout="tp")
    with pytest.raises(ShardStagingError, match="layout 'zero' is not 'tp' or 'dp'"):
        staging.admit(2, 0, 2, SIGNATURE, 128, layout="zero")


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
    admission = staging.admit(1, 0, 2, SIGNATURE, 200)
    staging.abandon(admission)
    assert staging.staged_versions == ()
    staging.admit(1, 0, 2, SIGNATURE, 200)  # the budget was given back too
    assert staging.staged_bytes == 200


def test_a_tp_size_beyond_the_cap_is_refused_and_a_large_allowed_one_stays_cheap():
    staging = ShardStaging(byte_budget=1 << 40, max_tp_size=256)
    with pytest.raises(ShardStagingError, match="tp_size 1000000000 is over this agent's "
                                                "max_tp_size 256") as err:
        staging.admit(1, 0, 10**9, SIGNATURE, 128)
    assert err.value.code is grpc.StatusCode.INVALID_ARGUMENT
    started = time.perf_counter()
    for rank in range(255):
        assert stage(staging, 1, rank, tp_size=256) is None
    assert staging.missing(1) == [255]
    assert len(stage(staging, 1, 255, tp_size=256)) == 256
    assert time.perf_counter() - started < 1.0


def test_a_version_whose_rank_moved_on_is_dropped_and_frees_the_budget():
    """Rank 1 crashed after rank 0 staged v5: once rank 1 publishes v6, v5 can never complete."""
    staging = ShardStaging(byte_budget=300)
    assert stage(staging, 5, 0, nbytes=150) is None  # rank 1 of version 5 never comes
    admission = staging.admit(6, 1, 2, SIGNATURE, 150)
    assert admission.dropped == (5,)
    assert staging.staged_versions == (6,)
    assert staging.add(admission, shard(1)) is None
    assert values(stage(staging, 6, 0, nbytes=150)) == [0, 1]


def test_a_version_the_rank_already_sent_is_kept_when_it_moves_on():
    staging = ShardStaging(byte_budget=1 << 20)
    assert stage(staging, 5, 0) is None
    assert stage(staging, 6, 0) is None  # rank 0 runs ahead; rank 1 has not published v5 yet
    assert staging.staged_versions == (5, 6)
    assert values(stage(staging, 5, 1)) == [0, 1]


def test_under_budget_pressure_the_oldest_incomplete_version_makes_way_for_a_newer_one():
    staging = ShardStaging(byte_budget=300)
    assert stage(staging, 1, 0, nbytes=100) is None
    assert stage(staging, 2, 0, nbytes=100) is None  # rank 0 ahead; rank 1 stalls
    admission = staging.admit(3, 0, 2, SIGNATURE, 150)
    assert admission.dropped == (1,) and staging.staged_versions == (2, 3)
    with pytest.raises(ShardStagingError, match=r"wait for ranks .*2: '1 of 2 ranks'") as err:
        staging.admit(2, 1, 2, SIGNATURE, 400)  # no older version to evict; the newer stays
    assert err.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert staging.staged_versions == (2, 3)


def test_stale_shards_are_dropped_once_a_newer_version_is_held():
    staging = ShardStaging(byte_budget=300)
    assert stage(staging, 1, 0, nbytes=200) is None
    assert staging.drop_through(1) == [1]
    assert staging.staged_versions == () and staging.staged_bytes == 0


def test_a_rank_publishing_a_staged_version_again_replaces_its_shard():
    staging = ShardStaging(byte_budget=300)
    assert stage(staging, 5, 0, nbytes=150, value=-1.0) is None  # the crashed trainer's shard
    assert stage(staging, 5, 0, nbytes=150) is None  # restarted, rank 0 publishes v5 again
    assert staging.staged_bytes == 150
    assert values(stage(staging, 5, 1, nbytes=150)) == [0, 1]  # no shard of the dead run


def test_a_newer_run_never_completes_a_version_with_the_old_runs_shards():
    """A restarted trainer's rank 1 may publish v5 before its rank 0 does."""
    staging = ShardStaging(byte_budget=1 << 20)
    assert stage(staging, 5, 0, run=1, value=-1.0) is None  # run 1 dies after rank 0 staged v5
    admission = staging.admit(5, 1, 2, SIGNATURE, 128, run=2)
    assert admission.dropped == (5,)
    assert staging.add(admission, shard(1)) is None and staging.missing(5) == [0]
    with pytest.raises(ShardStagingError, match="from run 1, but run 2") as err:
        staging.admit(5, 0, 2, SIGNATURE, 128, run=1)
    assert err.value.code is grpc.StatusCode.FAILED_PRECONDITION
    assert values(stage(staging, 5, 0, run=2)) == [0, 1]


def test_a_shard_whose_version_was_dropped_while_it_decoded_is_refused_as_not_staged():
    staging = ShardStaging(byte_budget=1 << 20)
    admission = staging.admit(5, 0, 2, SIGNATURE, 128)
    staging.drop_through(5)  # version 5 is held meanwhile (e.g. relayed from elsewhere)
    with pytest.raises(ShardStagingError, match="not staged any more") as err:
        staging.add(admission, shard(0))
    assert err.value.code is grpc.StatusCode.FAILED_PRECONDITION
    again = staging.admit(5, 0, 2, SIGNATURE, 128)  # a later admission is not taken by the old one
    with pytest.raises(ShardStagingError, match="not staged any more"):
        staging.add(admission, shard(0))
    assert staging.add(again, shard(0)) is None


def test_a_completed_version_refuses_its_ranks_until_it_is_stored():
    staging = ShardStaging(byte_budget=1 << 20)
    assert stage(staging, 5, 0) is None
    assert stage(staging, 5, 1) is not None  # complete: on its way into the store
    with pytest.raises(ShardStagingError, match="complete and being stored") as err:
        staging.admit(5, 0, 2, SIGNATURE, 128)
    assert err.value.code is grpc.StatusCode.ALREADY_EXISTS
    staging.stored(5)
    assert staging.admit(5, 0, 2, SIGNATURE, 128).version == 5  # the service refuses it as held
