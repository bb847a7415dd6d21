"""`rlharvest-placement-scheduler`: place RL jobs into co-execution groups and hand out their
phase run-permits (WEAVE §4, §5). Start two for a hot standby: they elect a leader in etcd."""

from __future__ import annotations

import asyncio
import logging


from rlharvest.common import keys, registry, rpc
from rlharvest.common.cli import service_app
from rlharvest.common.observability import setup_logging, start_http
from rlharvest.common.pb import placement_scheduler_pb2, placement_scheduler_pb2_grpc
from rlharvest.services.placement_scheduler import metrics
from rlharvest.services.placement_scheduler.config import PlacementConfig
from rlharvest.services.placement_scheduler.service import PlacementService

log = logging.getLogger("rlharvest.placement_scheduler")
SERVICE_NAME = placement_scheduler_pb2.DESCRIPTOR.services_by_name["PlacementScheduler"].full_name



async def serve(cfg: PlacementConfig, stop: asyncio.Event) -> None:
    setup_logging("placement_scheduler", cfg.log_level, cfg.json_logs)
    etcd = await registry.connect(cfg.etcd)
    # The servicer advertises the endpoint, known once the port is bound: set it after binding.
    service = PlacementService(cfg, etcd, "")
    add = placement_scheduler_pb2_grpc.add_PlacementSchedulerServicer_to_server
    server = await rpc.start_server([lambda s: add(service, s)], [SERVICE_NAME], cfg.host,
                                    cfg.port, cfg.max_message_bytes)
    await server.set_serving(False)  # a standby is not serving until it leads
    endpoint = f"{cfg.advertise_host or cfg.host}:{server.port}"
    service.endpoint = endpoint
    http, metrics_port = await start_http(cfg.host, cfg.metrics_port, service.health)
    membership = await registry.register(etcd, "placement_scheduler", cfg.scheduler_id, {
        "endpoint": endpoint, "role": "standby",
        "metrics": f"{cfg.advertise_host or cfg.host}:{metrics_port}"}, ttl=cfg.lease_ttl)
    metrics.LEADER.set(0)
    election = registry.Election(etcd, keys.PLACEMENT_ELECTION, endpoint, ttl=cfg.lease_ttl)
    log.info("scheduler %s on %s standing by for leadership", cfg.scheduler_id, endpoint)

    stopped = asyncio.create_task(stop.wait(), name="stop")
    deposed = asyncio.create_task(service.deposed.wait(), name="deposed")
    campaign = asyncio.create_task(election.campaign(), name="campaign")
    loops: list[asyncio.Task] = []
    try:
        done, _ = await asyncio.wait({stopped, campaign}, return_when=asyncio.FIRST_COMPLETED)
        if campaign in done:
            campaign.result()
            revision = await service.lead(election.key)
            loops = [asyncio.create_task(service.watch_liveness(revision), name="liveness"),
                     asyncio.create_task(service.check_fence(election.key), name="fence")]
            await server.set_serving(True)
            await membership.update(role="leader")
            log.info("scheduler %s leads on %s", cfg.scheduler_id, endpoint)
            done, _ = await asyncio.wait({stopped, deposed, *loops},
                                         return_when=asyncio.FIRST_COMPLETED)
            for task in loops:
                if task in done:
                    task.result()  # a loop that died must take the process down, not hide
    finally:
        service.accepting = False
        campaign.cancel()
        for task in (*loops, deposed, stopped):
            task.cancel()
        await server.stop(cfg.shutdown_grace)
        await election.resign()  # the standby takes over now, not after the lease TTL
        await membership.close()
        await http.cleanup()
        await etcd.close()
    if service.deposed.is_set():
        raise SystemExit("placement scheduler lost leadership (its election key vanished); "
                         "exiting so a supervisor restarts it as a standby")
    log.info("scheduler %s stopped", cfg.scheduler_id)


app = service_app("rlharvest-placement-scheduler", __doc__, PlacementConfig, serve)


if __name__ == "__main__":
    app()
