"""The transfer agent's core, without a server: which versions it holds per job, which publishes
and pulls it admits, the status of every refusal, the packed pulls it keeps and forgets, and
when an idle job goes (a hand-moved clock)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

import grpc
import pytest
import torch

from rlharvest.common import errors
from rlharvest.common.pb import transfer_agent_pb2 as pb
from rlharvest.services.transfer_agent import flat_shards, sharding
from rlharvest.services.transfer_agent.bucketing import pack
from rlharvest.services.transfer_agent.config import AgentConfig
from rlharvest.services.transfer_agent.core import (
    PACKED_CACHE_ENTRIES,
    AgentCore,
    PackedPull,
    check_planned,
    delta_base,
    is_dp_shard,
    is_shard,
    pack_pull,
    pull_kind,
    rides_inline,
    shard_label,
)
from rlharvest.services.transfer_agent.delta_codec import Encoding, encode_delta, encode_dense
from rlharvest.services.transfer_agent.protocol import manifest_id

JOB = "job-core"
NAME = "model.layers.0.self_attn.q_proj.weight"  # split on dim 0 under TP
IDLE_S = 100.0


def weights(seed: float = 0.0) -> dict[str, torch.Tensor]:
    return {NAME: torch.arange(64, dtype=torch.float32).reshape(8, 8) + seed}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def core(clock: Clock) -> AgentCore:
    return AgentCore(AgentConfig(agent_id="core-test", job_idle_s=IDLE_S,
                                 memory_budget_bytes=1 << 20, max_versions=2), clock=clock)


def header(version: int, tensors: dict[str, torch.Tensor] | None = None, *, job: str = JOB,
           base: tuple[int, dict[str, torch.Tensor]] | None = None,
           tp: tuple[int, int] = (0, 1), manifest_tp: tuple[int, int] | None = None,
           dp: tuple[int, int] = (0, 0), full_shapes: tuple[tuple[int, ...], ...] = (),
           manifest_version: int | None = None) -> pb.PublishHeader:
    """A publish header whose manifest packs ``tensors`` dense, or as COO deltas against
    ``base`` (its version, its tensors)."""
    tensors = weights() if tensors is None else tensors
    if base is None:
        items = [(name, encode_dense(t)) for name, t in tensors.items()]
    else:
        items = [(name, encode_delta(base[1][name], t, encoding=Encoding.COO))
                 for name, t in tensors.items()]
    rank, size = manifest_tp or tp
    manifest, _ = pack(version if manifest_version is None else manifest_version,
                       base[0] if base else None, items, 1 << 20, tp_rank=rank, tp_size=size)
    manifest = replace(manifest, full_shapes=full_shapes)
    return pb.PublishHeader(job=job, version=version, tp_rank=tp[0], tp_size=tp[1],
                            dp_rank=dp[0], dp_size=dp[1],
                            manifest_json=json.dumps(manifest.to_dict()))


def hold(core: AgentCore, version: int, tensors: dict[str, torch.Tensor] | None = None,
         job: str = JOB) -> list[int]:
    """Store a whole version as the servicer does (store, then ``now_held``); the evicted."""
    records = core.job(job).store.publish(version, weights(version) if tensors is None
                                          else tensors, now=0.0)
    core.now_held(job, version, records)
    return [r.version for r in records]


def packed(plan_id: int = 7, buckets: int = 2, payload: int = 10) -> PackedPull:
    return PackedPull(pb.PullPlan(plan_id=plan_id, payload_bytes=payload),
                      [b"x" * payload] * buckets)


@contextmanager
def refused(error: type[errors.ServiceError], code: grpc.StatusCode,
            match: str) -> Iterator[pytest.ExceptionInfo]:
    """A refusal of ``error``'s kind, answered with ``code``, saying ``match``."""
    with pytest.raises(error, match=match) as info:
        yield info
    assert info.value.code == code


# ---- what is held --------------------------------------------------------------------------------


