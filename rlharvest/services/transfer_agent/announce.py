"""What an agent tells etcd when a version lands: its holder record (the versions it holds and
what the memory bound evicted, under its lease, gone with it) and the job's forward-only
announcement that workers and relays watch; and, when it drops an idle job, that it holds the
job no more (the holder record deleted).

etcd away (etcd_outage.py): an announcement waits for it, without a deadline. The
version is held by then and versions only move forward, so a publish failed here could not be
sent again: the trainer's publish (or the relay) waits out the outage instead. Deleting a
dropped job's record is tried once per idle check: the check comes round again, and it must not
hold up the announcements behind it."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from functools import partial

import aetcd

from rlharvest.common import keys, registry
from rlharvest.common.etcd_outage import with_etcd
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
            await with_etcd(partial(self._put_holder, job, membership),
                            f"writing job {job}'s holder record")
        try:
            # Repeating it is safe: a retry after a write that landed finds the version stored.
            await with_etcd(partial(
                registry.put_versioned, self._etcd, keys.weights_announced_key(job), version,
                {"agent_id": self._cfg.agent_id, "endpoint": self._endpoint, "at": time.time()}),
                f"announcing version {version} of job {job}")
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
        now) keeps the record that publish put. One try (module doc): etcd away raises its
        error, the outage logged once, for the idle check to try again next round."""
        async with self._writing:
            if self._held(job):
                return
            self._evicted.pop(job, None)
            await with_etcd(partial(self._etcd.delete,
                                    keys.weights_holder_key(job, self._cfg.agent_id).encode()),
                            f"deleting dropped job {job}'s holder record", deadline_s=0)

    async def _put_holder(self, job: str, membership: registry.Membership | None) -> None:
        cfg, held = self._cfg, self._held(job)
        # Versions only move forward in the store: the newest held is the one last announced.
        await self._etcd.put(keys.weights_holder_key(job, cfg.agent_id).encode(), json.dumps({
            "agent_id": cfg.agent_id, "endpoint": self._endpoint, "cluster": cfg.cluster,
            "node": cfg.node, "versions": list(held), "latest": max(held),
            "evicted": self._evicted.get(job, [])}).encode(),
            lease=membership.lease if membership else None)
