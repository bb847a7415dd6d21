"""`rlharvest-rollout-worker`: serve one inference engine to rollout managers over gRPC."""

from __future__ import annotations

import asyncio
import logging


from rlharvest.common import registry, rpc
from rlharvest.common.cli import service_app
from rlharvest.common.observability import setup_logging, start_http
from rlharvest.common.pb import common_pb2, rollout_worker_pb2, rollout_worker_pb2_grpc
from rlharvest.services.rollout_worker.config import WorkerConfig
from rlharvest.services.rollout_worker.preemption_notice import wait_for_notice
from rlharvest.services.rollout_worker.service import WorkerService

log = logging.getLogger("rlharvest.rollout_worker")

SERVICE_NAME = rollout_worker_pb2.DESCRIPTOR.services_by_name["RolloutWorker"].full_name
KINDS = {"dedicated": common_pb2.WORKER_KIND_DEDICATED, "spot": common_pb2.WORKER_KIND_SPOT,
         "seed": common_pb2.WORKER_KIND_SEED}



def build_engine(cfg: WorkerConfig):
    import torch

    from rlharvest.services.rollout_worker.torch_engine import TorchEngine

    if cfg.torch_threads:
        torch.set_num_threads(cfg.torch_threads)
    engine = TorchEngine(model=cfg.model, seed=cfg.model_seed, max_running=cfg.max_running,
                         max_len=cfg.max_len, weight_version=cfg.weight_version)
    if cfg.weights:
        engine.load_safetensors(cfg.weights, cfg.weight_version)
    return engine


async def serve(cfg: WorkerConfig, stop: asyncio.Event) -> None:
    setup_logging("rollout_worker", cfg.log_level, cfg.json_logs)
    engine = build_engine(cfg)
    etcd = await registry.connect(cfg.etcd)
    membership: registry.Membership | None = None

    def on_version_change(version: int) -> None:
        if membership is not None:
            asyncio.get_running_loop().create_task(membership.update(weight_version=version))

    service = WorkerService(engine, cfg.worker_id, endpoint="", model=cfg.model,
                            kind=KINDS[cfg.kind], capacity=cfg.max_running, max_len=cfg.max_len,
                            session_queue=cfg.session_queue, max_pending=cfg.max_pending,
                            on_version_change=on_version_change,
                            step_delay_s=cfg.step_delay_s)
    server = await rpc.start_server(
        [lambda s: rollout_worker_pb2_grpc.add_RolloutWorkerServicer_to_server(service, s)],
        [SERVICE_NAME], cfg.host, cfg.port, cfg.max_message_bytes)
    endpoint = f"{cfg.advertise_host or cfg.host}:{server.port}"
    service.set_endpoint(endpoint)
    http, metrics_port = await start_http(cfg.host, cfg.metrics_port, service.health)
    engine_task = asyncio.create_task(service.run_engine(), name="engine")
    membership = await registry.register(etcd, "rollout_worker", cfg.worker_id, {
        "endpoint": endpoint, "metrics": f"{cfg.advertise_host or cfg.host}:{metrics_port}",
        "model": cfg.model, "kind": cfg.kind, "capacity": cfg.max_running, "max_len": cfg.max_len,
        "weight_version": engine.weight_version, "draining": False,
    }, ttl=cfg.lease_ttl)
    log.info("worker %s serving on %s (metrics on %d), weight version %d", cfg.worker_id,
             endpoint, metrics_port, engine.weight_version)
    puller_task = None
    if cfg.agent_pull:  # weights arrive from transfer agents; without one the worker keeps its own
        from rlharvest.services.rollout_worker.puller import Puller

        puller_task = asyncio.create_task(Puller(
            etcd, service, cfg.worker_id, cfg.job, tp_rank=cfg.tp_rank, tp_size=cfg.tp_size,
            lease_ttl=cfg.lease_ttl).run(), name="weight puller")

    stopped = asyncio.create_task(stop.wait())
    waits = {engine_task, stopped}
    notice = None
    if cfg.preemption_notice_url:
        notice = asyncio.create_task(wait_for_notice(cfg.preemption_notice_url,
                                                     cfg.preemption_poll_s), name="spot notice")
        waits.add(notice)
    done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    if engine_task in done:
        stopped.cancel()
        engine_task.result()  # re-raises: a broken engine must not look like a healthy worker

    reason = "worker shutting down"
    if notice is not None and notice in done:
        reason = f"spot preemption notice: {notice.result()[:200]}"
        log.warning("worker %s got a %s; draining", cfg.worker_id, reason)
    elif notice is not None:
        notice.cancel()
    if puller_task is not None:
        puller_task.cancel()
    await membership.update(draining=True)
    clean = await service.drain(cfg.drain_timeout, reason)
    await server.stop(cfg.shutdown_grace)
    engine_task.cancel()
    await membership.close()
    await http.cleanup()
    await etcd.close()
    service.close()
    log.info("worker %s stopped (%s)", cfg.worker_id, "drained" if clean else "drain timed out")


app = service_app("rlharvest-rollout-worker", __doc__, WorkerConfig, serve)


if __name__ == "__main__":
    app()
