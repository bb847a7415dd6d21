"""Topology-aware relay planning across clusters (WEAVE §5.2, Fig. 9; ROSE §4.2 relay layer).

A flat pull makes every agent fetch its own copy over the slow cross-cluster link. WEAVE sends
exactly one copy per slow link instead: (1) inter-cluster scatter — the version's bytes are cut
into disjoint ranges sent in parallel point-to-point streams from the source cluster's holders to
distinct agents of the receiving cluster; (2) intra-cluster broadcast — each receiver forwards its
range to every other agent of its cluster over the fast local fabric.

Here the "version" is any byte string of ``total_bytes`` (a dense version or a pull's buckets).
Deviation: WEAVE pairs N training GPUs with N rollout GPUs one to one; with S senders and R
receivers we cut max(S, R) ranges (capped by ``max_streams``) and assign them round-robin to both
sides, so neither side idles when S != R. The broadcast is a ``fanout``-ary tree per range, rooted
at that range's receiver and rotated per range so the forwarding load spreads over the cluster.
A transfer in ``round`` r depends only on transfers of earlier rounds; the plan is pure data.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass


class RelayPlanError(ValueError):
    """A topology the planner cannot serve; the message says what is wrong."""


@dataclass(frozen=True)
class Transfer:
    src: str
    dst: str
    start: int  # byte range [start, stop) of the version
    stop: int
    round: int
    cross_cluster: bool

    @property
    def nbytes(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class RelayPlan:
    total_bytes: int
    source_cluster: str
    transfers: tuple[Transfer, ...]

    @property
    def cross_cluster_bytes(self) -> int:
        return sum(t.nbytes for t in self.transfers if t.cross_cluster)

    @property
    def rounds(self) -> int:
        return 1 + max((t.round for t in self.transfers), default=-1)

    def sent_by(self, agent: str) -> int:
        return sum(t.nbytes for t in self.transfers if t.src == agent)


def split_ranges(total_bytes: int, parts: int, alignment: int = 1) -> list[tuple[int, int]]:
    """Cut [0, total_bytes) into at most ``parts`` near-equal, non-empty, contiguous ranges whose
    inner boundaries are multiples of ``alignment`` (e.g. the bucket size)."""
    if parts < 1 or alignment < 1:
        raise RelayPlanError(f"split_ranges needs parts >= 1 and alignment >= 1, got {parts}, "
                             f"{alignment}")
    units = -(-total_bytes // alignment)
    cuts = sorted({min(total_bytes, (i * units // parts) * alignment) for i in range(parts + 1)})
    cuts[-1] = total_bytes
    return [(a, b) for a, b in zip(cuts, cuts[1:]) if b > a]


def plan_relay(clusters: Mapping[str, Sequence[str]], holders: Collection[str], total_bytes: int,
               *, fanout: int = 2, max_streams: int | None = None, alignment: int = 1,
               source_cluster: str | None = None) -> RelayPlan:
    """Plan how every agent of every cluster gets the version that ``holders`` already have.

    ``clusters`` maps a cluster name to its agents. Clusters without a holder receive exactly one
    copy over their link from ``source_cluster`` (default: the cluster with the most holders)."""
    _validate(clusters, holders, total_bytes, fanout)
    source = source_cluster or max(sorted(clusters), key=lambda c: _count(clusters[c], holders))
    if source not in clusters:
        raise RelayPlanError(f"source cluster {source!r} is not in the topology "
                             f"{sorted(clusters)}")
    senders = [a for a in clusters[source] if a in holders]
    if not senders:
        raise RelayPlanError(f"source cluster {source!r} holds no copy of the version; pick a "
                             "cluster with a holder")
    transfers: list[Transfer] = []
    for name in sorted(clusters):
        agents = list(clusters[name])
        local = [a for a in agents if a in holders]
        if local:  # already has copies: spread them locally, nothing crosses a slow link
            ranges = split_ranges(total_bytes, len(local), alignment)
            roots = [local[i % len(local)] for i in range(len(ranges))]
            members = [a for a in agents if a not in holders]
            transfers += _broadcast(ranges, roots, members, fanout, first_round=0)
            continue
        streams = max(len(senders), len(agents))
        ranges = split_ranges(total_bytes, min(streams, max_streams or streams), alignment)
        roots = [agents[i % len(agents)] for i in range(len(ranges))]
        transfers += [Transfer(senders[i % len(senders)], root, a, b, 0, True)
                      for i, ((a, b), root) in enumerate(zip(ranges, roots))]
        transfers += _broadcast(ranges, roots, agents, fanout, first_round=1)
    return RelayPlan(total_bytes, source, tuple(transfers))


def _broadcast(ranges: list[tuple[int, int]], roots: list[str], members: list[str], fanout: int,
               first_round: int) -> list[Transfer]:
    """One fanout-ary tree per range over ``members`` (minus the range's root). The member order
    is rotated per range so different agents do the forwarding for different ranges."""
    transfers = []
    for i, ((start, stop), root) in enumerate(zip(ranges, roots)):
        others = [m for m in members if m != root]
        if not others:
            continue
        shift = i % len(others)
        order = [root] + others[shift:] + others[:shift]
        depth = [0] * len(order)
        for j in range(1, len(order)):
            parent = (j - 1) // fanout
            depth[j] = depth[parent] + 1
            transfers.append(Transfer(order[parent], order[j], start, stop,
                                      first_round + depth[j] - 1, False))
    return transfers


def _count(agents: Sequence[str], holders: Collection[str]) -> int:
    return sum(1 for a in agents if a in holders)


def _validate(clusters: Mapping[str, Sequence[str]], holders: Collection[str], total_bytes: int,
              fanout: int) -> None:
    if total_bytes < 0 or fanout < 1:
        raise RelayPlanError(f"total_bytes must be >= 0 and fanout >= 1 (got {total_bytes}, "
                             f"{fanout})")
    seen: dict[str, str] = {}
    for cluster, agents in clusters.items():
        if not agents:
            raise RelayPlanError(f"cluster {cluster!r} has no agents; drop it from the topology")
        for agent in agents:
            if agent in seen:
                raise RelayPlanError(f"agent {agent!r} is listed in clusters {seen[agent]!r} and "
                                     f"{cluster!r}; an agent belongs to exactly one cluster")
            seen[agent] = cluster
    stray = sorted(set(holders) - set(seen))
    if stray:
        raise RelayPlanError(f"holders {stray[:5]} are in no cluster; add them to the topology")
    if not holders:
        raise RelayPlanError("no agent holds the version yet; publish it before planning a relay")
