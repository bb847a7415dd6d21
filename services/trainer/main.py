"""`rlharvest-trainer`: GRPO on one RL job's streamed completions; publishes each new version."""

from __future__ import annotations

import asyncio
import logging


from rlharvest.common import registry, rpc
from rlharvest.common.cli import service_app
from rlharvest.common.observability import setup_logging, start_http
from rlharvest.common.pb import trainer_pb2, trainer_pb2_grpc
from rlharvest.services.trainer.config import TrainerConfig
from rlharvest.services.trainer.loop import TrainerLoop, torch_threads
from rlharvest.services.trainer.service import TrainerService

log = logging.getLogger("rlharvest.trainer")
SERVICE_NAME = trainer_pb2.DESCRIPTOR.services_by_name["Trainer"].full_name
_MEMBER_REFRESH_S = 0.5



async def _advertise(loop: TrainerLoop, membership: registry.Membership) -> None:
    """Keep the member record's step and version current (rlharvest status shows them)."""
    shown = (-1, -1)
    while True:
        now = (loop.steps_done, loop.weight_version)
        if now != shown:
            await membership.update(step=now[0], weight_version=now[1],
                                    state=loop.status.state)
            shown = now
        await asyncio.sleep(_MEMBER_REFRESH_S)


async def serve(cfg: TrainerConfig, stop: asyncio.Event) -> None:
    setup_logging("trainer", cfg.log_level, cfg.json_logs)
    torch_threads(cfg.torch_threads)
    etcd = await registry.connect(cfg.etcd)
    loop = TrainerLoop(cfg, etcd)
    service = TrainerService(loop.status, trainer_id=cfg.trainer_id, job=cfg.job,
                             target_steps=cfg.steps)
    server = await rpc.start_server(
        [lambda s: trainer_pb2_grpc.add_TrainerServicer_to_server(service, s)],
        [SERVICE_NAME], cfg.host, cfg.port, cfg.max_message_bytes)
    host = cfg.advertise_host or cfg.host
    endpoint = f"{host}:{server.port}"
    http, metrics_port = await start_http(cfg.host, cfg.metrics_port, service.health)
    membership = await registry.register(etcd, "trainer", cfg.trainer_id, {
        "endpoint": endpoint, "job": cfg.job, "metrics": f"{host}:{metrics_port}",
        "step": 0, "weight_version": 0, "state": "starting"}, ttl=cfg.lease_ttl)
    log.info("trainer %s for job %s serving status on %s (metrics on %d)", cfg.trainer_id,
             cfg.job, endpoint, metrics_port)
    advertise = asyncio.create_task(_advertise(loop, membership), name="advertise")
    failure: BaseException | None = None
    try:
        await loop.restore()
        training = asyncio.create_task(loop.run(), name="training")
        stopped = asyncio.create_task(stop.wait())
        await asyncio.wait({training, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if training.done():
            failure = training.exception()
            if failure is None:
                log.info("trained %d steps; weights at version %d", loop.steps_done,
                         loop.weight_version)
                if cfg.checkpoint_dir and loop.steps_done % cfg.checkpoint_every:
                    await loop.save_checkpoint()  # the last steps are not lost to the K grid
                if not cfg.exit_when_done:
                    await stopped
        else:
            # SIGTERM mid-step: the step in progress is abandoned (nothing of it was applied);
            # the steps applied since the last checkpoint are saved so a restart loses none.
            training.cancel()
            await asyncio.gather(training, return_exceptions=True)
            if cfg.checkpoint_dir and loop.steps_done and loop.steps_done % cfg.checkpoint_every:
                await loop.save_checkpoint()
        stopped.cancel()
    finally:
        advertise.cancel()
        await asyncio.gather(advertise, return_exceptions=True)
        await server.stop(cfg.shutdown_grace)
        await membership.close()
        await http.cleanup()
        await etcd.close()
        loop.close()
    if failure is not None:
        log.error("training failed: %s", failure)
        raise SystemExit(1)
    log.info("trainer %s stopped", cfg.trainer_id)


app = service_app("rlharvest-trainer", __doc__, TrainerConfig, serve)


if __name__ == "__main__":
    app()