def test_a_job_never_seen_holds_nothing_and_is_not_listed(core: AgentCore) -> None:
    assert core.held(JOB) == () and core.latest(JOB) is None and core.held_bytes(JOB) == 0
    assert core.jobs() == [] and core.touched(JOB) is None


def test_a_job_starts_with_the_configured_store_and_staging_limits(core: AgentCore) -> None:
    state = core.job(JOB)
    assert state.store.byte_budget == 1 << 20 and state.store.max_versions == 2
    assert state.store.cache_bytes == core.cfg.encode_cache_bytes
    assert core.jobs() == [JOB] and core.job(JOB) is state


def test_held_versions_latest_and_bytes_follow_the_store(core: AgentCore) -> None:
    hold(core, 1)
    hold(core, 2)
    assert core.held(JOB) == (1, 2) and core.latest(JOB) == 2
    assert core.held_bytes(JOB) == 2 * 64 * 4


def test_jobs_are_listed_in_name_order(core: AgentCore) -> None:
    for job in ("b", "a", "c"):
        core.job(job)
    assert core.jobs() == ["a", "b", "c"]


# ---- publish admission ---------------------------------------------------------------------------


def test_a_whole_model_is_admitted_without_a_staging_place(core: AgentCore) -> None:
    admitted = core.admit_publish(header(1))
    assert admitted.shard is None and admitted.manifest.version == 1
    assert [e.name for e in admitted.manifest.entries] == [NAME]


@pytest.mark.parametrize("job", ["", "a/b"])
def test_a_job_name_empty_or_with_a_slash_is_invalid(core: AgentCore, job: str) -> None:
    with refused(errors.InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT, "contain no '/'"):
        core.admit_publish(header(1, job=job))


def test_a_negative_version_is_invalid(core: AgentCore) -> None:
    with refused(errors.InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT, "must be >= 0"):
        core.admit_publish(header(-1, manifest_version=0))


@pytest.mark.parametrize("version", [1, 2])
def test_a_version_not_newer_than_the_latest_fails_its_precondition(core: AgentCore,
                                                                     version: int) -> None:
    hold(core, 2)
    with refused(errors.FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION,
                 "not newer than the latest published version 2"):
        core.admit_publish(header(version))


def test_a_manifest_that_is_not_json_is_invalid(core: AgentCore) -> None:
    bad = pb.PublishHeader(job=JOB, version=1, manifest_json="{not json")
    with refused(errors.InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT,
                 "publish manifest is not valid"):
        core.admit_publish(bad)


def test_a_manifest_of_another_version_than_the_header_is_invalid(core: AgentCore) -> None:
    with refused(errors.InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT,
                 "manifest is for version 2 but the header publishes 1"):
        core.admit_publish(header(1, manifest_version=2))


def test_delta_entries_without_a_base_version_are_invalid(core: AgentCore) -> None:
    delta = json.loads(header(2, base=(1, weights())).manifest_json)
    delta["base_version"] = None
    with refused(errors.InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT,
                 "names the version they apply to"):
        core.admit_publish(pb.PublishHeader(job=JOB, version=2, manifest_json=json.dumps(delta)))


def test_a_delta_whose_base_is_not_held_fails_its_precondition(core: AgentCore) -> None:
    hold(core, 1)
    with refused(errors.FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION,
                 r"does not hold version 0, the base .*\(it holds \[1\]\)"):
        core.admit_publish(header(2, weights(2), base=(0, weights(0))))


def test_a_delta_on_a_held_base_is_admitted(core: AgentCore) -> None:
    hold(core, 1, weights(1))
    admitted = core.admit_publish(header(2, weights(2), base=(1, weights(1))))
    assert admitted.manifest.base_version == 1 and admitted.shard is None


def test_a_tp_shard_published_as_a_delta_is_invalid(core: AgentCore) -> None:
    hold(core, 1, weights(1))
    shard = {NAME: sharding.take_shard(NAME, weights(2)[NAME], 0, 2).contiguous()}
    base = {NAME: sharding.take_shard(NAME, weights(1)[NAME], 0, 2).contiguous()}
    with refused(errors.InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT,
                 "TP shards are published dense"):
        core.admit_publish(header(2, shard, base=(1, base), tp=(0, 2)))


