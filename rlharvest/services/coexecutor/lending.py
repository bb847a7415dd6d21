"""A co-executor's side of lending (ROSE §5): serve a job's rollouts while a claim says so.

``LendingState`` is the pure part: given each read of the co-executor's lending record (or a
failed read), it says when to activate for a job and when to deactivate. ``LendingWatch`` is the
shell: it reads the record on every change and every ``probe_s``, and hands the changes on.

A claim that disappears (the manager released it, or its lease ended with the manager) ends the
lending at once. When etcd cannot be read for ``lapse_s`` the lending lapses as well [ours; the
paper does not say]: the claiming manager may be gone and nobody could tell us, and a rollout
request held meanwhile would wait on a manager that will not come back for it. Serving does not
depend on etcd and goes on either way.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aetcd

from rlharvest.common import keys, registry
from rlharvest.common.aio import wait_event, wait_for
from rlharvest.common.etcd_outage import etcd_answered, tolerate
from rlharvest.common.lending_record import Claim, parse_claim

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LendingChange:
    job: str | None  # the job to serve from now on; None: lent to nobody
    reason: str


class LendingState:
    def __init__(self, lapse_s: float) -> None:
        if not lapse_s > 0:
            raise ValueError(f"lapse_s must be > 0, got {lapse_s}")
        self.job: str | None = None
        self._lapse_s = lapse_s
        self._confirmed = -math.inf

    def observe(self, claim: Claim | None, now: float) -> list[LendingChange]:
        """The lending record as read at ``now``."""
        self._confirmed = now
        job = claim.job if claim is not None else None
        if job == self.job:
            return []
        changes = []
        if self.job is not None:
            changes.append(LendingChange(None, f"job {self.job}'s claim ended"))
        if job is not None:
            changes.append(LendingChange(job, f"claimed by manager {claim.manager}"
                                         if claim is not None else ""))
        self.job = job
        return changes

    def unreachable(self, now: float) -> list[LendingChange]:
        """The record could not be read at ``now``."""
        if self.job is None or now - self._confirmed < self._lapse_s:
            return []
        self.job = None
        return [LendingChange(None, f"etcd unreadable for {self._lapse_s:.0f}s: the lending "
                                    "lapses")]


class LendingWatch:
    """Feeds ``on_change`` the changes of ``coexec_id``'s lending; calls ``settle`` after each
    read that succeeded (the shell's chance to bring its member record up to date)."""

    def __init__(self, etcd: aetcd.Client, coexec_id: str,
                 on_change: Callable[[LendingChange], Awaitable[None]],
                 settle: Callable[[], Awaitable[None]], *, lapse_s: float, probe_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._etcd = etcd
        self._key = keys.lending_key(coexec_id)
        self._on_change = on_change
        self._settle = settle
        self._probe_s = probe_s
        self._clock = clock
        self.state = LendingState(lapse_s)

    async def run(self) -> None:
        wake = asyncio.Event()
        watcher = asyncio.create_task(registry.wake_on_change(self._etcd, self._key, wake,
                                                              retry_delay=self._probe_s))
        try:
            while True:
                wake.clear()
                readable, claim = await self._read()
                changes = (self.state.observe(claim, self._clock()) if readable
                           else self.state.unreachable(self._clock()))
                for change in changes:
                    log.info("lending: %s (%s)", f"now serving job {change.job}'s rollouts"
                             if change.job else "lent to no job", change.reason)
                    await self._on_change(change)
                if readable:
                    await self._settle()
                await wait_event(wake, self._probe_s)
        finally:
            watcher.cancel()

    async def _read(self) -> tuple[bool, Claim | None]:
        """(whether etcd answered, the claim it holds)."""
        try:
            found = await wait_for(self._etcd.get(self._key.encode()), self._probe_s)
        except Exception as exc:  # the lending lapses after lapse_s of these
            tolerate(exc, "reading the co-executor's lending record")
            return False, None
        etcd_answered()
        return True, parse_claim(found.value if found is not None else None)
