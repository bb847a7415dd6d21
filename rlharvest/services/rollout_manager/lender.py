"""The rollout manager's side of lending (ROSE §5): claim serving co-executors in etcd.

Reads the co-executors' member records and every lending record, asks ``lending.plan_claims``
what to hold, and carries it out: a claim is an etcd transaction that creates
``keys.lending_key(id)`` only if absent, on this manager's lease — so one job holds a
co-executor, and the claims go when the manager does (lease revoked at shutdown, or expired
after a crash). The claimed co-executor activates, says so in its member record (``job``), and
the manager's co-executor watch takes it in as a worker of kind ``serving``. Runs again on every
change under either prefix and every ``interval_s``; a round that fails (etcd away, or an
error etcd answered with) is tried again then: every claim is one transaction, and the next
round plans from what etcd holds.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import aetcd

from rlharvest.common import keys, registry
from rlharvest.common.aio import wait_event
from rlharvest.common.etcd_outage import etcd_answered, tolerate
from rlharvest.common.lending_record import Claim, parse_claim
from rlharvest.services.rollout_manager import metrics
from rlharvest.services.rollout_manager.lending import Lendable, plan_claims

log = logging.getLogger(__name__)


class Lender:
    def __init__(self, etcd: aetcd.Client, lease: Callable[[], aetcd.Lease | None], *, job: str,
                 manager_id: str, limit: int, model: str = "", interval_s: float = 1.0) -> None:
        self._etcd = etcd
        self._lease = lease
        self._mine = Claim(job, manager_id)
        self._limit = limit
        self._model = model
        self._interval_s = interval_s
        self.held: list[str] = []

    async def run(self) -> None:
        wake = asyncio.Event()
        watchers = [asyncio.create_task(registry.wake_on_change(self._etcd, prefix, wake,
                                                                 prefix=True))
                    for prefix in (keys.members_prefix("coexecutor"), keys.lending_prefix())]
        try:
            while True:
                wake.clear()
                try:
                    await self.reconcile()
                except Exception as exc:
                    tolerate(exc, "claiming serving co-executors")  # an outage logged once
                else:
                    etcd_answered()
                await wait_event(wake, self._interval_s)
        finally:
            for watcher in watchers:
                watcher.cancel()

    async def reconcile(self) -> None:
        lease = self._lease()
        if lease is None:  # not registered yet: a claim must live on the manager's lease
            return
        members = {keys.parse_member_key(key)[1]: info
                   for key, info in (await registry.list_members(self._etcd, "coexecutor")).items()}
        found = await self._etcd.get_prefix(keys.lending_prefix().encode())
        claims = {kv.key.decode().removeprefix(keys.lending_prefix()): claim for kv in found
                  if (claim := parse_claim(kv.value)) is not None}
        plan = plan_claims({cid: Lendable.from_member(cid, info) for cid, info in members.items()},
                           claims, self._mine, limit=self._limit, model=self._model)
        for cid in plan.release:
            await self._release(cid)
        held = list(plan.kept)
        for cid in plan.candidates:
            if len(held) - len(plan.kept) >= plan.wanted:
                break
            if await self._claim(cid, lease):
                held.append(cid)
        self.held = sorted(held)
        metrics.SERVING_WORKERS.set(len(self.held))

    async def _claim(self, coexec_id: str, lease: aetcd.Lease) -> bool:
        key = keys.lending_key(coexec_id).encode()
        tx = self._etcd.transactions
        ok, _ = await self._etcd.transaction(
            compare=[tx.version(key) == 0],
            success=[tx.put(key, self._mine.encode(), lease=lease)], failure=[])
        metrics.SERVING_CLAIMS.labels("claimed" if ok else "lost_race").inc()
        if ok:
            log.info("job %s borrowed serving co-executor %s", self._mine.job, coexec_id)
        return bool(ok)

    async def _release(self, coexec_id: str) -> None:
        """Drop a claim of ours (its co-executor left or drains), only if it is still ours."""
        key = keys.lending_key(coexec_id).encode()
        tx = self._etcd.transactions
        await self._etcd.transaction(compare=[tx.value(key) == self._mine.encode()],
                                     success=[tx.delete(key)], failure=[])
        metrics.SERVING_CLAIMS.labels("released").inc()
        log.info("job %s gave back serving co-executor %s", self._mine.job, coexec_id)