def test_a_version_over_the_memory_budget_is_resource_exhausted(clock: Clock) -> None:
    small = AgentCore(AgentConfig(agent_id="small", memory_budget_bytes=100), clock=clock)
    with refused(errors.ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED,
                 "is 256 bytes, over this agent's memory_budget_bytes 100"):
        small.admit_publish(header(1))


def test_dp_and_tp_shards_at_once_are_invalid(core: AgentCore) -> None:
    with refused(errors.InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT,
                 "as DP shards and TP shards"):
        core.admit_publish(header(1, tp=(0, 2), dp=(0, 2)))


def test_a_whole_model_header_over_a_shard_manifest_is_invalid(core: AgentCore) -> None:
    with refused(errors.InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT,
                 "as a whole model .* manifest is TP rank 1 of 2"):
        core.admit_publish(header(1, manifest_tp=(1, 2)))


def test_nothing_is_staged_when_a_publish_is_refused(core: AgentCore) -> None:
    with pytest.raises(errors.InvalidArgument):
        core.admit_publish(header(1, tp=(0, 2), manifest_tp=(1, 2)))
    assert core.jobs() == []


# ---- shards ---------------------------------------------------------------------------------------


def tp_shard(rank: int, version: int = 1) -> dict[str, torch.Tensor]:
    return {NAME: sharding.take_shard(NAME, weights(version)[NAME], rank, 2).contiguous()}


def test_a_tp_header_that_disagrees_with_its_manifest_is_invalid(core: AgentCore) -> None:
    with refused(errors.InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT,
                 "header says TP rank 0 of 2 but the manifest says 1 of 2"):
        core.admit_publish(header(1, tp_shard(0), tp=(0, 2), manifest_tp=(1, 2)))


def test_a_tensor_without_a_tp_rule_is_invalid(core: AgentCore) -> None:
    with refused(errors.InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT,
                 "TP shard of version 1: .*add a rule"):
        core.admit_publish(header(1, {"not.a.qwen.tensor": torch.zeros(4)}, tp=(0, 2)))


def test_tp_shards_are_staged_until_every_rank_published(core: AgentCore) -> None:
    first = core.admit_publish(header(1, tp_shard(0), tp=(0, 2)))
    assert first.shard is not None and first.shard.tp_rank == 0
    assert core.add_shard(JOB, first.shard, tp_shard(0)) is None
    assert core.shards_missing(JOB, 1) == [1]
    second = core.admit_publish(header(1, tp_shard(1), tp=(1, 2)))
    assert second.shard is not None
    shards = core.add_shard(JOB, second.shard, tp_shard(1))
    assert shards is not None and [s[NAME].shape for s in shards] == [(4, 8), (4, 8)]
    core.shards_stored(JOB, 1)
    assert core.shards_missing(JOB, 1) == []


def test_an_abandoned_shard_frees_its_rank_to_publish_again(core: AgentCore) -> None:
    admitted = core.admit_publish(header(1, tp_shard(0), tp=(0, 2)))
    assert admitted.shard is not None
    core.abandon(JOB, admitted.shard)
    with refused(errors.ServiceError, grpc.StatusCode.FAILED_PRECONDITION,
                 "not staged any more"):
        core.add_shard(JOB, admitted.shard, tp_shard(0))
    again = core.admit_publish(header(1, tp_shard(0), tp=(0, 2)))
    assert again.shard is not None and core.add_shard(JOB, again.shard, tp_shard(0)) is None


def test_holding_a_version_drops_the_staged_shards_of_versions_not_newer(core: AgentCore) -> None:
    admitted = core.admit_publish(header(2, tp_shard(0, 2), tp=(0, 2)))
    assert admitted.shard is not None
    core.add_shard(JOB, admitted.shard, tp_shard(0, 2))
    records = core.job(JOB).store.publish(3, weights(3), now=0.0)
    assert core.now_held(JOB, 3, records) == [2]
    assert core.shards_missing(JOB, 2) == []


