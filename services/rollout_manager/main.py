"""`rlharvest-rollout-manager`: track one RL job's rollout requests across rollout workers."""

from __future__ import annotations

import asyncio
import logging
import time

from rlharvest.common import registry, rpc
from rlharvest.common.cli import service_app
from rlharvest.common.observability import setup_logging, start_http
from rlharvest.common.pb import rollout_manager_pb2, rollout_manager_pb2_grpc
from rlharvest.services.rollout_manager.balancer import RoundRobinSelect, select_instance
from rlharvest.services.rollout_manager.config import ManagerConfig
from rlharvest.services.rollout_manager.control_loop import ControlConfig, RolloutControl
from rlharvest.services.rollout_manager.failure import FailureConfig
from rlharvest.services.rollout_manager.service import ManagerService
from rlharvest.services.rollout_manager.tracker import StepLimits

log = logging.getLogger("rlharvest.rollout_manager")
SERVICE_NAME = rollout_manager_pb2.DESCRIPTOR.services_by_name["RolloutManager"].full_name

# Baselines dispatch every request at once: Θ so large that SELECTINSTANCE never holds one.
_NEVER_HOLD = 1_000_000_000


def build_control(cfg: ManagerConfig) -> RolloutControl:
    baseline = cfg.balancer != "algorithm2"
    return RolloutControl(ControlConfig(
        theta=_NEVER_HOLD if baseline else cfg.theta, continuous_lb=not baseline,
        recompute_on_loss=cfg.recompute_on_loss, max_moves_per_tick=cfg.max_moves_per_round,
        failure=FailureConfig(stall_timeout_s=cfg.stall_timeout_s,
                              no_worker_timeout_s=cfg.no_worker_timeout_s),
        limits=StepLimits(max_requests=cfg.max_step_requests, max_prompt_tokens=cfg.max_prompt_tokens,
                          max_new_tokens=cfg.max_new_tokens, vocab_size=cfg.vocab_size),
    ), clock=time.monotonic,
        select=RoundRobinSelect() if cfg.balancer == "round_robin" else select_instance)


async def serve(cfg: ManagerConfig, stop: asyncio.Event) -> None:
    setup_logging("rollout_manager", cfg.log_level, cfg.json_logs)
    etcd = await registry.connect(cfg.etcd)
    service = ManagerService(build_control(cfg), etcd, job=cfg.job,
                             max_message_bytes=cfg.max_message_bytes,
                             client_queue=cfg.client_queue, tick_interval_s=cfg.rebalance_interval_s)
    server = await rpc.start_server(
        [lambda s: rollout_manager_pb2_grpc.add_RolloutManagerServicer_to_server(service, s)],
        [SERVICE_NAME], cfg.host, cfg.port, cfg.max_message_bytes)
    endpoint = f"{cfg.advertise_host or cfg.host}:{server.port}"
    http, metrics_port = await start_http(cfg.host, cfg.metrics_port, service.health,
                                          on_scrape=service.refresh_gauges)
    loops = [asyncio.create_task(service.watch_workers(), name="watch workers"),
             asyncio.create_task(service.run_ticks(), name="ticks")]
    membership = await registry.register(etcd, "rollout_manager", cfg.manager_id, {
        "endpoint": endpoint, "job": cfg.job,
        "metrics": f"{cfg.advertise_host or cfg.host}:{metrics_port}"}, ttl=cfg.lease_ttl)
    log.info("manager %s for job %s serving on %s", cfg.manager_id, cfg.job, endpoint)

    stopped = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait({stopped, *loops}, return_when=asyncio.FIRST_COMPLETED)
    for task in loops:
        if task in done:
            task.result()  # a loop that died must take the process down, not hide
    service.accepting = False
    await server.stop(cfg.shutdown_grace)
    for task in loops:
        task.cancel()
    await membership.close()
    await http.cleanup()
    await etcd.close()
    log.info("manager %s stopped", cfg.manager_id)


app = service_app("rlharvest-rollout-manager", __doc__, ManagerConfig, serve)

if __name__ == "__main__":
    app()
