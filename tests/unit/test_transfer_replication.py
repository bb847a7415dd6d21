"""Who pulls from whom (RLBoost §4.3 pairing; WEAVE §5.2 one copy per slow link), and how the
relay loop recovers when the scatter or a source fails."""

from __future__ import annotations

import json
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlharvest.common import keys
from rlharvest.services.transfer_agent import replicator
from rlharvest.services.transfer_agent.client import PullError, PullResult
from rlharvest.services.transfer_agent.config import AgentConfig
from rlharvest.services.transfer_agent.replication import pick_agent, relay_source
from tests.builders import Clock


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


# ---- the relay loop: scatter, fall back to one holder, back off after failures ----------------


class FakeEtcd:
    """Announces version 1 of ``job-r``."""

    async def get_prefix(self, prefix: bytes):
        return [SimpleNamespace(key=keys.weights_announced_key("job-r").encode(),
                                value=json.dumps({"version": 1}).encode())]


class FakeAgent:
    def __init__(self) -> None:
        self.held: dict[int, dict] = {}
        self.sums_of: dict[int, dict[str, int]] = {}

    def latest(self, job: str) -> int | None:
        return max(self.held, default=None)

    async def full_tensors(self, job: str, version: int):
        return self.held.get(version)

    async def sums(self, job: str, version: int) -> dict[str, int]:
        return self.sums_of.get(version, {})

    async def hold(self, job: str, version: int, tensors, source: str,
                   sums: dict[str, int] | None = None):
        self.held[version] = tensors
        self.sums_of[version] = dict(sums or {})


@pytest.fixture
def relay(monkeypatch):
    """A gateway in cluster `rollout`; agents s1 and s2 of cluster `train` hold version 1."""
    members = {name: {"agent_id": name, "cluster": cluster}
               for name, cluster in (("gw", "rollout"), ("s1", "train"), ("s2", "train"))}
    records = {name: {"versions": [1], "endpoint": f"{name}:1"} for name in ("s1", "s2")}

    async def list_members(etcd, service):
        return members

    async def holders(etcd, job):
        return records

    monkeypatch.setattr(replicator.registry, "list_members", list_members)
    monkeypatch.setattr(replicator, "holders", holders)
    clock = Clock()
    agent = FakeAgent()
    cfg = AgentConfig(agent_id="gw", cluster="rollout", relay=True, relay_retry_s=1.0,
                      relay_retry_max_s=4.0)
    return replicator.Replicator(cfg, agent, FakeEtcd(), clock), agent, clock


def pulled(version: int = 1) -> PullResult:
    return PullResult(version, {"w": torch.ones(2)}, "", False, 8, 8, 0, 0.1)


async def test_a_scatter_no_holder_can_serve_falls_back_to_one_holder_over_grpc(relay, monkeypatch):
    """Holders without an HTTP data path plan no range: the gateway pulls from one of them."""
    gateway, agent, _ = relay
    pulls = []

    async def scatter_pull(senders, job, version, **kwargs):
        assert [s.agent_id for s in senders] == ["s1", "s2"]
        raise PullError("no source agent could plan this pull", "UNAVAILABLE")

    async def pull(endpoint, job, **kwargs):
        pulls.append((endpoint, kwargs["transport"]))
        return pulled()

    monkeypatch.setattr(replicator, "scatter_pull", scatter_pull)
    monkeypatch.setattr(replicator, "pull", pull)
    await gateway._round()
    assert pulls == [("s1:1", "grpc")]
    assert torch.equal(agent.held[1]["w"], torch.ones(2))


async def test_a_failing_relay_is_retried_after_a_doubling_backoff(relay, monkeypatch):
    gateway, agent, clock = relay
    tries = []

    async def scatter_pull(senders, job, version, **kwargs):
        raise PullError("every source agent failed mid-pull", "UNAVAILABLE")

    async def pull(endpoint, job, **kwargs):
        tries.append(clock.now)
        if len(tries) < 5:
            raise PullError(f"{endpoint} went away", "UNAVAILABLE")
        return pulled()

    monkeypatch.setattr(replicator, "scatter_pull", scatter_pull)
    monkeypatch.setattr(replicator, "pull", pull)
    for step in range(0, 40):  # a round every 0.5 s, as the watch and the poll would run it
        clock.now = step * 0.5
        await gateway._round()
    assert tries == [0.0, 1.0, 3.0, 7.0, 11.0]  # waits 1, 2, 4, then the 4 s cap
    assert 1 in agent.held


def test_the_backoff_forgets_a_version_once_it_succeeds_or_a_newer_one_fails():
    backoff = replicator.RetryBackoff(1.0, 30.0)
    assert backoff.failed("j", 1, now=0.0) == 1.0
    assert backoff.failed("j", 1, now=1.0) == 2.0
    assert not backoff.ready("j", 1, now=2.5) and backoff.ready("j", 1, now=3.0)
    backoff.succeeded("j", 1)
    assert backoff.failed("j", 1, now=5.0) == 1.0  # a fresh start
    backoff.failed("j", 2, now=5.0)
    assert backoff.ready("j", 1, now=5.0)  # version 1 was forgotten
    assert backoff.ready("other", 2, now=5.0)


async def test_a_malformed_pull_from_one_holder_is_a_failed_relay_not_a_dead_agent(relay,
                                                                                 monkeypatch):
    from rlharvest.services.transfer_agent.bucketing import ManifestError

    gateway, agent, clock = relay

    async def scatter_pull(senders, job, version, **kwargs):
        raise PullError("no source agent could plan this pull", "UNAVAILABLE")

    async def pull(endpoint, job, **kwargs):
        raise ManifestError("bucket 3 ends past the payload")

    monkeypatch.setattr(replicator, "scatter_pull", scatter_pull)
    monkeypatch.setattr(replicator, "pull", pull)
    await gateway._round()  # must not raise: the relay loop and the agent go on
    assert 1 not in agent.held
    assert not gateway._backoff.ready("job-r", 1, clock.now)  # it waits before the next try