def dp_header(rank: int, size: int = 2, shapes: tuple[tuple[int, ...], ...] = ((8, 8),)
              ) -> pb.PublishHeader:
    flat = flat_shards.flat_shards(weights(), rank, size)
    return header(1, flat, dp=(rank, size), full_shapes=shapes)


def test_a_dp_shard_is_staged_at_its_decoded_size(core: AgentCore) -> None:
    admitted = core.admit_publish(dp_header(1))
    assert admitted.shard is not None and admitted.shard.tp_rank == 1
    assert admitted.manifest.full_shape_of() == {NAME: (8, 8)}
    assert core.job(JOB).staging.staged_bytes == 32 * 4


def test_a_dp_shard_without_full_shapes_is_invalid(core: AgentCore) -> None:
    with refused(errors.InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT,
                 "states no full_shapes"):
        core.admit_publish(dp_header(0, shapes=()))


def test_a_dp_shard_of_the_wrong_length_is_invalid(core: AgentCore) -> None:
    with refused(errors.InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT,
                 "DP shard of version 1: the flat shard"):
        core.admit_publish(dp_header(0, shapes=((16, 8),)))


@pytest.mark.parametrize(("tp", "dp", "shard", "dp_shard", "label"), [
    ((0, 0), (0, 0), False, False, "TP"), ((0, 1), (0, 1), False, False, "TP"),
    ((1, 2), (0, 0), True, False, "TP"), ((0, 0), (1, 2), True, True, "DP"),
])
def test_a_header_is_a_shard_only_when_its_sizes_or_ranks_say_so(
        tp: tuple[int, int], dp: tuple[int, int], shard: bool, dp_shard: bool,
        label: str) -> None:
    h = pb.PublishHeader(tp_rank=tp[0], tp_size=tp[1], dp_rank=dp[0], dp_size=dp[1])
    assert (is_shard(h), is_dp_shard(h), shard_label(h)) == (shard, dp_shard, label)


# ---- holding versions -----------------------------------------------------------------------------


def test_an_eviction_forgets_only_the_packed_pulls_that_read_the_evicted_version(
        core: AgentCore) -> None:
    hold(core, 1)
    hold(core, 2)
    keys = {"target": (JOB, 1, None, 0, 1, ()), "base": (JOB, 2, 1, 0, 1, ()),
            "kept": (JOB, 2, None, 0, 1, ()), "other job": ("other", 1, None, 0, 1, ())}
    for key in keys.values():
        core.remember(key, packed())
    assert hold(core, 3) == [1]
    assert core.packed(keys["target"]) is None and core.packed(keys["base"]) is None
    assert core.packed(keys["kept"]) is not None and core.packed(keys["other job"]) is not None


# ---- pull admission -------------------------------------------------------------------------------


def test_a_pull_of_a_job_without_a_version_is_not_found(core: AgentCore) -> None:
    with refused(errors.NotFound, grpc.StatusCode.NOT_FOUND, "holds no version of job"):
        core.admit_pull(pb.PullRequest(job=JOB))
    core.job(JOB)  # known, but nothing held yet
    with refused(errors.NotFound, grpc.StatusCode.NOT_FOUND, "holds no version of job"):
        core.admit_pull(pb.PullRequest(job=JOB))


@pytest.mark.parametrize("request_", [
    pb.PullRequest(job=JOB, version=-1), pb.PullRequest(job=JOB, holding=-1),
    pb.PullRequest(job=JOB, tp_size=-1), pb.PullRequest(job=JOB, tp_rank=2, tp_size=2),
    pb.PullRequest(job=JOB, tp_rank=-1, tp_size=2), pb.PullRequest(job=JOB, tp_rank=1),
])
def test_a_pull_of_a_negative_version_or_a_rank_outside_its_tp_size_is_invalid(
        core: AgentCore, request_: pb.PullRequest) -> None:
    hold(core, 1)
    with refused(errors.InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT,
                 "ranks run from 0 to tp_size - 1"):
        core.admit_pull(request_)


