"""`rlharvest-transfer-agent`: hold weight versions in host memory for the workers of a node."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from rlharvest.common.cli import service_app
from rlharvest.common.pb import transfer_agent_pb2_grpc
from rlharvest.common.service_host import Host, Loop, Parts, Servicer, ServiceSpec
from rlharvest.services.transfer_agent.announce import Announcer
from rlharvest.services.transfer_agent.config import AgentConfig
from rlharvest.services.transfer_agent.http_data import start_data_server
from rlharvest.services.transfer_agent.protocol import SERVICE_NAME
from rlharvest.services.transfer_agent.replicator import Replicator
from rlharvest.services.transfer_agent.service import AgentService

log = logging.getLogger("rlharvest.transfer_agent")


async def build(host: Host[AgentConfig]) -> Parts:
    cfg = host.config
    announce = Announcer(cfg, host.etcd, host.endpoint, lambda job: service.held(job),
                         lambda: host.membership)
    service = AgentService(cfg, on_held=announce, on_dropped=announce.forget)
    service.endpoint = host.endpoint
    close: list[Callable[[], Awaitable[None] | None]] = []
    if cfg.http_data_path:
        data_server, data_port = await start_data_server(service, cfg.host, cfg.data_port)
        service.data_endpoint = f"{cfg.advertise_host or cfg.host}:{data_port}"
        close.append(data_server.cleanup)
    close.append(service.close)
    log.info("agent %s (node %s, cluster %s): data on %s%s; %s", cfg.agent_id, cfg.node,
             cfg.cluster, service.data_endpoint or "gRPC only",
             f", relaying ({cfg.relay_mode})" if cfg.relay else "",
             f"dropping jobs idle for {cfg.job_idle_s:g}s" if cfg.job_idle_s
             else "keeping every job (job_idle_s 0)")
    loops = [Loop("relay", Replicator(cfg, service, host.etcd).run)] if cfg.relay else []
    if cfg.job_idle_s:
        # etcd away while deleting a holder record: the dropped jobs' records are deleted at
        # its next round (forget_dropped). Restarted when it raises otherwise.
        loops.append(Loop("idle jobs", service.drop_idle_jobs, on_crash="restart"))
    return Parts(
        member_id=cfg.agent_id,
        member_info={"agent_id": cfg.agent_id, "node": cfg.node, "cluster": cfg.cluster,
                     "data": service.data_endpoint},
        servicers=[Servicer(service, transfer_agent_pb2_grpc.add_TransferAgentServicer_to_server,
                            SERVICE_NAME)],
        health=service.health,
        loops=loops,
        close=close)


SPEC = ServiceSpec("transfer_agent", AgentConfig, build, __doc__)
app = service_app(SPEC)


if __name__ == "__main__":
    app()
