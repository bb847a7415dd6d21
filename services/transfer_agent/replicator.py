"""Relay: an agent sources announced versions it lacks from other agents (WEAVE §5.2, ROSE §4.2
relay layer). ``replication.relay_source`` picks the source — across the slow link only the
cluster's gateway pulls, the rest of the cluster pulls the gateway's copy — and this loop moves
the bytes, as a sparse delta when this agent still holds the previous version. The gateway's
pull is scattered over every holder on the far side (scatter_pull.py)."""

from __future__ import annotations

import asyncio
import json
import logging

import grpc
import torch

from rlharvest.common import keys, registry
from rlharvest.services.transfer_agent import metrics
from rlharvest.services.transfer_agent.client import PullError, PullResult, holders, pull
from rlharvest.services.transfer_agent.config import AgentConfig
from rlharvest.services.transfer_agent.replication import relay_source
from rlharvest.services.transfer_agent.scatter_pull import Sender, scatter_pull
from rlharvest.services.transfer_agent.service import AgentService
from rlharvest.services.transfer_agent.version_store import VersionStoreError

log = logging.getLogger(__name__)

_WEIGHTS_PREFIX = f"{keys.ROOT}/weights/"
_POLL_S = 1.0  # a missed watch event costs at most this


class Replicator:
    def __init__(self, cfg: AgentConfig, service: AgentService, etcd) -> None:
        self.cfg = cfg
        self.service = service
        self.etcd = etcd
        self._wake = asyncio.Event()

    async def run(self) -> None:
        watcher = asyncio.create_task(self._watch(), name="relay watch")
        try:
            while True:
                await self._round()
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), _POLL_S)
                except asyncio.TimeoutError:
                    pass
        finally:
            watcher.cancel()

    async def _watch(self) -> None:
        """Wake the loop on any announcement or holder change (agents, versions)."""
        while True:
            try:
                watch = await self.etcd.watch_prefix(_WEIGHTS_PREFIX.encode())
                try:
                    async for _ in watch:
                        self._wake.set()
                finally:
                    await watch.cancel()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("relay watch broke (%r); polling until it is back", exc)
                await asyncio.sleep(_POLL_S)

    async def _round(self) -> None:
        found = await self.etcd.get_prefix(_WEIGHTS_PREFIX.encode())
        announced = {kv.key.decode().split("/")[-2]: json.loads(kv.value)["version"]
                     for kv in found if kv.key.decode().endswith("/announced")}
        only = {j for j in self.cfg.relay_jobs.split(",") if j}
        for job, version in sorted(announced.items()):
            if only and job not in only:
                continue
            latest = self.service.latest(job)
            if latest is None or version > latest:
                await self._source(job, version)

    async def _source(self, job: str, version: int) -> None:
        agents = await registry.list_members(self.etcd, "transfer_agent")
        clusters = {info["agent_id"]: info.get("cluster", "default") for info in agents.values()}
        records = await holders(self.etcd, job)
        having = {agent: r for agent, r in records.items()
                  if version in r.get("versions", ()) and agent in clusters}
        source = relay_source(self.cfg.agent_id, clusters, having, self.cfg.relay_mode)
        if source is None:
            return
        base = self.service.latest(job)
        held = await self.service.full_tensors(job, base) if base is not None else None
        link = "cross" if clusters[source] != self.cfg.cluster else "local"
        try:
            result = await self._pull(job, version, source, clusters, having, held, base)
        except (grpc.aio.AioRpcError, PullError) as exc:
            log.warning("relay of job %s version %d from %s failed: %s; trying again", job,
                        version, source,
                        exc.details() if isinstance(exc, grpc.aio.AioRpcError) else exc)
            return
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
                                    f"relay from {sorted(result.sources)}")
        except VersionStoreError as exc:  # a publish landed meanwhile
            log.info("relayed version %d not kept: %s", version, exc)

    async def _pull(self, job: str, version: int, source: str, clusters: dict[str, str],
                    having: dict[str, dict], held: dict[str, torch.Tensor] | None,
                    base: int | None) -> PullResult:
        """Across the slow link, the pull is scattered over every holder of the source's
        cluster (WEAVE §5.2: one copy, from all senders at once); inside a cluster, and when
        the source is the only remote holder, it comes from ``source`` alone."""
        held_version = base if held is not None else None
        remote = clusters[source] != self.cfg.cluster
        senders = [Sender(agent, having[agent]["endpoint"]) for agent in sorted(having)
                   if clusters[agent] == clusters[source]] if remote else []
        if len(senders) > 1:
            return await scatter_pull(senders, job, version, held=held, held_version=held_version,
                                      receiver=self.cfg.agent_id, cluster=self.cfg.cluster,
                                      source_cluster=clusters[source],
                                      streams=self.cfg.relay_streams)
        result = await pull(having[source]["endpoint"], job, version=version, held=held,
                            held_version=held_version, cluster=self.cfg.cluster,
                            streams=self.cfg.relay_streams)
        result.sources = {source: result.payload_bytes}
        return result