def test_a_pull_key_pins_the_latest_version_and_sorts_and_dedupes_names(core: AgentCore) -> None:
    hold(core, 1)
    hold(core, 4)
    key, store = core.admit_pull(pb.PullRequest(job=JOB, names=["b", "a", "b"], tp_rank=1,
                                                tp_size=2))
    assert key == (JOB, 4, None, 1, 2, ("a", "b")) and store is core.job(JOB).store


def test_a_pull_holds_a_version_only_when_the_request_says_so(core: AgentCore) -> None:
    hold(core, 1)
    request = pb.PullRequest(job=JOB, version=1, holding=0)
    assert core.admit_pull(request)[0][2] is None  # holding unset: the worker holds nothing
    request.has_holding = True
    assert core.admit_pull(request)[0][2] == 0


def test_the_packed_cache_keeps_the_most_recently_used(core: AgentCore) -> None:
    keys = [(JOB, v, None, 0, 1, ()) for v in range(PACKED_CACHE_ENTRIES + 1)]
    for key in keys[:PACKED_CACHE_ENTRIES]:
        core.remember(key, packed())
    assert core.packed(keys[0]) is not None  # used: now the most recent
    core.remember(keys[-1], packed())
    assert core.packed(keys[1]) is None  # the least recently used went
    assert all(core.packed(k) is not None for k in [keys[0], *keys[2:]])


def test_a_pull_is_cross_cluster_only_when_it_names_another_cluster(core: AgentCore) -> None:
    assert not core.is_cross_cluster(pb.PullRequest(job=JOB))
    assert not core.is_cross_cluster(pb.PullRequest(job=JOB, requester_cluster="default"))
    assert core.is_cross_cluster(pb.PullRequest(job=JOB, requester_cluster="far"))


def test_a_bucket_request_quoting_another_plan_is_aborted() -> None:
    with refused(errors.Aborted, grpc.StatusCode.ABORTED, "plan changed since PlanPull"):
        check_planned(packed(plan_id=7), 8, [0])
    check_planned(packed(plan_id=7), 7, [0])
    check_planned(packed(plan_id=7), 0, [0, 1])  # no plan id quoted: not checked


@pytest.mark.parametrize("indices", [[], [2], [-1], [0, 5]])
def test_a_bucket_request_outside_the_plan_or_of_no_bucket_is_out_of_range(
        indices: list[int]) -> None:
    with refused(errors.OutOfRange, grpc.StatusCode.OUT_OF_RANGE, "are not in this plan's 0..1"):
        check_planned(packed(buckets=2), 0, indices)


@pytest.mark.parametrize(("buckets", "payload", "limit", "throttled", "corrupting", "inline"), [
    (1, 10, 10, False, False, True), (1, 11, 10, False, False, False),
    (0, 0, 10, False, False, False), (1, 10, 10, True, False, False),
    (1, 10, 10, False, True, False),
])
def test_buckets_ride_with_their_plan_only_when_small_unthrottled_and_not_corrupted(
        buckets: int, payload: int, limit: int, throttled: bool, corrupting: bool,
        inline: bool) -> None:
    assert rides_inline(packed(buckets=buckets, payload=payload), limit, throttled,
                        corrupting) is inline


@pytest.mark.parametrize(("plan", "kind"), [
    (pb.PullPlan(delta_tensors=1, dense_bytes=8), "delta"), (pb.PullPlan(), "noop"),
    (pb.PullPlan(dense_bytes=8), "dense"),
])
def test_a_pull_is_counted_as_delta_noop_or_dense(plan: pb.PullPlan, kind: str) -> None:
    assert pull_kind(plan) == kind


