"""Relay: an agent sources announced versions it lacks from other agents (WEAVE §5.2, ROSE §4.2
relay layer). ``replication.relay_source`` picks the source — across the slow link only the
cluster's gateway pulls, the rest of the cluster pulls the gateway's copy — and this loop moves
the bytes, as a sparse delta when this agent still holds the previous version. The gateway's
pull is scattered over every holder on the far side (scatter_pull.py); when the scatter cannot be
had (the holders serve no HTTP data path, disagree, or fail) the gateway pulls from one holder
over the gRPC stream instead. A failed relay of a version is tried again after a backoff. With
job_idle_s, a job whose latest announcement is older than that is not relayed: it is idle, and
an agent that dropped it would otherwise pull it straight back. etcd away is waited out
(etcd_outage.py): the loop pauses until etcd answers, and the agent serves what it holds."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from functools import partial

import grpc
import torch

from rlharvest.common import keys, registry, rpc
from rlharvest.common.aio import wait_event
from rlharvest.common.etcd_outage import with_etcd
from rlharvest.services.transfer_agent import metrics
from rlharvest.services.transfer_agent.client import (
    AGENT_ROLE,
    DeltaApplyError,
    PullError,
    PullResult,
    holders,
    pull,
)
from rlharvest.services.transfer_agent.config import AgentConfig
from rlharvest.services.transfer_agent.replication import relay_source
from rlharvest.services.transfer_agent.scatter_pull import Sender, scatter_pull
from rlharvest.services.transfer_agent.service import AgentService
from rlharvest.services.transfer_agent.version_store import VersionStoreError

log = logging.getLogger(__name__)

_WEIGHTS_PREFIX = keys.weights_prefix()
_POLL_S = 1.0  # a missed watch event costs at most this


class RetryBackoff:
    """When a failed relay of (job, version) may be tried again: ``first_s`` after its first
    failure, doubling per failure up to ``max_s``, so a source that keeps refusing or breaking
    is not pulled from every round."""

    def __init__(self, first_s: float, max_s: float) -> None:
        self.first_s, self.max_s = first_s, max_s
        self._retry: dict[tuple[str, int], tuple[float, float]] = {}  # key -> (at, last delay)

    def ready(self, job: str, version: int, now: float) -> bool:
        at, _ = self._retry.get((job, version), (now, 0.0))
        return now >= at

    def failed(self, job: str, version: int, now: float) -> float:
        """Note a failure; returns the seconds until the next try."""
        _, last = self._retry.get((job, version), (now, 0.0))
        delay = min(self.max_s, 2 * last if last else self.first_s)
        # Older versions of the job will not be relayed again: forget them.
        self._retry = {key: v for key, v in self._retry.items()
                       if key[0] != job or key[1] > version}
        self._retry[(job, version)] = (now + delay, delay)
        return delay

    def succeeded(self, job: str, version: int) -> None:
        self._retry.pop((job, version), None)


class Replicator:
    def __init__(self, cfg: AgentConfig, service: AgentService, etcd,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.service = service
        self.etcd = etcd
        self._wake = asyncio.Event()
        self._clock = clock
        self._backoff = RetryBackoff(cfg.relay_retry_s, cfg.relay_retry_max_s)

    async def run(self) -> None:
        watcher = asyncio.create_task(registry.wake_on_change(  # announcements and holders
            self.etcd, _WEIGHTS_PREFIX, self._wake, prefix=True, retry_delay=_POLL_S),
            name="relay watch")
        try:
            while True:
                await self._round()
                self._wake.clear()
                await wait_event(self._wake, _POLL_S)
        finally:
            watcher.cancel()

    async def _round(self) -> None:
        found = await with_etcd(partial(self.etcd.get_prefix, _WEIGHTS_PREFIX.encode()),
                                "reading the announcements to relay")
        announced = {kv.key.decode().split("/")[-2]: json.loads(kv.value)
                     for kv in found if kv.key.decode().endswith("/announced")}
        only = {j for j in self.cfg.relay_jobs.split(",") if j}
        now = time.time()  # announcements carry the announcing agent's wall clock
        for job, record in sorted(announced.items()):
            version = record["version"]
            if only and job not in only:
                continue
            # An agent drops a job job_idle_s after its last publish, relay or pull, each of
            # which ends after the announcement of the version it held was written: that
            # announcement is then at least job_idle_s old, so skipping those never pulls a
            # dropped job back. A newer one (the job resumed) is relayed as ever, and the copy
            # is kept job_idle_s at least.
            if self.cfg.job_idle_s and now - record.get("at", now) >= self.cfg.job_idle_s:
                continue
            latest = self.service.latest(job)
            if (latest is None or version > latest) and \
                    self._backoff.ready(job, version, self._clock()):
                await self._source(job, version)

    async def _source(self, job: str, version: int) -> None:
        agents = await with_etcd(partial(registry.list_members, self.etcd, "transfer_agent"),
                                 "listing the transfer agents to relay from")
        clusters = {info["agent_id"]: info.get("cluster", "default") for info in agents.values()}
        records = await with_etcd(partial(holders, self.etcd, job),
                                  f"reading job {job}'s holder records")
        having = {agent: r for agent, r in records.items()
                  if version in r.get("versions", ()) and agent in clusters}
        source = relay_source(self.cfg.agent_id, clusters, having, self.cfg.relay_mode)
        if source is None:
            return
        base = self.service.latest(job)
        held = await self.service.full_tensors(job, base) if base is not None else None
        held_sums = await self.service.sums(job, base) if base is not None else {}
        link = "cross" if clusters[source] != self.cfg.cluster else "local"
        try:
            try:
                result = await self._pull(job, version, source, clusters, having, held, base,
                                          held_sums)
            except DeltaApplyError as exc:
                # Deltas against this agent's copy of the base that do not verify (its copy of
                # that version differs from the source's): asking again would get the same
                # deltas. The version whole needs no base.
                log.warning("relay of job %s version %d: its deltas do not apply to the held "
                            "version %s (%s); pulling it dense", job, version, base, exc)
                result = await self._pull(job, version, source, clusters, having, None, None,
                                          {})
        except (grpc.aio.AioRpcError, PullError) as exc:
            delay = self._backoff.failed(job, version, self._clock())
            log.warning("relay of job %s version %d from %s failed: %s; trying again in %.1fs",
                        job, version, source, rpc.error_text(exc, AGENT_ROLE), delay)
            return
        self._backoff.succeeded(job, version)
        metrics.BYTES_IN.labels("relay").inc(result.payload_bytes)
        metrics.RELAYS.labels(link).inc()
        for agent, nbytes in result.sources.items():
            metrics.RELAY_BYTES_FROM.labels(agent).inc(nbytes)
        log.info("job %s: relayed version %d from %s over the %s link (%s, %d of %d bytes, "
                 "%.2fs)", job, version, result.sources, link,
                 "delta" if result.delta else "dense", result.payload_bytes, result.dense_bytes,
                 result.seconds)
        try:
            await self.service.hold(job, result.version, result.tensors,
                                    f"relay from {sorted(result.sources)}", sums=result.sums)
        except VersionStoreError as exc:  # a publish landed meanwhile
            log.info("relayed version %d not kept: %s", version, exc)

    async def _pull(self, job: str, version: int, source: str, clusters: dict[str, str],
                    having: dict[str, dict], held: dict[str, torch.Tensor] | None,
                    base: int | None, held_sums: dict[str, int]) -> PullResult:
        """Across the slow link, the pull is scattered over every holder of the source's
        cluster (WEAVE §5.2: one copy, from all senders at once); inside a cluster, and when
        the source is the only remote holder, it comes from ``source`` alone — and so it does,
        over the gRPC stream, when the scatter fails."""
        held_version = base if held is not None else None
        remote = clusters[source] != self.cfg.cluster
        senders = [Sender(agent, having[agent]["endpoint"]) for agent in sorted(having)
                   if clusters[agent] == clusters[source]] if remote else []
        transport = "auto"
        if len(senders) > 1:
            try:
                return await scatter_pull(
                    senders, job, version, held=held, held_version=held_version,
                    receiver=self.cfg.agent_id, cluster=self.cfg.cluster,
                    source_cluster=clusters[source], streams=self.cfg.relay_streams,
                    read_timeout_s=self.cfg.data_read_timeout_s, held_sums=held_sums)
            except DeltaApplyError:
                raise  # the source alone would send the same deltas: the caller goes dense
            except PullError as exc:
                log.warning("scattered relay of job %s version %d over %s failed (%s: %s); "
                            "pulling it from %s alone over gRPC", job, version,
                            [s.agent_id for s in senders], exc.code, exc, source)
                transport = "grpc"  # works whether or not the holder serves HTTP
        try:
            result = await pull(having[source]["endpoint"], job, version=version, held=held,
                                held_version=held_version, cluster=self.cfg.cluster,
                                streams=self.cfg.relay_streams, transport=transport,
                                read_timeout_s=self.cfg.data_read_timeout_s,
                                held_sums=held_sums)
        except (ValueError, KeyError) as exc:
            # pull turns a malformed plan or undecodable bytes into PullError itself; this
            # catches what else a bad holder record or reply raises: a failed relay to retry
            # later, not a dead agent.
            raise PullError(f"holder {source} sent a malformed pull: {exc!r}",
                            "DATA_LOSS") from exc
        result.sources = {source: result.payload_bytes}
        return result
