"""WEAVE §5.2 inter-cluster scatter of one relay pull: every holder sends a disjoint share of one
copy, and the share of a sender that dies is fetched from the others."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import torch
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st

from rlharvest.common.pb import transfer_agent_pb2 as pb
from rlharvest.services.transfer_agent import scatter_pull as scatter_module
from rlharvest.services.transfer_agent.client import PullError, _pack_dense, pull_request
from rlharvest.services.transfer_agent.data_path import byte_range_parts, cut_parts
from rlharvest.services.transfer_agent.http_data import DataPathError, RangeFetcher
from rlharvest.services.transfer_agent.scatter_pull import (
    Planned,
    ScatterFetch,
    Sender,
    agreeing,
    assign_parts,
    scatter_pull,
)


def covered_bytes(parts) -> list[tuple[int, int]]:
    return sorted((bucket, offset) for bucket, start, stop in parts for offset in range(start, stop))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 300), min_size=1, max_size=6), st.integers(1, 5))
def test_the_senders_shares_are_disjoint_and_make_exactly_one_copy(bucket_sizes, n_senders):
    senders = [f"train-{i}" for i in range(n_senders)]
    shares = assign_parts(senders, bucket_sizes, "train", "gateway", "rollout")
    every_part = [part for share in shares.values() for part in share]
    expected = [(b, o) for b, size in enumerate(bucket_sizes) for o in range(size)]
    assert covered_bytes(every_part) == expected  # each byte exactly once: one copy, no gaps
    assert all(0 <= start < stop <= bucket_sizes[b] for b, start, stop in every_part)
    if sum(bucket_sizes) >= n_senders:
        assert all(shares[s] for s in senders)  # every sender's uplink carries a share


def test_ranges_across_bucket_boundaries_are_cut_per_bucket_and_parts_cut_for_streams():
    assert byte_range_parts([10, 0, 10, 10], 5, 25) == [(0, 5, 10), (2, 0, 10), (3, 0, 5)]
    assert cut_parts([(0, 0, 10), (1, 4, 8)], streams=3, min_part=1) == [
        (0, 0, 5), (0, 5, 10), (1, 4, 8)]


def planned(agent: str, plan_id: int, payload: int) -> Planned:
    return Planned(Sender(agent, f"{agent}:1"), pb.PullPlan(plan_id=plan_id, payload_bytes=payload),
                   f"{agent}:2")


def test_only_senders_with_the_same_plan_share_a_pull_the_largest_group_wins():
    group = agreeing([planned("a", 1, 900), planned("b", 2, 50), planned("c", 2, 50)])
    assert [p.sender.agent_id for p in group] == ["b", "c"]
    tie = agreeing([planned("a", 1, 900), planned("b", 2, 50)])  # a delta beats a dense plan
    assert [p.sender.agent_id for p in tie] == ["b"]
    with pytest.raises(PullError, match="no source agent could plan"):
        agreeing([])


class FakeSenders:
    """Senders that deliver parts one by one; a sender in ``dies_after`` breaks after that many."""

    def __init__(self, dies_after: dict[str, int]) -> None:
        self.dies_after = dict(dies_after)
        self.delivered: dict[str, list] = {}

    async def fetch(self, sender: str, parts, on_part) -> None:
        for part in parts:
            await asyncio.sleep(0)
            if self.dies_after.get(sender) == 0:
                raise DataPathError(f"connection to {sender} broke", "UNAVAILABLE")
            if sender in self.dies_after:
                self.dies_after[sender] -= 1
            self.delivered.setdefault(sender, []).append(part)
            on_part(part)


async def test_a_sender_dying_mid_pull_hands_its_undelivered_parts_to_the_live_ones():
    parts = [(0, i, i + 1) for i in range(12)]
    shares = {"s1": parts[:4], "s2": parts[4:8], "s3": parts[8:]}
    senders = FakeSenders({"s2": 1})
    scatter = ScatterFetch(list(shares), senders.fetch)
    landed = []
    await scatter.run(shares, lambda sender, part: landed.append((sender, part)))
    assert sorted(part for _, part in landed) == parts  # every part once, none twice
    assert senders.delivered["s2"] == [parts[4]]
    moved = set(parts[5:8])
    assert moved <= set(senders.delivered["s1"]) | set(senders.delivered["s3"])
    assert scatter.alive == ["s1", "s3"] and "UNAVAILABLE" in scatter.failures["s2"]


async def test_when_every_sender_dies_the_pull_fails_with_unavailable():
    shares = {"s1": [(0, 0, 1), (0, 1, 2)], "s2": [(0, 2, 3)]}
    scatter = ScatterFetch(list(shares), FakeSenders({"s1": 0, "s2": 0}).fetch)
    with pytest.raises(PullError, match="every source agent failed") as err:
        await scatter.run(shares, lambda sender, part: None)
    assert err.value.code == "UNAVAILABLE"


async def test_an_unexpected_error_is_not_mistaken_for_a_dead_sender():
    async def broken(sender, parts, on_part):
        raise RuntimeError("bug")

    with pytest.raises(RuntimeError, match="bug"):
        await ScatterFetch(["s1", "s2"], broken).run({"s1": [(0, 0, 1)]}, lambda s, p: None)


# ---- scatter_pull end to end, with senders faked below the HTTP data path ---------------------

TENSORS = {"a.weight": torch.arange(256, dtype=torch.float32),
           "b.weight": torch.arange(256, dtype=torch.float32) + 1}
SENDERS = [Sender("s1", "s1:1"), Sender("s2", "s2:1")]


def fake_senders(monkeypatch, manifest_json: str, buckets: list[bytes], fetch_parts) -> None:
    """Every sender plans ``manifest_json``; ``fetch_parts(sender, parts, on_part, fill)`` stands
    in for its data path (``fill(part)`` writes the part's true bytes into the puller's buffer)."""
    plan = pb.PullPlan(manifest_json=manifest_json, version=1, plan_id=7)

    async def plan_everywhere(senders, request):
        return [Planned(sender, plan, f"{sender.agent_id}:2") for sender in senders]

    class Fetcher:
        def __init__(self, data_endpoint, request, plan_id, buffers, streams, *timeout):
            self.sender = data_endpoint.split(":")[0]
            self.buffers = buffers

        async def __aenter__(self):
            return self

        async def __aexit__(self, *exc_info):
            return None

        def fill(self, part) -> None:
            index, start, stop = part
            self.buffers[index][start:stop] = buckets[index][start:stop]

        async def fetch_parts(self, parts, on_part):
            await fetch_parts(self.sender, parts, on_part, self.fill)

    monkeypatch.setattr(scatter_module, "plan_everywhere", plan_everywhere)
    monkeypatch.setattr(scatter_module, "RangeFetcher", Fetcher)


async def scatter(**kwargs):
    return await scatter_pull(SENDERS, "job", 1, held=None, held_version=None,
                              receiver="gateway", cluster=kwargs.pop("cluster", "rollout"),
                              source_cluster="train", **kwargs)


async def test_a_scattered_pull_from_agreeing_senders_is_exact(monkeypatch):
    manifest, buckets = _pack_dense(1, TENSORS, 1024)

    async def deliver(sender, parts, on_part, fill):
        for part in parts:
            fill(part)
            on_part(part)

    fake_senders(monkeypatch, json.dumps(manifest.to_dict()), buckets, deliver)
    got = await scatter()
    assert all(torch.equal(got.tensors[name], t) for name, t in TENSORS.items())
    assert all(got.sources.values()) and sum(got.sources.values()) == manifest.total_bytes


@pytest.mark.parametrize("manifest_json, cluster, match", [
    ("{not json", "rollout", "JSONDecodeError"),
    (json.dumps({"format": 1}), "rollout", "ManifestError"),
    (None, "train", "must not be the receiver's"),  # a topology plan_relay cannot serve
])
async def test_a_malformed_plan_or_topology_is_a_pull_error_not_a_crash(
        monkeypatch, manifest_json, cluster, match):
    manifest, buckets = _pack_dense(1, TENSORS, 1024)

    async def never(sender, parts, on_part, fill):
        raise AssertionError("no bytes are fetched for a plan that cannot be scattered")

    fake_senders(monkeypatch, manifest_json or json.dumps(manifest.to_dict()), buckets, never)
    with pytest.raises(PullError, match=match) as err:
        await scatter(cluster=cluster)
    assert err.value.code == "INTERNAL"


async def test_a_plan_naming_a_dtype_the_codec_does_not_carry_is_refused_before_a_byte_is_fetched(
        monkeypatch):
    manifest, buckets = _pack_dense(1, TENSORS, 1024)
    data = manifest.to_dict()
    data["entries"][0]["dtype"] = "complex64"

    async def never(sender, parts, on_part, fill):
        raise AssertionError("no bytes are fetched for a plan whose manifest is not valid")

    fake_senders(monkeypatch, json.dumps(data), buckets, never)
    with pytest.raises(PullError, match="ManifestError: .*dtype 'complex64'"):
        await scatter()


async def test_a_failed_scatter_returns_at_once_while_a_bucket_check_still_runs(monkeypatch):
    """Leaving the pull must not wait, on the event loop, for codec threads nobody needs."""
    manifest, buckets = _pack_dense(1, TENSORS, 1024)
    assert len(buckets) >= 2  # a share for each sender
    checksum = scatter_module.bytes_checksum

    def slow_checksum(data) -> int:
        time.sleep(1.0)
        return checksum(data)

    calls = []

    async def deliver_then_break(sender, parts, on_part, fill):
        calls.append(sender)
        if calls == ["s1"]:  # s1 delivers its own share, then both senders go away
            for part in parts:
                fill(part)
                on_part(part)
        await asyncio.sleep(0.1)  # by now s1's buckets are being checked on codec threads
        raise DataPathError(f"connection to {sender} broke", "UNAVAILABLE")

    fake_senders(monkeypatch, json.dumps(manifest.to_dict()), buckets, deliver_then_break)
    monkeypatch.setattr(scatter_module, "bytes_checksum", slow_checksum)
    started = time.perf_counter()
    with pytest.raises(PullError, match="every source agent failed"):
        await scatter()
    assert time.perf_counter() - started < 0.6
    await asyncio.sleep(0)
    checks = [t for t in asyncio.all_tasks() if t.get_coro().__qualname__ == "_BucketChecks._check"]
    assert not checks  # cancelled: no CRC of a failed pull is still awaited


async def test_a_sender_that_stalls_mid_range_fails_its_range_as_unavailable():
    """A sender that stops sending is a failed sender: its ranges can move to the others."""
    release = asyncio.Event()

    async def stall(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(status=206)
        response.content_length = 100
        await response.prepare(request)
        await response.write(b"x" * 10)
        await release.wait()
        return response

    app = web.Application()
    app.router.add_get("/v1/buckets/{index}", stall)
    runner = web.AppRunner(app, shutdown_timeout=1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        async with RangeFetcher(f"127.0.0.1:{port}", pull_request("job", 1), 0,
                                {0: bytearray(100)}, 1, read_timeout_s=0.3) as fetcher:
            with pytest.raises(DataPathError, match="connection to the agent broke") as err:
                await asyncio.wait_for(fetcher.fetch_parts([(0, 0, 100)], lambda part: None), 5)
        assert err.value.code == "UNAVAILABLE"
    finally:
        release.set()
        await runner.cleanup()
