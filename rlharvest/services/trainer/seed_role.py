"""RLBoost's seeding window, the trainer's side (§4.1): the training cluster's own engine.

With ``--seed-role`` the trainer process also serves the ``RolloutWorker`` contract on its gRPC
port: an in-process torch engine (the worker core's ``WorkerService``, as every worker) joins
the job as a worker of kind ``seed``. It holds the trainer's current weights — handed over in
memory after each optimizer step, no transfer agent — so during the step's window [0, T_seed]
the manager dispatches to it like any worker; when the window closes the manager moves its
requests, with every token, to the remote workers (``rollout_manager/seed_window.py``) and the
trainer trains. T_seed is Algorithm 1's (``seeding_window.py``, through ``instance_cap.py``).

One rank only: the weights are the whole model, which a sharded publish never assembles.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Mapping
from functools import partial
from typing import TYPE_CHECKING

from rlharvest.common import registry
from rlharvest.common.etcd_outage import with_etcd
from rlharvest.common.pb import common_pb2, rollout_worker_pb2, rollout_worker_pb2_grpc
from rlharvest.common.service_host import Servicer
from rlharvest.services.rollout_worker.config import WorkerConfig
from rlharvest.services.rollout_worker.service import WorkerService
from rlharvest.services.trainer.config import TrainerConfig

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

_SERVICE_NAME = rollout_worker_pb2.DESCRIPTOR.services_by_name["RolloutWorker"].full_name


def _agentic_cache(cfg: TrainerConfig) -> dict:
    """With ``--env``, the seed engine keeps a prefix cache as the workers do (their default
    page size): a turn re-reads the trajectory's whole history, which its previous turn left
    in the cache when it ran here. Pages for the running requests twice over: as many again
    stay cached."""
    if not cfg.env:
        return {}
    page_tokens = WorkerConfig.model_fields["page_tokens"].default
    pages = 2 * cfg.seed_max_running * math.ceil(cfg.seed_max_len / page_tokens)
    return {"kv_pages": pages, "page_tokens": page_tokens, "prefix_cache": True}


class SeedRole:
    def __init__(self, cfg: TrainerConfig, etcd, endpoint: str) -> None:
        from rlharvest.services.rollout_worker.torch_engine import TorchEngine
        from rlharvest.services.trainer.device import rank_device, served_dtype

        self.worker_id = f"{cfg.trainer_id}-seed"
        self._etcd, self._cfg = etcd, cfg
        # The workers' dtype: a request handed over mid-flight goes on in the precision it began
        # in, and the seed's own tokens are sampled as a worker's would be.
        self.dtype, self.device = served_dtype(cfg.publish_dtype), rank_device(cfg.device)
        self._engine = TorchEngine(model=cfg.model, seed=cfg.model_seed,
                                   max_running=cfg.seed_max_running, max_len=cfg.seed_max_len,
                                   device=self.device, dtype=self.dtype, **_agentic_cache(cfg))
        self.service = WorkerService(
            self._engine, self.worker_id, endpoint=endpoint, model=cfg.model,
            kind=common_pb2.WORKER_KIND_SEED, capacity=cfg.seed_max_running,
            max_len=cfg.seed_max_len, step_delay_s=cfg.bench_seed_step_delay_s,
            # As a worker does: the requests of a manager that dies run on for its successor,
            # which adopts them with every token made meanwhile (the manager's ``_adopt``, also
            # when it lends the seed at once); taken out at once, the tokens the dead manager
            # had not relayed yet would be generated again.
            keep_s=WorkerConfig.model_fields["keep_requests_s"].default, job=cfg.job)
        self._endpoint = endpoint
        self._membership: registry.Membership | None = None

    @property
    def servicer(self) -> Servicer:
        return Servicer(self.service, rollout_worker_pb2_grpc.add_RolloutWorkerServicer_to_server,
                        _SERVICE_NAME)

    @property
    def weight_version(self) -> int:
        return self._engine.weight_version

    async def run(self) -> None:
        """Registered as a rollout worker of the job while the engine runs (a background loop
        of the trainer's host, so after its gRPC server serves)."""
        engine = self._engine
        self._membership = await registry.register(self._etcd, "rollout_worker", self.worker_id, {
            "job": self._cfg.job, "endpoint": self._endpoint, "model": self._cfg.model,
            "kind": "seed", "capacity": self._cfg.seed_max_running,
            "max_len": self._cfg.seed_max_len, "weight_version": engine.weight_version,
            "draining": False, "admission": engine.batch_admission,
            "vocab_size": engine.vocab_size, "start_weights": engine.start_weights},
            ttl=self._cfg.lease_ttl)
        log.info("seed worker %s joined job %s at %s (version %d, serving %s on %s)",
                 self.worker_id, self._cfg.job, self._endpoint, engine.weight_version,
                 str(self.dtype).removeprefix("torch."), self.device)
        try:
            await self.service.run_engine()
        finally:
            membership, self._membership = self._membership, None
            await asyncio.shield(membership.close())

    async def wait_connected(self, timeout_s: float = 30.0) -> bool:
        """Until a manager holds a session with the seed worker (a window the manager cannot
        dispatch into is idle), at most ``timeout_s``; False when none came."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while self.service.hub.session_count == 0:
            if asyncio.get_running_loop().time() > deadline:
                log.warning("no rollout manager connected to seed worker %s within %.0fs; "
                            "the step starts without it", self.worker_id, timeout_s)
                return False
            await asyncio.sleep(0.05)
        return True

    async def load(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        """The trainer's weights after an optimizer step, in memory; the member record follows
        so the manager dispatches the next version's requests here."""
        await self.service.load_weights_tensors(tensors, version)
        if self._membership is not None:  # etcd away: the training loop waits for it
            await with_etcd(partial(self._membership.update, weight_version=version),
                            "writing the seed worker's weight version")

    def close(self) -> None:
        self.service.close()
