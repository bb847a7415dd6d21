"""`rlharvest-rollout-manager`: track one RL job's rollout requests across rollout workers.
Start two per job for a hot standby: they elect a leader in etcd; the standby takes over when
the leader dies, and the trainer resumes its step there with every token (nothing generated
twice: the workers keep the dead leader's requests running for it to adopt)."""

from __future__ import annotations

import asyncio
import logging
import time
from functools import partial

from rlharvest.common import keys, registry
from rlharvest.common.cli import service_app
from rlharvest.common.etcd_outage import with_etcd
from rlharvest.common.pb import rollout_manager_pb2, rollout_manager_pb2_grpc
from rlharvest.common.service_host import Host, Loop, Parts, Servicer, ServiceSpec
from rlharvest.services.rollout_manager.balancer import RoundRobinSelect, select_instance
from rlharvest.services.rollout_manager.turn_routing import TurnRouter, TurnRouting
from rlharvest.services.rollout_manager.config import ManagerConfig
from rlharvest.services.rollout_manager.control_loop import ControlConfig, RolloutControl
from rlharvest.services.rollout_manager.failure import FailureConfig
from rlharvest.services.rollout_manager import metrics
from rlharvest.services.rollout_manager.lender import Lender
from rlharvest.services.rollout_manager.observer import ManagerObserver
from rlharvest.services.rollout_manager.reattach import Reattach
from rlharvest.services.rollout_manager.seed_window import SeedWindowObserver
from rlharvest.services.rollout_manager.service import ManagerService
from rlharvest.services.rollout_manager.stream_scaler import (
    ScalePublisher,
    ScalingObserver,
    StreamScaler,
)
from rlharvest.services.rollout_manager.tp_publisher import TpPlanning, TpPublisher
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
        refusal_hold_s=cfg.refusal_hold_s, job=cfg.job, migration_rule=cfg.migration_rule,
        prefill_tokens_per_s=cfg.prefill_tokens_per_s, migration_min_gain=cfg.migration_min_gain,
        failure=FailureConfig(stall_timeout_s=cfg.stall_timeout_s,
                              no_worker_timeout_s=cfg.no_worker_timeout_s,
                              forget_lost_after_s=cfg.forget_lost_after_s),
        limits=StepLimits(max_requests=cfg.max_step_requests, max_prompt_tokens=cfg.max_prompt_tokens,
                          max_new_tokens=cfg.max_new_tokens, vocab_size=cfg.vocab_size),
    ), clock=time.monotonic,
        select=RoundRobinSelect() if cfg.balancer == "round_robin" else select_instance,
        router=TurnRouter(TurnRouting(cfg.turn_routing), cfg.trajectory_ttl_s, time.monotonic))


