"""WEAVE §5.2 inter-cluster scatter of one relay pull: every holder sends a disjoint share of one
copy, and the share of a sender that dies is fetched from the others."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlharvest.common.pb import transfer_agent_pb2 as pb
from rlharvest.services.transfer_agent.client import PullError
from rlharvest.services.transfer_agent.data_path import byte_range_parts, cut_parts
from rlharvest.services.transfer_agent.http_data import DataPathError
from rlharvest.services.transfer_agent.scatter_pull import (
    Planned,
    ScatterFetch,
    Sender,
    agreeing,
    assign_parts,
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
