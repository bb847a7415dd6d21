"""The agent's version store (RLBoost §4.3, ROSE §4.2) and a worker's pull end to end."""

from __future__ import annotations

import json

import pytest
import torch

from rlharvest.models.tiny_model import build_model
from rlharvest.services.transfer_agent.apply import apply_pull
from rlharvest.services.transfer_agent.bucketing import (
    ManifestError,
    VersionManifest,
    entries_ready,
    layout_segments,
    pack,
    unpack,
)
from rlharvest.services.transfer_agent.checksum import ChecksumMismatchError
from rlharvest.services.transfer_agent.delta_codec import encode_dense
from rlharvest.services.transfer_agent.sharding import take_shard
from rlharvest.services.transfer_agent.version_store import (
    VersionOrderError,
    VersionStore,
    VersionStoreError,
    VersionUnavailableError,
)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small tensors on a shared 2-core box: threads only contend
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def v0() -> dict[str, torch.Tensor]:
    return {k: v.to(torch.bfloat16) for k, v in build_model("tiny", seed=0).state_dict().items()}


def rl_step(weights: dict[str, torch.Tensor], changed: float, seed: int) -> dict[str, torch.Tensor]:
    """A next version where a ``changed`` fraction of every tensor moved (ROSE Fig. 6: ~1%)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, w in weights.items():
        w = w.clone()
        mask = torch.rand(w.shape, generator=gen) < changed
        w[mask] += 0.01
        out[name] = w
    return out


def model_bytes(weights: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in weights.values())


def pull(store: VersionStore, version: int, held: dict[str, torch.Tensor], held_version,
         tp_rank=0, tp_size=1,
         bucket_bytes=4096) -> tuple[dict[str, torch.Tensor], VersionManifest]:
    """What the service does between store and worker: plan, bucket, JSON manifest, apply."""
    plan = store.plan(version, holding=held_version, tp_rank=tp_rank, tp_size=tp_size)
    manifest, buckets = pack(plan.version, plan.base_version, plan.tensors, bucket_bytes,
                             tp_rank=tp_rank, tp_size=tp_size)
    wire = VersionManifest.from_dict(json.loads(json.dumps(manifest.to_dict())))
    return apply_pull(wire, buckets, held, held_version), wire


def test_versions_only_move_forward_even_after_eviction(v0):
    store = VersionStore(byte_budget=10 * model_bytes(v0), max_versions=1)
    store.publish(3, v0, now=0.0)
    store.publish(4, v0, now=1.0)
    for stale in (4, 3, 2):
        with pytest.raises(VersionOrderError, match="only move forward"):
            store.publish(stale, v0, now=2.0)
    assert store.latest == 4


def test_oldest_version_is_evicted_under_the_byte_budget_with_a_record(v0):
    size = model_bytes(v0)
    store = VersionStore(byte_budget=2 * size + size // 2, max_versions=10)
    assert store.publish(1, v0, now=1.0) == []
    assert store.publish(2, rl_step(v0, 0.01, 2), now=2.0) == []
    records = store.publish(3, rl_step(v0, 0.01, 3), now=3.0)
    assert [(r.version, r.freed_bytes, r.reason, r.at) for r in records] == [
        (1, size, "byte_budget", 3.0)]
    assert store.held_versions == (2, 3) and store.held_bytes <= store.byte_budget
    with pytest.raises(VersionUnavailableError, match="evicted") as err:
        store.plan(1)
    assert err.value.evicted == records[0]


def test_only_the_last_k_versions_are_kept(v0):
    store = VersionStore(byte_budget=100 * model_bytes(v0), max_versions=2)
    for v in range(1, 5):
        store.publish(v, v0, now=float(v))
    assert store.held_versions == (3, 4)


def test_a_version_larger_than_the_budget_is_refused(v0):
    with pytest.raises(VersionStoreError, match="raise byte_budget"):
        VersionStore(byte_budget=model_bytes(v0) - 1).publish(1, v0, now=0.0)


def test_worker_holding_previous_version_gets_a_sparse_delta_that_rebuilds_the_new_one(v0):
    v1 = rl_step(v0, 0.01, 1)
    store = VersionStore(byte_budget=4 * model_bytes(v0))
    store.publish(0, v0, now=0.0)
    store.publish(1, v1, now=1.0)
    plan = store.plan(1, holding=0)
    assert plan.base_version == 0 and plan.payload_bytes < 0.1 * plan.dense_bytes
    got, manifest = pull(store, 1, {k: t.clone() for k, t in v0.items()}, 0)
    assert manifest.base_version == 0
    assert all(torch.equal(got[k], v1[k]) for k in v1)


def test_worker_holding_an_evicted_or_no_version_gets_dense_slices(v0):
    store = VersionStore(byte_budget=100 * model_bytes(v0), max_versions=2)
    versions = [v0, rl_step(v0, 0.01, 1), rl_step(v0, 0.01, 2)]
    for v, weights in enumerate(versions):
        store.publish(v, weights, now=float(v))
    for holding in (None, 0):
        plan = store.plan(2, holding=holding)
        assert plan.base_version is None and plan.note.startswith("dense")
        assert all(not item.needs_base for _, item in plan.tensors)
    assert "evicted" in store.plan(2, holding=0).note
    got, _ = pull(store, 2, {}, None)
    assert all(torch.equal(got[k], versions[2][k]) for k in v0)


@pytest.mark.parametrize("train_tp, worker_tp", [(1, 2), (2, 1), (2, 2)])
def test_each_worker_rank_pulls_only_its_slice_from_training_shards(v0, train_tp, worker_tp):
    store = VersionStore(byte_budget=4 * model_bytes(v0))
    v1 = rl_step(v0, 0.01, 1)
    for version, weights in ((0, v0), (1, v1)):
        shards = [{k: take_shard(k, t, r, train_tp) for k, t in weights.items()}
                  for r in range(train_tp)]
        store.publish_shards(version, shards, now=float(version))
    for rank in range(worker_tp):
        held = {k: take_shard(k, t, rank, worker_tp).clone() for k, t in v0.items()}
        got, _ = pull(store, 1, held, 0, tp_rank=rank, tp_size=worker_tp)
        assert all(torch.equal(got[k], take_shard(k, v1[k], rank, worker_tp)) for k in v1)


def test_shards_cut_at_different_tp_sizes_are_refused_and_held_shards_gather_exactly(v0):
    store = VersionStore(byte_budget=4 * model_bytes(v0))
    name = "model.layers.0.self_attn.q_proj.weight"
    bad = [{k: take_shard(k, t, r, 2) for k, t in v0.items()} for r in range(2)]
    bad[1][name] = take_shard(name, v0[name], 1, 4)  # rank 1 sliced at TP 4
    with pytest.raises(VersionStoreError, match=f"rank 1's shard of {name}"):
        store.publish_shards(0, bad, now=0.0)
    store.publish_shards(0, [{k: take_shard(k, t, r, 2) for k, t in v0.items()}
                             for r in range(2)], now=0.0)
    whole = store.full_tensors(0)
    assert all(torch.equal(whole[k], v0[k]) for k in v0)


def test_encoded_deltas_are_cached_so_n_workers_do_not_re_encode(v0):
    store = VersionStore(byte_budget=4 * model_bytes(v0))
    store.publish(0, v0, now=0.0)
    store.publish(1, rl_step(v0, 0.01, 1), now=1.0)
    first, second = store.plan(1, holding=0), store.plan(1, holding=0)
    assert all(a is b for (_, a), (_, b) in zip(first.tensors, second.tensors))


def test_unknown_versions_names_and_model_changes_are_refused_precisely(v0):
    store = VersionStore(byte_budget=4 * model_bytes(v0))
    store.publish(5, v0, now=0.0)
    with pytest.raises(VersionUnavailableError, match="not been published"):
        store.plan(6)
    with pytest.raises(VersionUnavailableError, match="unknown here"):
        store.plan(4)
    with pytest.raises(VersionStoreError, match="newer than the requested"):
        store.plan(5, holding=6)
    with pytest.raises(VersionStoreError, match="no tensors named"):
        store.plan(5, names=["model.nope.weight"])
    reshaped = dict(v0, **{"model.norm.weight": torch.zeros(3, dtype=torch.bfloat16)})
    with pytest.raises(VersionStoreError, match="model.norm.weight"):
        store.publish(6, reshaped, now=1.0)
    assert store.plan(5, holding=5).tensors == ()


def test_published_tensors_are_copied_so_a_trainer_may_keep_updating_its_own(v0):
    weights = {k: t.clone() for k, t in v0.items()}
    store = VersionStore(byte_budget=4 * model_bytes(v0))
    store.publish(0, weights, now=0.0)
    for t in weights.values():
        t.add_(1)
    got, _ = pull(store, 0, {}, None)
    assert all(torch.equal(got[k], v0[k]) for k in v0)


def test_buckets_respect_the_size_and_keep_small_payloads_whole():
    sizes = [10, 30, 5, 100, 1, 64, 0]
    placed = layout_segments(sizes, 32)
    assert [sum(s.length for s in segs) for segs in placed] == sizes
    fill: dict[int, int] = {}
    for size, segs in zip(sizes, placed):
        if size <= 32:
            assert len(segs) == 1
        for s in segs:
            assert s.offset == fill.get(s.bucket, 0)  # contiguous, no overlap
            fill[s.bucket] = s.offset + s.length
    assert max(fill.values()) <= 32


def test_a_damaged_or_missing_bucket_is_named_for_re_pull(v0):
    store = VersionStore(byte_budget=4 * model_bytes(v0))
    store.publish(0, v0, now=0.0)
    plan = store.plan(0)
    manifest, buckets = pack(0, None, plan.tensors, 20 << 10)
    damaged = list(buckets)
    damaged[1] = bytes([damaged[1][0] ^ 1]) + damaged[1][1:]
    with pytest.raises(ChecksumMismatchError, match="bucket 1 of version 0"):
        unpack(manifest, damaged)
    partial = {0: buckets[0]}
    with pytest.raises(ManifestError, match="bucket 1 of version 0 has not arrived"):
        unpack(manifest, partial)
    ready = entries_ready(manifest, partial)
    assert ready and set(unpack(manifest, partial, ready)) == set(ready)
    with pytest.raises(ManifestError, match="malformed"):
        VersionManifest.from_dict({"format": 1, "version": 0})


@pytest.mark.parametrize("field, value, match", [
    ("dtype", "nosuchtype", "dtype 'nosuchtype'"),
    ("dtype", "complex64", "dtype 'complex64'"),  # a torch dtype the weight codec does not carry
    ("encoding", "ZIP", "encoding 'ZIP'"),
    ("shape", [-1, 4], r"shape \[-1, 4\]"),
    ("name", "b", "names tensor 'b' twice"),
])
def test_a_manifest_field_the_codec_cannot_read_is_refused_when_the_manifest_is_parsed(
        field, value, match):
    """Refused at the boundary, naming the field, before a byte is fetched or decoded."""
    items = [(name, encode_dense(torch.ones(4))) for name in ("a", "b")]
    data = pack(3, None, items, 1 << 10)[0].to_dict()
    data["entries"][0][field] = value
    with pytest.raises(ManifestError, match=match):
        VersionManifest.from_dict(data)
