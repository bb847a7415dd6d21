"""`rlharvest-transfer-agent`: hold weight versions in host memory for the workers of a node."""

from __future__ import annotations

import asyncio
import json
import logging
import time


from rlharvest.common import keys, registry, rpc
from rlharvest.common.cli import service_app
from rlharvest.common.observability import setup_logging, start_http
from rlharvest.common.pb import transfer_agent_pb2_grpc
from rlharvest.services.transfer_agent.client import SERVICE_NAME
from rlharvest.services.transfer_agent.config import AgentConfig
from rlharvest.services.transfer_agent.http_data import start_data_server
from rlharvest.services.transfer_agent.replicator import Replicator
from rlharvest.services.transfer_agent.service import AgentService
from rlharvest.services.transfer_agent.version_store import EvictionRecord

log = logging.getLogger("rlharvest.transfer_agent")



async def serve(cfg: AgentConfig, stop: asyncio.Event) -> None:
    setup_logging("transfer_agent", cfg.log_level, cfg.json_logs)
    etcd = await registry.connect(cfg.etcd)
    membership: registry.Membership | None = None
    evicted: dict[str, list[dict]] = {}

    async def on_held(job: str, version: int, records: list[EvictionRecord]) -> None:
        """A version landed: record which versions this agent holds (and what the memory bound
        evicted) under its lease, then announce it — versions only move forward."""
        notes = evicted.setdefault(job, [])
        notes.extend({"version": r.version, "reason": r.reason, "freed_bytes": r.freed_bytes,
                      "at": r.at} for r in records)
        del notes[:-16]
        await etcd.put(keys.weights_holder_key(job, cfg.agent_id).encode(), json.dumps({
            "agent_id": cfg.agent_id, "endpoint": service.endpoint, "cluster": cfg.cluster,
            "node": cfg.node, "versions": list(service.held(job)), "latest": version,
            "evicted": notes}).encode(), lease=membership.lease if membership else None)
        try:
            await registry.put_versioned(etcd, keys.weights_announced_key(job), version, {
                "agent_id": cfg.agent_id, "endpoint": service.endpoint, "at": time.time()})
        except registry.StaleVersionError:
            pass  # another agent announced this version (or a newer one) first

    service = AgentService(cfg, on_held)
    server = await rpc.start_server(
        [lambda s: transfer_agent_pb2_grpc.add_TransferAgentServicer_to_server(service, s)],
        [SERVICE_NAME], cfg.host, cfg.port, cfg.max_message_bytes)
    service.endpoint = f"{cfg.advertise_host or cfg.host}:{server.port}"
    http, metrics_port = await start_http(cfg.host, cfg.metrics_port, service.health)
    data_server = None
    if cfg.http_data_path:
        data_server, data_port = await start_data_server(service, cfg.host, cfg.data_port)
        service.data_endpoint = f"{cfg.advertise_host or cfg.host}:{data_port}"
    membership = await registry.register(etcd, "transfer_agent", cfg.agent_id, {
        "agent_id": cfg.agent_id, "endpoint": service.endpoint, "node": cfg.node,
        "cluster": cfg.cluster, "metrics": f"{cfg.advertise_host or cfg.host}:{metrics_port}",
        "data": service.data_endpoint,
    }, ttl=cfg.lease_ttl)
    loops = []
    if cfg.relay:
        loops.append(asyncio.create_task(Replicator(cfg, service, etcd).run(), name="relay"))
    log.info("agent %s (node %s, cluster %s) serving on %s (data on %s, metrics on %d)%s",
             cfg.agent_id, cfg.node, cfg.cluster, service.endpoint,
             service.data_endpoint or "gRPC only", metrics_port,
             f", relaying ({cfg.relay_mode})" if cfg.relay else "")

    stopped = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait({stopped, *loops}, return_when=asyncio.FIRST_COMPLETED)
    for task in loops:
        if task in done:
            task.result()  # a dead relay loop must take the process down, not hide
    for task in loops:
        task.cancel()
    await server.stop(cfg.shutdown_grace)
    if data_server is not None:
        await data_server.cleanup()
    await membership.close()
    await http.cleanup()
    await etcd.close()
    service.close()
    log.info("agent %s stopped", cfg.agent_id)


app = service_app("rlharvest-transfer-agent", __doc__, AgentConfig, serve)


if __name__ == "__main__":
    app()
