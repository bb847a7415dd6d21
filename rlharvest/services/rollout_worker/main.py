"""`rlharvest-rollout-worker`: serve one inference engine to rollout managers over gRPC."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

from rlharvest.common.cli import service_app
from rlharvest.common.daemon_thread import run_in_daemon_thread
from rlharvest.common.pb import common_pb2, rollout_worker_pb2, rollout_worker_pb2_grpc
from rlharvest.common.service_host import Host, Loop, Parts, Servicer, ServiceSpec, StopReason
from rlharvest.common.worker_core.engine import Engine
from rlharvest.common.worker_core.version_record import VersionRecord
from rlharvest.services.rollout_worker.config import WorkerConfig
from rlharvest.services.rollout_worker.placement_follower import NodeFollower
from rlharvest.services.rollout_worker.preemption_notice import wait_for_notice
from rlharvest.services.rollout_worker.service import WorkerService

if TYPE_CHECKING:
    from rlharvest.services.rollout_worker.torch_engine import TorchEngine
    from rlharvest.services.rollout_worker.vllm_engine import VllmEngine

log = logging.getLogger("rlharvest.rollout_worker")

SERVICE_NAME = rollout_worker_pb2.DESCRIPTOR.services_by_name["RolloutWorker"].full_name
KINDS = {"dedicated": common_pb2.WORKER_KIND_DEDICATED, "spot": common_pb2.WORKER_KIND_SPOT,
         "seed": common_pb2.WORKER_KIND_SEED}


def build_engine(cfg: WorkerConfig) -> Engine:
    import torch

    from rlharvest.common import engine_device

    if cfg.torch_threads:
        torch.set_num_threads(cfg.torch_threads)
    device, dtype = engine_device.resolve(cfg.device, cfg.dtype)
    engine: TorchEngine | VllmEngine
    if cfg.engine == "vllm":
        from rlharvest.services.rollout_worker.vllm_engine import VllmEngine

        engine = VllmEngine(cfg.model, max_len=cfg.max_len, max_running=cfg.max_running,
                            dtype=dtype, device=torch.device(device).type, tp_size=cfg.tp_size,
                            seed=cfg.model_seed, weight_version=cfg.weight_version,
                            kv_cache_gib=cfg.kv_cache_gib)
        log.info("engine: %s", engine.describe())
    else:
        from rlharvest.services.rollout_worker.torch_engine import TorchEngine

        engine = TorchEngine(model=cfg.model, seed=cfg.model_seed, max_running=cfg.max_running,
                             max_len=cfg.max_len, weight_version=cfg.weight_version,
                             device=device, dtype=dtype,
                             prefill_chunk=cfg.prefill_chunk, kv_pages=cfg.kv_pages,
                             page_tokens=cfg.page_tokens, kv_budget_tokens=cfg.kv_budget_tokens,
                             prefix_cache=cfg.prefix_cache,
                             prefix_lease_s=cfg.prefix_cache_lease_s)
    if cfg.weights:
        engine.load_safetensors(cfg.weights, cfg.weight_version)
    return engine


def start_engine(cfg: WorkerConfig) -> Engine:
    """The engine the worker serves: built here, or in a process of its own behind a proxy
    (``--engine-process``; the child builds it from the same config)."""
    if not cfg.engine_process:
        return build_engine(cfg)
    from rlharvest.common.worker_core.engine_process import EngineProcess

    return EngineProcess(partial(build_engine, cfg))


def placed_follower(host: Host[WorkerConfig], engine: "TorchEngine", service: WorkerService,
                    puller: Callable[[str], Any]) -> NodeFollower:
    cfg = host.config

    async def register(job: str) -> None:
        assert host.membership is not None  # loops start after the worker registered
        if not job:  # left its job: nothing it keeps for that job's managers is adoptable
            service.commands.drop_kept("left the job")
        await host.membership.update(job=job, weight_version=engine.weight_version,
                                     start_weights=engine.start_weights)

    return NodeFollower(host.etcd, cfg.placement_node, read=service.read_between_steps,
                        weights=engine.weights, version=lambda: engine.weight_version,
                        load=service.load_weights_tensors, register=register,
                        make_puller=puller if cfg.agent_pull else None,
                        resident_jobs=cfg.placement_resident_jobs)


async def build(host: Host[WorkerConfig]) -> Parts:
    cfg = host.config
    # Off the event loop, so a SIGTERM while a large checkpoint loads stops the worker at once
    # (the host cancels a build that awaits); a daemon thread, so an abandoned load does not
    # keep the process alive (rlharvest/common/daemon_thread.py).
    engine = await run_in_daemon_thread(partial(start_engine, cfg), "engine build")

    # A version loaded before the registration (a standby pulls first) reaches it too.
    version_record = VersionRecord(lambda: host.membership, lambda: engine.weight_version,
                                   lambda: engine.start_weights)

    service = WorkerService(engine, cfg.worker_id, endpoint=host.endpoint, model=cfg.model,
                            kind=KINDS[cfg.kind], capacity=cfg.max_running, max_len=cfg.max_len,
                            session_queue=cfg.session_queue, max_pending=cfg.max_pending,
                            keep_s=cfg.keep_requests_s,
                            on_version_change=version_record.changed, step_delay_s=cfg.step_delay_s,
                            weights_dir=cfg.weights_dir, job=cfg.served_job)
    loops = [Loop("engine", service.run_engine),  # a broken engine stops the worker
             *_weight_loops(host, engine, service), *_notice_loops(host)]
    outcome = ["not drained"]

    async def drain(reason: StopReason) -> None:
        assert host.membership is not None  # drain runs only after the worker registered
        await host.membership.update(draining=True)
        clean = await service.drain(cfg.drain_timeout, "worker shutting down"
                                    if reason.from_signal else reason.message)
        outcome[0] = "drained" if clean else "drain timed out"

    def close() -> None:
        service.close()
        if (close_engine := getattr(engine, "close", None)) is not None:
            close_engine()  # an engine process exits with the worker
        log.info("worker %s stopped (%s)", cfg.worker_id, outcome[0])

    info = _member_info(cfg, engine)
    return Parts(member_id=cfg.worker_id, member_info=info,
                 servicers=[Servicer(service,
                                     rollout_worker_pb2_grpc.add_RolloutWorkerServicer_to_server,
                                     SERVICE_NAME)],
                 health=service.health, loops=loops, drain=drain,
                 close=[version_record.close, close],
                 standby=partial(_standby, cfg, engine, info) if cfg.standby else None)


def _weight_loops(host: Host[WorkerConfig], engine: Engine, service: WorkerService) -> list[Loop]:
    """Where new weights come from: the placement node's turn (WEAVE), a transfer agent's
    puller, or nowhere (the worker keeps its own)."""
    cfg = host.config

    def puller(job: str):
        from rlharvest.services.rollout_worker.puller import Puller

        return Puller(host.etcd, service, cfg.worker_id, job, tp_rank=cfg.tp_rank,
                      # vLLM's TP ranks split the weights themselves: it pulls them whole
                      tp_size=1 if cfg.engine == "vllm" else cfg.tp_size, lease_ttl=cfg.lease_ttl,
                      held_device=cfg.held_device)

    if cfg.placement_node:  # WEAVE: the node's turn decides the job, and its puller with it
        from rlharvest.services.rollout_worker.torch_engine import TorchEngine

        assert isinstance(engine, TorchEngine)  # what build_engine builds
        return [Loop("placement node", placed_follower(host, engine, service, puller).run)]
    if cfg.agent_pull:
        return [Loop("weight puller", puller(cfg.served_job).run, on_crash="restart")]
    return []


def _notice_loops(host: Host[WorkerConfig]) -> list[Loop]:
    """A spot instance's preemption notice drains the worker before the cloud kills it."""
    cfg = host.config
    if not cfg.preemption_notice_url:
        return []

    async def spot_notice() -> None:
        notice = await wait_for_notice(cfg.preemption_notice_url, cfg.preemption_poll_s)
        log.warning("worker %s got a spot preemption notice; draining", cfg.worker_id)
        host.stop(f"spot preemption notice: {notice[:200]}")

    return [Loop("spot notice", spot_notice)]


def _member_info(cfg: WorkerConfig, engine: Engine) -> dict:
    return {
        "model": cfg.model, "kind": cfg.kind, "capacity": cfg.max_running, "max_len": cfg.max_len,
        "weight_version": engine.weight_version, "draining": False,
        "admission": engine.batch_admission, "vocab_size": engine.vocab_size,
        "start_weights": engine.start_weights,
        # A manager joins only the workers of its job; a placed worker's is its node's turn
        # (none at first), written once that job's weights are loaded.
        "job": cfg.served_job,
        **({"placement_node": cfg.placement_node} if cfg.placement_node else {})}


async def _standby(cfg: WorkerConfig, engine: Engine, info: dict) -> None:
    """Until SIGUSR1: the puller keeps the weights current meanwhile."""
    activated = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGUSR1, activated.set)
    try:
        await activated.wait()
    finally:
        loop.remove_signal_handler(signal.SIGUSR1)
    info["weight_version"] = engine.weight_version  # what it pulled while standing by
    log.info("worker %s activated at version %d", cfg.worker_id, engine.weight_version)


SPEC = ServiceSpec("rollout_worker", WorkerConfig, build, __doc__)
app = service_app(SPEC)


if __name__ == "__main__":
    app()
