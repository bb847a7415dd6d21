"""Who pulls from whom (RLBoost §4.3 pairing; WEAVE §5.2 one copy per slow link)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlharvest.services.transfer_agent.replication import pick_agent, relay_source


# ---- pairing workers with agents -------------------------------------------------------------


def test_no_live_agent_means_no_pairing():
    assert pick_agent([], {"w1": "gone"}) is None


def test_the_least_paired_agent_is_picked_ties_in_id_order():
    assert pick_agent(["b", "a", "c"], {}) == "a"
    assert pick_agent(["a", "b", "c"], {"w1": "a", "w2": "b"}) == "c"
    assert pick_agent(["a", "b"], {"w1": "a", "w2": "a", "w3": "b"}) == "b"


def test_pairings_to_dead_agents_do_not_count():
    assert pick_agent(["a", "b"], {"w1": "dead", "w2": "dead", "w3": "a"}) == "b"


@settings(max_examples=100, deadline=None)
@given(agents=st.lists(st.text("abcdef", min_size=1, max_size=3), min_size=1, max_size=8,
                       unique=True),
       workers=st.integers(0, 40))
def test_workers_joining_one_by_one_are_dealt_evenly(agents, workers):
    pairings: dict[str, str] = {}
    for w in range(workers):
        pairings[f"w{w}"] = pick_agent(agents, pairings)
    load = Counter(pairings.values())
    counts = [load.get(a, 0) for a in agents]
    assert max(counts) - min(counts) <= 1


# ---- where an agent sources a version --------------------------------------------------------

CLUSTERS = {"t1": "train", "t2": "train", "r1": "rollout", "r2": "rollout", "r3": "rollout"}


def test_an_agent_holding_the_version_or_with_no_holder_anywhere_pulls_nothing():
    assert relay_source("t1", CLUSTERS, {"t1"}) is None
    assert relay_source("r1", CLUSTERS, set()) is None


def test_only_the_gateway_crosses_the_slow_link_the_rest_wait():
    assert relay_source("r1", CLUSTERS, {"t1", "t2"}) == "t1"  # r1: lowest id of rollout
    assert relay_source("r2", CLUSTERS, {"t1", "t2"}) is None
    assert relay_source("r3", CLUSTERS, {"t1", "t2"}) is None


def test_once_a_cluster_holds_a_copy_the_rest_pull_it_locally():
    assert relay_source("r2", CLUSTERS, {"t1", "r1"}) == "r1"
    assert relay_source("r3", CLUSTERS, {"t1", "r1"}) == "r1"
    # Inside the source cluster too: the fast fabric first.
    assert relay_source("t2", CLUSTERS, {"t1", "r1"}) == "t1"


def test_local_sources_are_spread_over_the_holders():
    clusters = {f"r{i}": "rollout" for i in range(12)} | {"t1": "train"}
    holders = {"t1", "r0", "r1", "r2"}
    picked = {relay_source(f"r{i}", clusters, holders) for i in range(3, 12)}
    assert picked <= {"r0", "r1", "r2"} and len(picked) > 1


def test_flat_mode_makes_every_agent_cross_the_link_itself():
    for me in ("r1", "r2", "r3"):
        assert relay_source(me, CLUSTERS, {"t1", "r1"}, mode="flat") == "t1" or me == "r1"


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_gateway_mode_sends_at_most_one_copy_into_a_cluster_without_one(data):
    names = data.draw(st.lists(st.text("abcxyz", min_size=1, max_size=4), min_size=2,
                               max_size=10, unique=True))
    clusters = {a: data.draw(st.sampled_from(["c1", "c2", "c3"])) for a in names}
    holders = set(data.draw(st.lists(st.sampled_from(names), min_size=1, unique=True)))
    for cluster in set(clusters.values()):
        members = [a for a, c in clusters.items() if c == cluster]
        if any(a in holders for a in members):
            # A cluster with a copy pulls only inside itself.
            for a in members:
                src = relay_source(a, clusters, holders)
                assert src is None or clusters[src] == cluster
            continue
        crossing = [a for a in members if relay_source(a, clusters, holders) is not None]
        assert crossing == [min(members)]
        assert clusters[relay_source(min(members), clusters, holders)] != cluster


@pytest.mark.parametrize("mode", ["gateway", "flat"])
def test_an_agent_missing_from_the_topology_still_finds_a_source(mode):
    assert relay_source("new", CLUSTERS, {"t1"}, mode=mode) == "t1"