def test_a_packed_pull_is_identified_by_its_manifest(core: AgentCore) -> None:
    hold(core, 1)
    key, store = core.admit_pull(pb.PullRequest(job=JOB))
    result = pack_pull(store, key, 1 << 20)
    assert result.plan.plan_id == manifest_id(result.plan.manifest_json)
    assert result.plan.version == 1 and result.plan.dense_bytes == 256
    assert sum(len(b) for b in result.buckets) == result.plan.payload_bytes


def test_a_delta_base_evicted_meanwhile_fails_its_precondition(core: AgentCore) -> None:
    hold(core, 1)
    with refused(errors.FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION,
                 "version 0, the base of the delta publish of version 2, was evicted"):
        delta_base(core.job(JOB).store, header(2), 0)


def test_a_dp_shards_delta_base_is_its_ranks_slice_without_sums(core: AgentCore) -> None:
    hold(core, 1, weights(1))
    base, sums = delta_base(core.job(JOB).store, dp_header(1), 1)
    assert torch.equal(base[NAME], flat_shards.flat_shards(weights(1), 1, 2)[NAME])
    assert sums == {}


# ---- idle jobs ------------------------------------------------------------------------------------


def test_a_job_unused_for_job_idle_s_is_dropped_with_its_packed_pulls(core: AgentCore,
                                                                       clock: Clock) -> None:
    hold(core, 1)
    core.remember((JOB, 1, None, 0, 1, ()), packed())
    assert core.drop_idle(clock.now + IDLE_S - 1) == []
    [dropped] = core.drop_idle(clock.now + IDLE_S)
    assert (dropped.job, dropped.idle_s, dropped.versions) == (JOB, IDLE_S, (1,))
    assert dropped.freed_bytes == 256
    assert core.jobs() == [] and core.packed((JOB, 1, None, 0, 1, ())) is None


def test_a_dropped_job_starts_afresh_on_its_next_publish(core: AgentCore, clock: Clock) -> None:
    hold(core, 5)
    core.drop_idle(clock.now + IDLE_S)
    core.admit_publish(header(1))  # version 1 is not "older" any more: nothing is held
    assert core.held(JOB) == () and core.latest(JOB) is None


def test_a_pull_or_publish_restarts_the_idle_clock(core: AgentCore, clock: Clock) -> None:
    hold(core, 1)
    clock.now += IDLE_S - 1
    core.admit_pull(pb.PullRequest(job=JOB))
    assert core.drop_idle(clock.now + IDLE_S - 1) == []
    clock.now += IDLE_S - 1
    core.admit_publish(header(2, tp_shard(0, 2), tp=(0, 2)))  # a shard's admission touches
    assert core.drop_idle(clock.now + IDLE_S - 1) == []


def test_a_job_with_claimed_work_is_never_dropped_and_idles_from_the_release(
        core: AgentCore, clock: Clock) -> None:
    hold(core, 1)
    core.claim(JOB)
    core.claim(JOB)
    assert core.drop_idle(clock.now + 10 * IDLE_S) == []
    core.release(JOB)
    assert core.drop_idle(clock.now + 10 * IDLE_S) == []  # one claim is still out
    clock.now += 5 * IDLE_S
    core.release(JOB)
    assert core.drop_idle(clock.now + IDLE_S - 1) == []
    assert [d.job for d in core.drop_idle(clock.now + IDLE_S)] == [JOB]


def test_job_idle_s_zero_drops_nothing(clock: Clock) -> None:
    keeper = AgentCore(AgentConfig(agent_id="keeper", job_idle_s=0), clock=clock)
    keeper.job(JOB)
    assert keeper.drop_idle(clock.now + 1e9) == [] and keeper.jobs() == [JOB]


def test_a_dropped_job_is_unannounced_until_its_record_is_deleted(core: AgentCore,
                                                                   clock: Clock) -> None:
    for job in ("b", "a"):
        core.job(job)
    core.drop_idle(clock.now + IDLE_S)
    assert core.unannounced() == ["a", "b"]
    core.announced("a")
    assert core.unannounced() == ["b"]
    core.announced("never dropped")  # nothing to forget: no error
    assert core.unannounced() == ["b"]