async def build(host: Host[ManagerConfig]) -> Parts:
    cfg = host.config
    publisher = None
    if cfg.tp_planner:  # advisory: the plan goes to etcd, the workers keep their TP size
        publisher = TpPublisher(host.etcd, cfg.tp_planner_of(), job=cfg.job,
                                manager_id=cfg.manager_id)
        await publisher.load()  # before the first step: a restarted manager resumes
    control = build_control(cfg)
    # The shell calls them in this order at a step's end: the plan and the lent workers back
    # before the seed workers, the journal last (it keeps what the client got).
    observers: list[ManagerObserver] = []
    if publisher is not None:
        observers.append(TpPlanning(publisher))
    scale_publisher = None
    if cfg.stream_scaling:  # a trainer with --borrow-lent-threads takes the lent capacity
        scale_publisher = ScalePublisher(host.etcd, job=cfg.job)
        observers.append(ScalingObserver(StreamScaler(
            control, scale_publisher, job=cfg.job, manager_id=cfg.manager_id,
            quantile=cfg.stream_scaling_quantile, headroom=cfg.stream_scaling_headroom)))
    observers.append(SeedWindowObserver())  # RLBoost's seeding window: always on
    if cfg.reattach_grace_s > 0:  # steps whose client left run on this long
        observers.append(Reattach(cfg.reattach_grace_s))
    service = ManagerService(control, host.etcd, job=cfg.job,
                             max_message_bytes=cfg.max_message_bytes, client_queue=cfg.client_queue,
                             tick_interval_s=cfg.rebalance_interval_s, observers=observers,
                             shard=(cfg.shard_index, cfg.shards))
    workers = service.workers
    loops = [Loop("watch workers", workers.watch_workers),
             Loop("watch co-executors", workers.watch_coexecutors),
             Loop("watch instance cap", workers.watch_instance_cap),
             Loop("watch start weights", workers.watch_start_weights),
             Loop("ticks", service.run_ticks)]
    if cfg.max_serving_workers:
        lender = Lender(host.etcd, lambda: host.membership.lease if host.membership else None,
                        job=cfg.job, manager_id=cfg.manager_id, limit=cfg.max_serving_workers,
                        model=cfg.rollout_model, interval_s=cfg.lending_interval_s)
        loops.append(Loop("borrow co-executors", lender.run, on_crash="restart"))
    if publisher is not None:
        loops.append(Loop("publish TP plan", publisher.run, on_crash="restart"))
    if scale_publisher is not None:
        loops.append(Loop("publish stream scaling", scale_publisher.run, on_crash="restart"))
    service.leading = False  # until elected (lead)
    info: dict[str, object] = {"job": cfg.job, "role": "standby"}
    if cfg.shards > 1:  # the trainer's client finds each shard's leader by these
        info.update(shard=cfg.shard_index, shards=cfg.shards)
    return Parts(member_id=cfg.manager_id, member_info=info,
                 servicers=[Servicer(service, rollout_manager_pb2_grpc
                                     .add_RolloutManagerServicer_to_server, SERVICE_NAME)],
                 health=service.health, on_scrape=service.refresh_gauges,
                 serving=False,  # a standby serves once it leads
                 loops=[Loop("leadership", partial(lead, host, service, loops))],
                 stop_accepting=service.stop_accepting)


async def lead(host: Host[ManagerConfig], service: ManagerService, loops: list[Loop]) -> None:
    """Stand by until elected; then run the job's ``loops``, learn what the workers kept from
    a dead leader, and only then take steps, serve and say so (the trainer looks for role
    "leader").
    Resign when cancelled, so a standby takes over now, not after the lease TTL. A leader
    whose key expires in a long etcd outage keeps leading the steps it streams; a standby
    that took over meanwhile leads the steps submitted to it (each step has one manager)."""
    cfg = host.config
    election = registry.Election(host.etcd, keys.manager_election(
        cfg.job, cfg.shard_index, cfg.shards), host.endpoint, ttl=cfg.lease_ttl)
    try:
        log.info("manager %s for job %s standing by for leadership", cfg.manager_id, cfg.job)
        await election.campaign()
        metrics.LEADER.set(1)
        for loop in loops:
            host.start_loop(loop)
        missing = await service.workers.greet(cfg.greeting_timeout_s)
        if missing:
            log.warning("leading without a greeting from %d workers (%s) after %.1fs: requests "
                        "they kept may be generated again", len(missing), ", ".join(missing),
                        cfg.greeting_timeout_s)
        service.leading = True  # steps from now on: the kept requests are known
        await host.set_serving(True)
        assert host.membership is not None  # registered before loops start
        await with_etcd(partial(host.membership.update, role="leader"),
                        "saying so in the member record")
        log.info("manager %s leads job %s (shard %d of %d) on %s", cfg.manager_id, cfg.job,
                 cfg.shard_index, cfg.shards, host.endpoint)
        await asyncio.Event().wait()  # lead until the service stops
    finally:
        metrics.LEADER.set(0)
        await election.resign()


SPEC = ServiceSpec("rollout_manager", ManagerConfig, build, __doc__)
app = service_app(SPEC)

if __name__ == "__main__":
    app()
