"""``--placement-node``: a rollout worker serves whichever job's turn its node is (WEAVE §5.1).

The placement scheduler writes, with its state, one record per node of a co-execution group
(``keys.placement_node_key``): the job whose phase the node runs now or next. The worker follows
it. When the turn passes from job A to job B it

1. leaves A (its member record says no job: A's manager stops dispatching to it and moves any
   request still open, with its tokens, to A's other workers),
2. keeps A's weights in host memory and loads B's: B's resident copy when it has served B
   before (a warm load, no transfer), else the weights it started with (a cold start), after
   which B's weight puller (``--agent-pull``) pulls B's announced version,
3. registers for B (``job`` in its record): B's manager opens a session and dispatches.

The turn, not the permit holder, is what it follows, so B's weights load while B still waits for
its permit, and the switch overlaps the gap between the two jobs' phases. At most
``resident_jobs`` jobs' weights stay resident (least recently served dropped first). Jobs that
share a node share the worker's model architecture: weights of another shape are refused.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

import torch
from prometheus_client import Counter, Gauge, Histogram

from rlharvest.common import keys, registry

log = logging.getLogger(__name__)

SWITCHES = Counter("rlh_worker_job_switches_total", "Jobs this placed worker switched to, by "
                   "how their weights loaded (warm: resident; cold: the start weights)", ["load"])
SWITCH_SECONDS = Histogram("rlh_worker_job_switch_seconds", "Leaving one job to serving the "
                           "next (weights kept, loaded, registered)",
                           buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
RESIDENT = Gauge("rlh_worker_resident_jobs", "Jobs whose weights this worker keeps in host memory")

Weights = Mapping[str, torch.Tensor]


class JobPuller(Protocol):
    """One job's weight puller (``puller.Puller``): runs until cancelled."""

    async def run(self) -> None: ...


def turn_of(raw: bytes | None) -> str:
    """The job a node record says the node serves; "" for none (no record, or a bad one)."""
    if raw is None:
        return ""
    try:
        turn = json.loads(raw).get("turn")
    except (ValueError, AttributeError):
        log.warning("node record %r is not a JSON object; serving no job", raw[:100])
        return ""
    return turn if isinstance(turn, str) else ""


class NodeFollower:
    def __init__(self, etcd: Any, node_id: str, *, snapshot: Callable[[], Weights],
                 version: Callable[[], int],
                 load: Callable[[Weights, int, str], Awaitable[Any]],
                 register: Callable[[str], Awaitable[None]],
                 make_puller: Callable[[str], JobPuller] | None = None,
                 resident_jobs: int = 2) -> None:
        self._etcd, self.node_id = etcd, node_id
        self._snapshot, self._version, self._load = snapshot, version, load
        self._register, self._make_puller = register, make_puller
        self._capacity = resident_jobs
        self.job = ""
        self._start: tuple[Weights, int] | None = None  # what a job never served before gets
        self._resident: OrderedDict[str, tuple[Weights, int]] = OrderedDict()
        self._pullers: dict[str, JobPuller] = {}
        self._pulling: asyncio.Task | None = None

    async def run(self) -> None:
        self._start = (await asyncio.to_thread(self._snapshot), self._version())
        key = keys.placement_node_key(self.node_id)
        try:
            async for event in registry.list_and_watch(self._etcd, key, prefix=False):
                raw = event.values.get(key) if isinstance(event, registry.Listing) \
                    else event.value
                job = turn_of(raw)
                if job != self.job:
                    await self.switch(job)
        finally:
            self._stop_pulling()

    async def switch(self, job: str) -> None:
        started = time.perf_counter()
        old = self.job
        # Taken out before the old job's weights go in: keeping those must not evict these.
        resident = self._resident.pop(job, None) if job else None
        if old:
            await self._register("")  # first out: the old job's manager lets go of it
            self._stop_pulling()
            self._keep(old, await asyncio.to_thread(self._snapshot), self._version())
        self.job = job
        if not job:
            log.info("node %s serves no job now (was %s)", self.node_id, old or "none")
            return
        warm = resident is not None
        assert self._start is not None, "run() takes the start weights first"
        weights, version = resident if resident is not None else self._start
        RESIDENT.set(len(self._resident))
        await self._load(weights, version, f"job {job}'s resident weights" if warm
                         else "the weights this worker started with")
        if self._make_puller is not None:
            puller = self._pullers.get(job) or self._pullers.setdefault(job,
                                                                         self._make_puller(job))
            self._pulling = asyncio.create_task(puller.run(), name=f"weight puller {job}")
        await self._register(job)
        seconds = time.perf_counter() - started
        SWITCHES.labels("warm" if warm else "cold").inc()
        SWITCH_SECONDS.observe(seconds)
        log.info("node %s: serving job %s (was %s) at weight version %d, %s load, %.3f s",
                 self.node_id, job, old or "none", version, "warm" if warm else "cold", seconds)

    def _keep(self, job: str, weights: Weights, version: int) -> None:
        self._resident[job] = (weights, version)
        self._resident.move_to_end(job)
        while len(self._resident) > self._capacity:
            dropped, _ = self._resident.popitem(last=False)
            self._pullers.pop(dropped, None)  # its held tensors go with it
            log.info("dropped the resident weights of job %s (--placement-resident-jobs %d)",
                     dropped, self._capacity)
        RESIDENT.set(len(self._resident))

    def _stop_pulling(self) -> None:
        if self._pulling is not None:
            self._pulling.cancel()
            self._pulling = None
