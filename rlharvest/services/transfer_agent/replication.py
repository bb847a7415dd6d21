"""Who pulls from whom: worker-to-agent pairing (RLBoost §4.3: each rollout instance pulls from
a transfer agent) and where an agent sources a version it lacks (WEAVE §5.2: one copy per slow
link, then broadcast inside the cluster). Pure functions over etcd snapshots."""

from __future__ import annotations

from collections.abc import Collection, Mapping


def pick_agent(agents: Collection[str], pairings: Mapping[str, str]) -> str | None:
    """Round-robin pairing: the live agent with the fewest paired workers, ties in id order, so
    workers joining one after another are dealt to agents in turn. ``pairings``: worker -> agent."""
    if not agents:
        return None
    load = {agent: 0 for agent in agents}
    for agent in pairings.values():
        if agent in load:
            load[agent] += 1
    return min(sorted(load), key=lambda a: load[a])


def relay_source(me: str, clusters: Mapping[str, str], holders: Collection[str],
                 mode: str = "gateway") -> str | None:
    """The agent ``me`` should pull a version from, or None to wait (or when it holds it).

    ``clusters``: live agent -> its cluster; ``holders``: live agents holding the version.
    gateway: a local holder if there is one (fast fabric); else only the cluster's gateway (its
    lowest agent id) pulls across the link, so exactly one copy crosses it and the rest of the
    cluster then pulls that copy locally. flat (the baseline): every agent pulls from a source-
    side holder itself. Local sources are spread by a hash of ``me`` so a broadcast fans out."""
    if me in holders or not holders:
        return None
    mine = clusters.get(me)
    local = sorted(h for h in holders if clusters.get(h) == mine)
    remote = sorted(h for h in holders if clusters.get(h) != mine)
    if mode == "flat":
        return (remote or local)[0]
    if local:
        return local[_spread(me) % len(local)]
    gateway = min(a for a, c in clusters.items() if c == mine) if mine is not None else me
    return remote[0] if gateway == me else None


def _spread(name: str) -> int:
    return sum(name.encode())  # stable across processes, unlike hash()
