"""Keeping etcd small: our own compaction by revision and a defragmentation policy.

The services write a few hundred revisions a minute. etcd keeps every revision until it is
compacted, and its file keeps its largest size until it is defragmented; at its quota (2 GiB by
default) it refuses every write. etcd's own periodic compactor is not enough: its clock starts
with the process, so an etcd restarted more often than its retention never compacts.

``MaintenancePolicy`` is the pure part: fed etcd's status (revision, file size, bytes in use) with
the time, it says "compact to revision R" — the newest revision sampled at least ``retention_s``
ago, so the last ``retention_s`` of history stays readable by watchers that fell behind — and
"defragment now" when the file is mostly free space (hysteresis: both a share and an amount of
free space, at most once per ``defrag_every_s``). Its history is the maintainer's, not etcd's:
an etcd restarted every half minute is compacted all the same.

``EtcdMaintainer`` is the shell: every ``period_s`` it asks etcd's status and applies what the
policy says, waiting out etcd being away (``etcd_outage.with_etcd``). Defragmenting needs etcd's
root role once auth is on (etcd 3.4 answers a service role "permission denied"; compacting it
allows any user), so the maintainer runs in a process holding an admin's certificate: the
launcher of a local stack (``LocalStack.start_etcd_maintenance``) or ``rlharvest etcd-maintain``.
One per etcd is enough; two are harmless: a compaction to a revision already compacted is
refused by etcd ("required revision has been compacted") and changes nothing, and a defrag of a
file just defragmented only rewrites it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import aetcd
import aetcd.rpc
from prometheus_client import Counter, Gauge

from rlharvest.common.etcd_outage import with_etcd

log = logging.getLogger(__name__)
MiB = 1024 * 1024

DB_BYTES = Gauge("rlh_etcd_db_bytes", "etcd's database file size (what its quota counts)")
DB_IN_USE_BYTES = Gauge("rlh_etcd_db_in_use_bytes",
                        "etcd's database bytes in use (the rest is free space a defrag returns)")
COMPACTED_REVISION = Gauge("rlh_etcd_compacted_revision",
                           "the revision this maintainer last compacted etcd to")
COMPACTIONS = Counter("rlh_etcd_compactions_total", "compactions this maintainer made")
DEFRAGS = Counter("rlh_etcd_defrags_total", "defragmentations this maintainer made")


@dataclass(frozen=True)
class EtcdStatus:
    """One answer of etcd's Status call, with when it came (the policy's clock)."""

    at: float
    revision: int
    db_bytes: int
    db_in_use_bytes: int


@dataclass(frozen=True)
class Compact:
    revision: int


@dataclass(frozen=True)
class Defragment:
    free_bytes: int


Action = Compact | Defragment


@dataclass(frozen=True)
class MaintenanceConfig:
    """``retention_s``: history kept; ``compact_every_s``: at most one compaction per this, so
    the history in use stays within ``retention_s`` to ``retention_s + compact_every_s``;
    a defrag when more than ``defrag_free_share`` of the file and at least
    ``defrag_min_free_bytes`` are free, at most once per ``defrag_every_s``."""

    retention_s: float = 300.0
    compact_every_s: float = 60.0
    defrag_free_share: float = 0.5
    defrag_min_free_bytes: int = 64 * MiB
    defrag_every_s: float = 3600.0

    def __post_init__(self) -> None:
        if self.retention_s <= 0 or self.compact_every_s <= 0 or self.defrag_every_s < 0:
            raise ValueError(f"{self}: retention_s and compact_every_s must be > 0, "
                             "defrag_every_s >= 0")
        if not 0 <= self.defrag_free_share < 1 or self.defrag_min_free_bytes < 0:
            raise ValueError(f"{self}: defrag_free_share must be in [0, 1), "
                             "defrag_min_free_bytes >= 0")


@dataclass
class MaintenancePolicy:
    """Synchronous and I/O-free. ``observe`` returns the actions due, already applied to its
    state: a failed one is not retried as such, the next due one covers it (a compaction to a
    later revision includes the earlier; a defrag is due again at the next interval)."""

    config: MaintenanceConfig = MaintenanceConfig()
    # (when, revision) sampled, oldest first; those older than the last compaction are dropped
    _history: deque[tuple[float, int]] = field(default_factory=deque)
    compacted: int = 0
    _compacted_at: float | None = None
    _defragged_at: float | None = None

    def observe(self, status: EtcdStatus) -> list[Action]:
        if self._history and status.revision < self._history[-1][1]:
            self._forget()  # a new etcd (its data wiped): our revisions mean nothing there
        self._history.append((status.at, status.revision))
        actions: list[Action] = []
        compact = self._compaction(status.at)
        if compact is not None:
            actions.append(compact)
        defrag = self._defrag(status)
        if defrag is not None:
            actions.append(defrag)
        return actions

    def _compaction(self, now: float) -> Compact | None:
        if self._compacted_at is not None and \
                now - self._compacted_at < self.config.compact_every_s:
            return None
        cutoff = now - self.config.retention_s
        target = None
        while self._history and self._history[0][0] <= cutoff:
            target = self._history.popleft()[1]
        if target is None or target <= self.compacted:
            return None
        self._history.appendleft((cutoff, target))  # still the newest that old: keep it
        self.compacted, self._compacted_at = target, now
        return Compact(target)

    def _defrag(self, status: EtcdStatus) -> Defragment | None:
        free = status.db_bytes - status.db_in_use_bytes
        if free < self.config.defrag_min_free_bytes or \
                free <= self.config.defrag_free_share * status.db_bytes:
            return None
        if self._defragged_at is not None and \
                status.at - self._defragged_at < self.config.defrag_every_s:
            return None
        self._defragged_at = status.at
        return Defragment(free)

    def _forget(self) -> None:
        self._history.clear()
        self.compacted, self._compacted_at = 0, None


def already_compacted(exc: BaseException) -> bool:
    """etcd's answer to a compaction at or below its compacted revision: another maintainer (or
    etcd's own compactor) got there first, and nothing is left to do."""
    return isinstance(exc, aetcd.ClientError) and "compacted" in str(exc)


