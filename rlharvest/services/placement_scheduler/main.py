"""`rlharvest-placement-scheduler`: place RL jobs into co-execution groups and hand out their
phase run-permits (WEAVE §4, §5). Start two for a hot standby: they elect a leader in etcd."""

from __future__ import annotations

import logging
from functools import partial

from rlharvest.common import keys, registry
from rlharvest.common.etcd_outage import with_etcd
from rlharvest.common.cli import service_app
from rlharvest.common.pb import placement_scheduler_pb2, placement_scheduler_pb2_grpc
from rlharvest.common.service_host import Host, Loop, Parts, Servicer, ServiceSpec
from rlharvest.services.placement_scheduler import metrics
from rlharvest.services.placement_scheduler.config import PlacementConfig
from rlharvest.services.placement_scheduler.service import PlacementService

log = logging.getLogger("rlharvest.placement_scheduler")
SERVICE_NAME = placement_scheduler_pb2.DESCRIPTOR.services_by_name["PlacementScheduler"].full_name


async def build(host: Host[PlacementConfig]) -> Parts:
    cfg = host.config
    service = PlacementService(cfg, host.etcd, host.endpoint)
    election = registry.Election(host.etcd, keys.PLACEMENT_ELECTION, host.endpoint,
                                 ttl=cfg.lease_ttl)
    metrics.LEADER.set(0)

    async def lead() -> None:
        """Stand by until elected, then lead until deposed; resign when cancelled, so the
        standby takes over now, not after the lease TTL."""
        try:
            log.info("scheduler %s on %s standing by for leadership", cfg.scheduler_id,
                     host.endpoint)
            await election.campaign()
            fence = election.key
            assert fence is not None  # campaign() returned: we hold our election key
            await service.lead(fence)
            host.start_loop(Loop("liveness", service.watch_liveness))
            host.start_loop(Loop("fence", lambda: service.check_fence(fence)))
            await host.set_serving(True)
            assert host.membership is not None  # registered before loops start
            await with_etcd(partial(host.membership.update, role="leader"),
                            "saying so in the member record")
            log.info("scheduler %s leads on %s", cfg.scheduler_id, host.endpoint)
            await service.deposed.wait()
            host.stop("placement scheduler lost leadership (its election key vanished); "
                      "exiting so a supervisor restarts it as a standby", exit_code=1)
        finally:
            await election.resign()

    return Parts(member_id=cfg.scheduler_id, member_info={"role": "standby"},
                 servicers=[Servicer(service, placement_scheduler_pb2_grpc
                                     .add_PlacementSchedulerServicer_to_server, SERVICE_NAME)],
                 health=service.health, serving=False,  # a standby serves once it leads
                 loops=[Loop("leadership", lead)],
                 stop_accepting=service.stop_accepting)


SPEC = ServiceSpec("placement_scheduler", PlacementConfig, build, __doc__)
app = service_app(SPEC)


if __name__ == "__main__":
    app()
