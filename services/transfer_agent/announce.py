"""What an agent tells etcd when a version lands: its holder record (the versions it holds and
what the memory bound evicted, under its lease, gone with it) and the job's forward-only
announcement that workers and relays watch; and, when it drops an idle job, that it holds the
job no more (the holder record deleted)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable

import aetcd

from rlharvest.common import keys, registry
from rlharvest.services.transfer_agent.config import AgentConfig
from rlharvest.services.transfer_agent.version_store import EvictionRecord

_EVICTIONS_KEPT = 16  # per job, in the holder record


class Announcer:
    """The agent service's ``on_held`` hook. ``held(job)`` lists the versions held now;
    ``membership()`` is the agent's registration (None until registered: the record then has
    no lease), ``endpoint`` its gRPC address."""

    def __init__(self, cfg: AgentConfig, etcd: aetcd.Client, endpoint: str,
                 held: Callable[[str], tuple[int, ...]],
                 membership: Callable[[], registry.Membership | None]) -> None:
        self._cfg, self._etcd, self._endpoint = cfg, etcd, endpoint
        self._held, self._membership = held, membership
        self._evicted: dict[str, list[dict]] = {}  # per job this agent announced, its notes
        # Holder records are written one at a time, so a dropped job's delete never lands after
        # the put of a publish that started the job afresh meanwhile.
        self._writing = asyncio.Lock()

    async def __call__(self, job: str, version: int, records: list[EvictionRecord]) -> None:
        notes = self._evicted.setdefault(job, [])
        notes.extend({"version": r.version, "reason": r.reason, "freed_bytes": r.freed_bytes,
                      "at": r.at} for r in records)
        del notes[:-_EVICTIONS_KEPT]
        membership = self._membership()
        if membership is not None and self.holders_again not in membership.on_registered_again:
            membership.on_registered_again.append(self.holders_again)
        async with self._writing:
            await self._put_holder(job, membership)
        try:
            await registry.put_versioned(self._etcd, keys.weights_announced_key(job), version, {
                "agent_id": self._cfg.agent_id, "endpoint": self._endpoint, "at": time.time()})
        except registry.StaleVersionError:
            pass  # another agent announced this version (or a newer one) first

    async def holders_again(self) -> None:
        """The holder records again, on the membership's new lease: the lapsed one took them
        with it, and workers find the agents that hold a version by them."""
        membership = self._membership()
        async with self._writing:
            for job in list(self._evicted):
                if self._held(job):
                    await self._put_holder(job, membership)

    async def forget(self, job: str) -> None:
        """The agent's ``on_dropped`` hook: delete the holder record of a job it dropped, so
        workers and relays stop asking it. A job published again since (it holds versions of it
        now) keeps the record that publish put."""
        async with self._writing:
            if self._held(job):
                return
            self._evicted.pop(job, None)
            await self._etcd.delete(keys.weights_holder_key(job, self._cfg.agent_id).encode())

    async def _put_holder(self, job: str, membership: registry.Membership | None) -> None:
        cfg, held = self._cfg, self._held(job)
        # Versions only move forward in the store: the newest held is the one last announced.
        await self._etcd.put(keys.weights_holder_key(job, cfg.agent_id).encode(), json.dumps({
            "agent_id": cfg.agent_id, "endpoint": self._endpoint, "cluster": cfg.cluster,
            "node": cfg.node, "versions": list(held), "latest": max(held),
            "evicted": self._evicted.get(job, [])}).encode(),
            lease=membership.lease if membership else None)