@aetcd.client._handle_errors  # aetcd's own error mapping, as its calls (and registry's) use
async def etcd_status(client: aetcd.Client, now: float, timeout_s: float = 5.0) -> EtcdStatus:
    """etcd's Status with the bytes in use, which ``aetcd.Client.status`` leaves out; an
    unreachable etcd raises aetcd's connection errors, as its own calls do."""
    reply = await client.maintenancestub.Status(aetcd.rpc.StatusRequest(), timeout=timeout_s,
                                                metadata=client.metadata)
    return EtcdStatus(now, reply.header.revision, reply.dbSize, reply.dbSizeInUse)


class EtcdMaintainer:
    """Runs ``MaintenancePolicy`` against the etcd ``connect()`` reaches (a client per round:
    etcd may restart between rounds), every ``period_s``, until cancelled."""

    def __init__(self, connect: Callable[[], Awaitable[aetcd.Client]],
                 config: MaintenanceConfig = MaintenanceConfig(), period_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic):
        self._connect = connect
        self.policy = MaintenancePolicy(config)
        self.period_s = period_s
        self._clock = clock
        self.compactions = 0
        self.defrags = 0

    async def run(self) -> None:
        while True:
            try:
                await with_etcd(self.round, "maintaining etcd")
            except aetcd.ClientError as exc:  # an answer, e.g. a defrag without the root role
                log.warning("etcd maintenance: %s", exc)
            await asyncio.sleep(self.period_s)

    async def round(self) -> None:
        """One status, and the compaction and defrag it makes due."""
        client = await self._connect()
        try:
            status = await etcd_status(client, self._clock())
            DB_BYTES.set(status.db_bytes)
            DB_IN_USE_BYTES.set(status.db_in_use_bytes)
            for action in self.policy.observe(status):
                await self._apply(client, action)
        finally:
            await client.close()

    async def _apply(self, client: aetcd.Client, action: Action) -> None:
        if isinstance(action, Compact):
            try:
                await client.compact(action.revision)
            except aetcd.ClientError as exc:
                if not already_compacted(exc):
                    raise
            self.compactions += 1
            COMPACTIONS.inc()
            COMPACTED_REVISION.set(action.revision)
            log.info("etcd compacted to revision %d", action.revision)
        else:
            await client.defragment()
            self.defrags += 1
            DEFRAGS.inc()
            log.info("etcd defragmented (%.1f MiB were free)", action.free_bytes / MiB)
