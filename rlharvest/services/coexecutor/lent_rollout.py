"""The rollout side's switch (ROSE §5): lent to a job, the co-executor takes that job's rollout
requests and pulls its weights; lent to none, it refuses them with UNAVAILABLE and ends the ones
it held — each goes back to its manager as an abort with every token kept, and its pages are
freed with it. Its member record says which job it serves (``job``; the job's manager takes it
in as a worker from that) and how much of its KV pool serving used lately (``serving_kv_recent``,
what managers choose by).

A version is a job's. Lent to job B, the co-executor first drops every request it
kept for the managers of the job before, then loads its start weights as B's version 0 (the
weights it was built with; B's manager sends version-0 requests here only if they are B's start
weights, by fingerprint), and only then names B in its record: until B's weights are in, a
request of B is refused (the worker core's job fence), never generated with another job's
weights. B's puller then brings B's announced version."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING

from rlharvest.common.etcd_outage import etcd_answered, etcd_failed
from rlharvest.common.registry import Membership
from rlharvest.services.coexecutor import metrics
from rlharvest.services.coexecutor.lending import LendingChange
from rlharvest.services.rollout_worker.service import WorkerService

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

_SHARE_STEP = 0.02  # serving_kv_recent is rewritten when it moved this much (not every second)


class LentRollout:
    """``puller(job)``: the weight pull loop for a job, or None when weights come otherwise;
    ``membership()``: the member record once registered; ``recent_share()``: serving's recent
    share of the pool."""

    def __init__(self, service: WorkerService, membership: Callable[[], Membership | None],
                 puller: Callable[[str], Callable[[], Awaitable[None]] | None],
                 recent_share: Callable[[], float], job: str | None = None,
                 start: Mapping[str, torch.Tensor] | None = None) -> None:
        """``start``: the rollout model's start weights (host memory), what a job lent to it
        starts from; None: it keeps what it holds (a co-executor pinned to one job)."""
        self._service = service
        self._start = start
        self._membership = membership
        self._puller = puller
        self._recent_share = recent_share
        self.job = job
        self._pulling: asyncio.Task | None = None
        self._unwritten: set[str] = set()  # fields whose last write to the record failed
        metrics.LENT.set(job is not None)

    def lent(self) -> bool:
        return self.job is not None

    async def apply(self, change: LendingChange) -> None:
        commands = self._service.commands
        if change.job is None:
            ended = commands.end_all()
            metrics.ROLLOUT_ABORTS.labels("deactivated").inc(ended)
            log.info("lent to no job (%s): %d rollout requests go back to their manager",
                     change.reason, ended)
        commands.drop_kept("lending changed")
        self.job = change.job
        metrics.LENT.set(change.job is not None)
        metrics.LENDING_CHANGES.labels("lent" if change.job else "returned").inc()
        await self._stop_pulling()
        if change.job is not None:
            if commands.job != change.job and self._start is not None:
                await self.settle()  # the old job's manager lets go now, not after the load
                await self._service.load_weights_tensors(
                    self._start, 0, "the co-executor's start weights", change.job)
            self.start_pulling()
        await self.settle()

    @property
    def serving_job(self) -> str:
        """The job whose rollouts it takes now: lent to it and holding its weights."""
        return self.job if self.job is not None and \
            self._service.commands.job == self.job else ""

    def start_pulling(self) -> None:
        run = self._puller(self.job) if self.job is not None else None
        if run is not None:
            self._pulling = asyncio.create_task(self._pull_forever(run), name="weight puller")

    async def settle(self) -> None:
        """Bring the member record up to date (job, serving's recent use); an etcd error is
        logged and the next settle tries again."""
        membership = self._membership()
        if membership is None:
            return
        share = round(self._recent_share(), 3)
        info, unwritten = membership.info, self._unwritten
        changes: dict = {}
        if "job" in unwritten or info.get("job") != self.serving_job:
            changes["job"] = self.serving_job
        if ("serving_kv_recent" in unwritten
                or abs(info.get("serving_kv_recent", 0.0) - share) >= _SHARE_STEP):
            changes["serving_kv_recent"] = share
        if not changes:
            return
        try:
            await membership.update(**changes)
        except Exception as exc:  # etcd hiccup: the record catches up at the next settle
            # ``info`` already holds the values (any later write of the record carries them);
            # these fields are written again at the next settle even where they look current.
            unwritten.update(changes)
            etcd_failed(exc, "updating the co-executor's member record")  # an outage: once
        else:
            etcd_answered()
            unwritten.difference_update(changes)

    async def close(self) -> None:
        await self._stop_pulling()

    async def _pull_forever(self, run: Callable[[], Awaitable[None]]) -> None:
        while True:
            try:
                await run()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("weight puller crashed; restarting it in 1s")
                await asyncio.sleep(1.0)

    async def _stop_pulling(self) -> None:
        task, self._pulling = self._pulling, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
