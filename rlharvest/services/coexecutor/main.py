"""`rlharvest-coexecutor`: serve production traffic over an OpenAI-compatible API and, inside its
SLO slack, an RL job's rollouts over the rollout worker contract (ROSE §4.1).

One process, two models, one forward at a time (``dual_engine.py``). The rollout side is the
worker core composed exactly as a rollout worker's (``WorkerService``: the Session contract,
the engine pump, drain), registered in etcd as a ``coexecutor`` member of kind ``serving`` for
its ``job``; the job's manager treats it as one more worker. The serving side is
``openai_api.py`` on ``serving_backend.py``, sharing that pump. SIGTERM drains rollout first
(its requests migrate with their tokens), then lets serving requests finish.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path

from aiohttp import web

from rlharvest.common.cli import service_app
from rlharvest.common.daemon_thread import run_in_daemon_thread
from rlharvest.common.engine_types import RequestOutput
from rlharvest.models.model_tokenizer import load_tokenizer
from rlharvest.common.pb import common_pb2, rollout_worker_pb2, rollout_worker_pb2_grpc
from rlharvest.common.service_host import Host, Loop, Parts, Servicer, ServiceSpec, StopReason
from rlharvest.common.worker_core.version_record import VersionRecord
from rlharvest.services.coexecutor.admission import (
    AdmissionPolicy,
    DualSloAdmission,
    SlackMode,
    SloConfig,
)
from rlharvest.services.coexecutor.config import CoexecutorConfig
from rlharvest.services.coexecutor.dual_engine import DualEngine
from rlharvest.services.coexecutor.lending import LendingWatch
from rlharvest.services.coexecutor.lent_rollout import LentRollout
from rlharvest.services.coexecutor.latency_profile import LatencyProfile
from rlharvest.services.coexecutor.memory_sharing import MemoryConfig, MemorySharing
from rlharvest.services.coexecutor.openai_api import ApiConfig, make_app, serve_api
from rlharvest.services.coexecutor.page_pool import Owner, PagePool
from rlharvest.services.coexecutor.rollout_admission import CoexecRolloutAdmission
from rlharvest.services.coexecutor.scheduler import CoexecScheduler
from rlharvest.services.coexecutor.serving_backend import EngineServingBackend
from rlharvest.services.rollout_worker.admission import RolloutAdmission
from rlharvest.services.rollout_worker.service import WorkerService

log = logging.getLogger("rlharvest.coexecutor")

SERVICE_NAME = rollout_worker_pb2.DESCRIPTOR.services_by_name["RolloutWorker"].full_name


def build_dual(cfg: CoexecutorConfig,
               deliver: Callable[[list[RequestOutput]], None]) -> DualEngine:
    import torch

    from rlharvest.common import engine_device
    from rlharvest.services.coexecutor.pool_pages import PoolPages
    from rlharvest.services.coexecutor.profiling import measure
    from rlharvest.services.rollout_worker.kv_pages import PageStore
    from rlharvest.services.rollout_worker.torch_engine import PagedKV, TorchEngine, kv_page_bytes

    if cfg.torch_threads:
        torch.set_num_threads(cfg.torch_threads)
    device, dtype = engine_device.resolve(cfg.device, cfg.dtype)
    pool = PagePool(cfg.total_pages, lease_s=cfg.lease_s)
    views = {owner: PoolPages(pool, cfg.page_tokens, owner,
                              prefix_reuse=cfg.prefix_cache and owner is Owner.ROLLOUT)
             for owner in Owner}
    paged: dict[Owner, PagedKV | None] = {owner: None for owner in Owner}
    if cfg.kv_memory == "pool":  # one store; each model sees its pages in its own layout
        size = max(kv_page_bytes(name, cfg.page_tokens, dtype)
                   for name in (cfg.model, cfg.serving_model))
        store = PageStore(cfg.total_pages, size, device)
        paged = {owner: PagedKV(store, cfg.page_tokens, view) for owner, view in views.items()}
    # Both models on one device in one dtype: ROSE's temporal sharing of one GPU.
    rollout = TorchEngine(model=cfg.model, seed=cfg.model_seed, max_running=cfg.max_running,
                          max_len=cfg.max_len, prefill_chunk=cfg.rollout_prefill_chunk,
                          paged=paged[Owner.ROLLOUT], device=device, dtype=dtype)
    serving = TorchEngine(model=cfg.serving_model, seed=0, max_running=cfg.serving_max_running,
                          max_len=cfg.max_len, paged=paged[Owner.SERVING], device=device,
                          dtype=dtype)
    if cfg.profile:
        profiles = json.loads(Path(cfg.profile).read_text())
        serving_profile = LatencyProfile.from_dict(profiles["serving"])
        rollout_profile = LatencyProfile.from_dict(profiles["rollout"])
    else:
        started = time.perf_counter()
        for view in views.values():  # its own requests take pool pages while it measures
            view.granting = True
        serving_profile = measure(serving, cfg.max_len)
        rollout_profile = measure(rollout, cfg.max_len)
        for view in views.values():
            view.granting = False
        log.info("latency profiles measured in %.1fs", time.perf_counter() - started)
    static = cfg.static_partition or cfg.policy == "static_partition"
    memory = MemorySharing(pool, MemoryConfig(headroom=cfg.headroom, static=static))
    tpot = cfg.tpot_slo_ms / 1000
    admission = DualSloAdmission(SloConfig(cfg.ttft_slo_ms / 1000, tpot, cfg.slo_margin),
                                 serving_profile, AdmissionPolicy(cfg.policy),
                                 SlackMode(cfg.slack_mode))
    return DualEngine(rollout, serving, scheduler=CoexecScheduler(admission,
                                                                  memory.headroom_pages),
                      memory=memory, rollout_profile=rollout_profile,
                      tokens_per_page=(cfg.page_tokens, cfg.page_tokens), deliver=deliver,
                      rollout_prefill_chunk=cfg.rollout_prefill_chunk,
                      prefix_reuse=cfg.prefix_cache)


async def build(host: Host[CoexecutorConfig]) -> Parts:
    cfg = host.config
    loop = asyncio.get_running_loop()
    backend_box: list[EngineServingBackend] = []

    def deliver(outputs: list[RequestOutput]) -> None:  # from the engine thread
        if outputs and backend_box:
            loop.call_soon_threadsafe(backend_box[0].deliver, outputs)

    # Off the event loop: a SIGTERM while the model loads stops the co-executor at once
    # (as the worker's engine build, rollout_worker/main.py).
    dual = await run_in_daemon_thread(partial(build_dual, cfg, deliver), "engine build")

    version_record = VersionRecord(lambda: host.membership, lambda: dual.weight_version,
                                   lambda: dual.start_weights)
    # Lendable: each job lent to it starts from these (lent_rollout.py); one copy of the
    # rollout model in host memory, as a placed worker keeps its start weights.
    start = None if cfg.job else await run_in_daemon_thread(dual.rollout.weights,
                                                            "start weights copy")

    admission = CoexecRolloutAdmission(
        RolloutAdmission(cfg.max_running, cfg.max_pending), dual.rollout_room_pages,
        cfg.page_tokens, lent=lambda: lending.lent())
    service = WorkerService(dual, cfg.coexec_id, endpoint=host.endpoint, model=cfg.model,
                            kind=common_pb2.WORKER_KIND_SERVING, capacity=cfg.max_running,
                            max_len=cfg.max_len, session_queue=cfg.session_queue,
                            keep_s=cfg.keep_requests_s,
                            max_pending=cfg.max_pending, on_version_change=version_record.changed,
                            admission=admission, weights_dir=cfg.weights_dir, job=cfg.job)
    backend = EngineServingBackend(dual.serving_side, max_waiting=cfg.max_waiting,
                                   pump=service.pump,
                                   slo=(cfg.ttft_slo_ms / 1000, cfg.tpot_slo_ms / 1000))
    backend_box.append(backend)
    backend.start()
    runner, http_endpoint = await _serve_openai_api(cfg, backend)
    lending = LentRollout(service, lambda: host.membership, partial(_puller, host, service),
                          lambda: dual.memory.recent_serving_share, job=cfg.job or None,
                          start=start)
    # The backend runs the loop of the pump it shares: when it ends (shutdown, a crash) the
    # requests waiting on it fail at once rather than when the HTTP server is torn down.
    loops = [Loop("engine", partial(backend.run_pump, service.run_engine))]
    if cfg.job:  # pinned: lent from the start, for good
        lending.start_pulling()
    else:
        loops.append(Loop("lending", LendingWatch(
            host.etcd, cfg.coexec_id, lending.apply, lending.settle, lapse_s=cfg.lending_lapse_s,
            probe_s=cfg.lending_probe_s).run, on_crash="restart"))

    async def drain(reason: StopReason) -> None:
        assert host.membership is not None
        await host.membership.update(draining=True)
        await service.drain(cfg.drain_timeout, "co-executor shutting down" if reason.from_signal
                            else reason.message)
        deadline = time.monotonic() + cfg.drain_timeout  # then serving finishes what it has
        while backend.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    async def close() -> None:
        await lending.close()
        await runner.cleanup()
        await backend.close()
        service.close()
        log.info("co-executor %s stopped (steps %s, rollout aborts %s)", cfg.coexec_id,
                 dict(dual.stats.steps), dict(dual.stats.aborts))

    return Parts(member_id=cfg.coexec_id, member_info=_member_info(cfg, dual, http_endpoint),
        servicers=[Servicer(service, rollout_worker_pb2_grpc.add_RolloutWorkerServicer_to_server,
                            SERVICE_NAME)],
        health=service.health, on_scrape=dual.export_gauges, loops=loops, drain=drain,
        close=[version_record.close, close])


async def _serve_openai_api(cfg: CoexecutorConfig,
                            backend: EngineServingBackend) -> tuple[web.AppRunner, str]:
    """The OpenAI-compatible API started; returns its runner and the endpoint it advertises."""
    api = ApiConfig(cfg.served_model_name, context_len=cfg.max_len,
                    max_body_bytes=cfg.max_body_bytes, body_timeout_s=cfg.http_body_timeout_s)
    runner = web.AppRunner(make_app(backend, load_tokenizer(cfg.serving_model), api),
                           handler_cancellation=True, access_log=None,
                           keepalive_timeout=cfg.http_idle_timeout_s)
    await runner.setup()
    http_port, scheme = await serve_api(runner, cfg.host, cfg.http_port)
    http_endpoint = f"{scheme}://{cfg.advertise_host or cfg.host}:{http_port}"
    log.info("co-executor %s serves %s at %s/v1 and %s", cfg.coexec_id, cfg.served_model_name,
             http_endpoint, f"job {cfg.job}'s rollouts" if cfg.job
             else "the rollouts of the job that borrows it")
    return runner, http_endpoint


def _puller(host: Host[CoexecutorConfig], service: WorkerService,
            job: str) -> Callable[[], Awaitable[None]] | None:
    """The weight puller of a job lent the co-executor (None without --agent-pull)."""
    cfg = host.config
    if not cfg.agent_pull:
        return None
    from rlharvest.services.rollout_worker.puller import Puller

    return Puller(host.etcd, service, cfg.coexec_id, job, lease_ttl=cfg.lease_ttl,
                  held_device=cfg.held_device).run


def _member_info(cfg: CoexecutorConfig, dual: DualEngine, http_endpoint: str) -> dict:
    return {
        "model": cfg.model, "kind": "serving", "capacity": cfg.max_running,
        "max_len": cfg.max_len, "weight_version": dual.weight_version, "draining": False,
        "admission": dual.batch_admission, "vocab_size": dual.vocab_size, "job": cfg.job,
        "start_weights": dual.start_weights, "lendable": not cfg.job, "serving_kv_recent": 0.0,
        "http_endpoint": http_endpoint, "served_model": cfg.served_model_name}


def _profile(args: list[str]) -> int:
    from rlharvest.services.coexecutor import profiling

    return profiling.run(args)


SPEC = ServiceSpec("coexecutor", CoexecutorConfig, build, __doc__, tools={"profile": _profile})
app = service_app(SPEC)


if __name__ == "__main__":
    app()
