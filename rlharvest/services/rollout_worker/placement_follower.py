"""``--placement-node``: a rollout worker serves whichever job's turn its node is (WEAVE §5.1).

The placement scheduler writes, with its state, one record per node of a co-execution group
(``keys.placement_node_key``): the job whose phase the node runs now or next. The worker follows
it. When the turn passes from job A to job B it

1. leaves A (its member record says no job: A's manager stops dispatching to it and moves any
   request still open, with its tokens, to A's other workers),
2. keeps A's weights in host memory and loads B's, as B's (the worker takes B's
   requests only once B's weights are in, and drops what it kept for A's managers): B's
   resident copy when it has served B before (a warm load, no transfer), else the weights it
   started with as B's version 0 (a cold start: B's manager sends version-0 requests here only
   if those are B's start weights, by fingerprint), after which B's weight puller
   (``--agent-pull``) pulls B's announced version,
3. registers for B (``job`` in its record): B's manager opens a session and dispatches.

The turn, not the permit holder, is what it follows, so B's weights load while B still waits for
its permit, and the switch overlaps the gap between the two jobs' phases. At most
``resident_jobs`` jobs' weights stay resident (least recently served dropped first). Jobs that
share a node share the worker's model architecture: weights of another shape are refused.

etcd away (etcd_outage.py): the watch of the node record lists again once etcd is back,
and a member record write waits for it, so the switch goes on from where it was.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from functools import partial
from typing import Any, Protocol

import torch
from prometheus_client import Counter, Gauge, Histogram

from rlharvest.common import keys, registry
from rlharvest.common.etcd_outage import with_etcd

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

    held: dict[str, torch.Tensor]  # the job's weights as last pulled (a resident copy)
    held_version: int | None
    pulling: bool  # a pull under way: stopped now, ``held`` may be half-updated

    async def run(self) -> None: ...

    def forget(self) -> None: ...


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
    def __init__(self, etcd: Any, node_id: str, *,
                 read: Callable[[Callable[[], Any]], Awaitable[Any]],
                 weights: Callable[[], Weights], version: Callable[[], int],
                 load: Callable[[Weights, int, str, str], Awaitable[Any]],
                 register: Callable[[str], Awaitable[None]],
                 make_puller: Callable[[str], JobPuller] | None = None,
                 resident_jobs: int = 2) -> None:
        """``read(fn)`` runs ``fn`` between engine steps (after any weight swap queued before);
        ``weights()``/``version()`` read the engine there; ``load(weights, version, source,
        job)`` swaps a job's weights in; ``register(job)`` names the job served in the member
        record ("" for none)."""
        self._etcd, self.node_id = etcd, node_id
        self._read, self._weights, self._version = read, weights, version
        self._load, self._register, self._make_puller = load, register, make_puller
        self._capacity = resident_jobs
        self.job = ""
        self._start: Weights | None = None  # what a job never served before gets, as version 0
        self._resident: OrderedDict[str, tuple[Weights, int]] = OrderedDict()
        self._pullers: dict[str, JobPuller] = {}
        self._pulling: asyncio.Task | None = None

    async def run(self) -> None:
        self._start = await self._read(self._weights)
        key = keys.placement_node_key(self.node_id)
        try:
            async for event in registry.list_and_watch(self._etcd, key, prefix=False):
                raw = event.values.get(key) if isinstance(event, registry.Listing) \
                    else event.value
                job = turn_of(raw)
                if job != self.job:
                    await self.switch(job)
        finally:
            await self._stop_pulling()

    async def switch(self, job: str) -> None:
        started = time.perf_counter()
        old = self.job
        # Taken out before the old job's weights go in: keeping those must not evict these.
        resident = self._resident.pop(job, None) if job else None
        if old:
            await self._say_serving("")  # first out: the old job's manager lets go of it
            await self._stop_pulling()
            self._keep(old, await self._resident_copy(old))
        self.job = job
        if not job:
            log.info("node %s serves no job now (was %s)", self.node_id, old or "none")
            return
        warm = resident is not None
        assert self._start is not None, "run() takes the start weights first"
        # Cold: the start weights are a job's version 0 (checked against the job's own by
        # fingerprint), whatever version this worker started them as.
        weights, version = resident if resident is not None else (self._start, 0)
        RESIDENT.set(len(self._resident))
        await self._load(weights, version, f"job {job}'s resident weights" if warm
                         else "the weights this worker started with", job)
        if self._make_puller is not None:
            if job not in self._pullers:
                self._pullers[job] = self._make_puller(job)
            self._pulling = asyncio.create_task(self._supervise(job, self._pullers[job]),
                                                name=f"weight puller {job}")
        await self._say_serving(job)
        seconds = time.perf_counter() - started
        SWITCHES.labels("warm" if warm else "cold").inc()
        SWITCH_SECONDS.observe(seconds)
        log.info("node %s: serving job %s (was %s) at weight version %d, %s load, %.3f s",
                 self.node_id, job, old or "none", version, "warm" if warm else "cold", seconds)

    async def _say_serving(self, job: str) -> None:
        """``register(job)``: a member record write, so etcd away is waited out (the loop would
        stop the worker otherwise); repeating it is harmless."""
        await with_etcd(partial(self._register, job),
                        f"naming job {job or 'none'!r} in the member record")

    async def _resident_copy(self, job: str) -> tuple[Weights, int]:
        """The leaving job's weights: its puller's held tensors when they are what the engine
        holds (no second copy in host memory), else a copy taken between engine steps."""
        version = await self._read(self._version)
        puller = self._pullers.get(job)
        if puller is not None and puller.held and puller.held_version == version:
            return puller.held, version
        return await self._read(lambda: (self._weights(), self._version()))

    def _keep(self, job: str, copy: tuple[Weights, int]) -> None:
        self._resident[job] = copy
        self._resident.move_to_end(job)
        while len(self._resident) > self._capacity:
            dropped, _ = self._resident.popitem(last=False)
            self._pullers.pop(dropped, None)  # its held tensors go with it
            log.info("dropped the resident weights of job %s (--placement-resident-jobs %d)",
                     dropped, self._capacity)
        RESIDENT.set(len(self._resident))

    @staticmethod
    async def _supervise(job: str, puller: JobPuller) -> None:
        """The job's puller for as long as the job is served; restarted if it crashes."""
        while True:
            try:
                await puller.run()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("the weight puller of job %s crashed; restarting it", job)
                await asyncio.sleep(1.0)

    async def _stop_pulling(self) -> None:
        task, self._pulling = self._pulling, None
        if task is None:
            return
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)  # its pairing lease goes now
        for puller in self._pullers.values():
            if puller.pulling:  # stopped mid-pull: its held tensors may be half a delta
                puller.forget()
