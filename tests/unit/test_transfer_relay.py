"""WEAVE §5.2: exactly one copy over each slow link, scattered in parallel, then broadcast."""

from __future__ import annotations

from collections import defaultdict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlharvest.services.transfer_agent.relay import (
    RelayPlan,
    RelayPlanError,
    plan_relay,
    split_ranges,
)


@st.composite
def topologies(draw):
    sizes = draw(st.lists(st.integers(1, 9), min_size=1, max_size=4))
    clusters = {f"c{i}": [f"c{i}-a{j}" for j in range(n)] for i, n in enumerate(sizes)}
    agents = [a for members in clusters.values() for a in members]
    holders = draw(st.lists(st.sampled_from(agents), min_size=1, unique=True))
    total = draw(st.integers(0, 10_000))
    fanout = draw(st.integers(1, 4))
    alignment = draw(st.sampled_from([1, 7, 64]))
    return clusters, set(holders), total, fanout, alignment


def execute(plan: RelayPlan, holders: set[str]) -> dict[str, list[tuple[int, int]]]:
    """Run the plan round by round; a sender must hold a byte range before it sends it."""
    held: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for agent in holders:
        held[agent].append((0, plan.total_bytes))
    for round_ in range(plan.rounds):
        arriving = []
        for t in plan.transfers:
            if t.round == round_:
                assert covers(held[t.src], t.start, t.stop), f"{t.src} sends bytes it lacks: {t}"
                arriving.append(t)
        for t in arriving:
            held[t.dst].append((t.start, t.stop))
    return held


def covers(ranges: list[tuple[int, int]], start: int, stop: int) -> bool:
    at = start
    for a, b in sorted(ranges):
        if a <= at < b:
            at = b
    return at >= stop


@settings(max_examples=300, deadline=None)
@given(topologies())
def test_every_agent_ends_with_the_whole_version_and_senders_hold_what_they_send(topology):
    clusters, holders, total, fanout, alignment = topology
    plan = plan_relay(clusters, holders, total, fanout=fanout, alignment=alignment)
    held = execute(plan, holders)
    for members in clusters.values():
        for agent in members:
            assert covers(held[agent], 0, total), agent


@settings(max_examples=300, deadline=None)
@given(topologies())
def test_exactly_one_copy_crosses_each_slow_link(topology):
    clusters, holders, total, fanout, alignment = topology
    plan = plan_relay(clusters, holders, total, fanout=fanout, alignment=alignment)
    cluster_of = {a: c for c, members in clusters.items() for a in members}
    per_link: dict[tuple[str, str], list[tuple[int, int]]] = defaultdict(list)
    for t in plan.transfers:
        src, dst = cluster_of[t.src], cluster_of[t.dst]
        assert t.cross_cluster == (src != dst)
        if t.cross_cluster:
            per_link[(src, dst)].append((t.start, t.stop))
    lacking = [c for c, members in clusters.items() if not holders & set(members)]
    assert plan.cross_cluster_bytes == total * len(lacking)
    for (_, dst), ranges in per_link.items():  # disjoint ranges that tile the version once
        assert dst in lacking
        ordered = sorted(ranges)
        assert ordered[0][0] == 0 and ordered[-1][1] == total
        assert all(a[1] == b[0] for a, b in zip(ordered, ordered[1:]))


def test_scatter_uses_parallel_streams_from_every_source_holder():
    clusters = {"train": [f"t{i}" for i in range(4)], "rollout": [f"r{i}" for i in range(8)]}
    plan = plan_relay(clusters, set(clusters["train"]), 8_000)
    scatter = [t for t in plan.transfers if t.cross_cluster]
    assert len(scatter) == 8 and {t.dst for t in scatter} == set(clusters["rollout"])
    assert {t.src: plan.sent_by(t.src) for t in scatter} == {f"t{i}": 2_000 for i in range(4)}


def test_flat_pull_would_send_one_copy_per_agent_the_relay_sends_one():
    clusters = {"train": ["t0", "t1"], "rollout": [f"r{i}" for i in range(16)]}
    plan = plan_relay(clusters, {"t0", "t1"}, 1 << 20)
    assert plan.cross_cluster_bytes == 1 << 20  # a flat pull: 16 << 20
    forwarded = [plan.sent_by(a) for a in clusters["rollout"]]
    assert max(forwarded) <= 2 * (1 << 20)  # the broadcast load is spread, not on one root


def test_ranges_align_to_bucket_boundaries():
    ranges = split_ranges(10 * 64 + 5, 4, alignment=64)
    assert ranges[0][0] == 0 and ranges[-1][1] == 645
    assert all(a % 64 == 0 for a, _ in ranges)


def test_bad_topologies_are_refused():
    with pytest.raises(RelayPlanError, match="exactly one cluster"):
        plan_relay({"a": ["x"], "b": ["x"]}, {"x"}, 10)
    with pytest.raises(RelayPlanError, match="no agent holds"):
        plan_relay({"a": ["x"]}, set(), 10)
    with pytest.raises(RelayPlanError, match="in no cluster"):
        plan_relay({"a": ["x"]}, {"y"}, 10)
    with pytest.raises(RelayPlanError, match="holds no copy"):
        plan_relay({"a": ["x"], "b": ["y"]}, {"x"}, 10, source_cluster="b")
