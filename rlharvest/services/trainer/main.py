"""`rlharvest-trainer`: GRPO on one RL job's streamed completions; publishes each new version.

Run it alone, or under ``torchrun`` / the ``deepspeed`` launcher with N ranks: rank 0 is the
service, ranks 1..N-1 follow it (``ranks.py``).
"""

from __future__ import annotations

import asyncio
import logging
import signal

from rlharvest.common.cli import service_app
from rlharvest.common.pb import trainer_pb2, trainer_pb2_grpc
from rlharvest.common.service_host import Host, Loop, Parts, Servicer, ServiceSpec
from rlharvest.services.placement_scheduler.client import JobSpec, PlacementJob
from rlharvest.services.placement_scheduler.model import JobProfile
from rlharvest.services.trainer.config import TrainerConfig
from rlharvest.services.trainer import ranks
from rlharvest.services.trainer.loop import TrainerLoop, build_trainee, torch_threads
from rlharvest.services.trainer.placed_phases import PlacedPhases
from rlharvest.services.trainer.seed_role import SeedRole
from rlharvest.services.trainer.service import TrainerService

log = logging.getLogger("rlharvest.trainer")
SERVICE_NAME = trainer_pb2.DESCRIPTOR.services_by_name["Trainer"].full_name
_MEMBER_REFRESH_S = 0.5


async def build(host: Host[TrainerConfig]) -> Parts:
    cfg = host.config
    torch_threads(cfg.torch_threads)
    seed = SeedRole(cfg, host.etcd, host.endpoint) if cfg.seed_role else None
    loop = TrainerLoop(cfg, host.etcd, seed=seed)
    service = TrainerService(loop.status, trainer_id=cfg.trainer_id, job=cfg.job,
                             target_steps=cfg.steps)
    run = _Run(host, loop)
    return Parts(member_id=cfg.trainer_id,
                 member_info={"job": cfg.job, "step": 0, "weight_version": 0, "state": "starting"},
                 servicers=[Servicer(service, trainer_pb2_grpc.add_TrainerServicer_to_server,
                                     SERVICE_NAME), *([seed.servicer] if seed else [])],
                 health=service.health,
                 loops=[Loop("training", run.train), Loop("advertise", run.advertise,
                                                          on_crash="restart"),
                        *([Loop("seed worker", seed.run)] if seed else []),
                        *([Loop("lent workers", loop.watch_lent_workers, on_crash="restart")]
                          if cfg.borrow_lent_threads else [])],
                 close=[loop.close, *([seed.close] if seed else [])])


class _Run:
    """The service's two loops over its trainer: the training, and its member record."""

    def __init__(self, host: Host[TrainerConfig], loop: TrainerLoop) -> None:
        self._host = host
        self._cfg = host.config
        self._loop = loop

    async def train(self) -> None:
        """Restore, train ``cfg.steps`` steps, checkpoint. Cancelled (SIGTERM) mid-step: the step
        in progress is abandoned (nothing of it was applied) and the steps applied since the
        last checkpoint are saved, so a restart loses none. The same when training fails (its
        manager stayed unreachable, say), unless the failure may have left the weights half
        updated or the ranks apart (``can_save_after``)."""
        loop = self._loop
        try:
            await loop.restore()
            if self._cfg.placement_scheduler:
                await self._train_placed()
            else:
                await loop.run()
        except asyncio.CancelledError:
            await self._save_unsaved_steps()
            raise
        except Exception as exc:
            if loop.can_save_after(exc):
                log.error("training failed at step %d (%s); saving the steps applied since the "
                          "last checkpoint first", loop.steps_done + 1, exc)
                await self._save_unsaved_steps()
            raise
        log.info("trained %d steps; weights at version %d", loop.steps_done, loop.weight_version)
        await self._save_unsaved_steps()
        if self._cfg.exit_when_done:
            self._host.stop(f"trained {loop.steps_done} steps")

    async def _train_placed(self) -> None:
        """The run as a job of the placement scheduler: each step's phases under its permits."""
        cfg, loop = self._cfg, self._loop
        profile = None if cfg.placement_t_roll_s else \
            await asyncio.to_thread(loop.measure_profile)
        async with PlacementJob(placement_spec(cfg, profile), cfg.etcd, lease_ttl=cfg.lease_ttl,
                                start_iteration=loop.steps_done,
                                endpoint=cfg.placement_endpoint or None) as job:
            placed = job.placement
            assert placed is not None  # entering the context submitted the job
            log.info("job %s placed by the scheduler: group %s, rollout nodes %s, training "
                     "nodes %s", cfg.job, placed.group_id, list(placed.rollout_node_ids),
                     list(placed.train_node_ids))
            loop.place(PlacedPhases(job))
            await loop.run()

    async def _save_unsaved_steps(self) -> None:
        # The steps since the last checkpoint are not lost to the K grid.
        if self._cfg.checkpoint_dir and self._loop.steps_done % self._cfg.checkpoint_every:
            await self._loop.save_checkpoint()

    async def advertise(self) -> None:
        """Keep the member record's step and version current (rlharvest status shows them)."""
        host, loop = self._host, self._loop
        assert host.membership is not None  # registered before loops start
        shown = (-1, -1)
        while True:
            now = (loop.steps_done, loop.weight_version)
            if now != shown:
                await host.membership.update(step=now[0], weight_version=now[1],
                                             state=loop.status.state)
                shown = now
            await asyncio.sleep(_MEMBER_REFRESH_S)


def placement_spec(cfg: TrainerConfig, profile: JobProfile | None = None) -> JobSpec:
    """The job as submitted: its given worst-case durations, or its measured ``profile``."""
    given = {} if profile is not None else {"t_roll_s": cfg.placement_t_roll_s,
                                            "t_train_s": cfg.placement_t_train_s}
    return JobSpec(cfg.job, slo=cfg.placement_slo, rollout_nodes=cfg.placement_rollout_nodes,
                   train_nodes=cfg.placement_train_nodes, profile=profile,
                   train_state_sharded=cfg.backend == "deepspeed" and cfg.zero_stage > 0, **given)


def follow(cfg: TrainerConfig) -> int:
    """Ranks 1..N-1: the same model and backend as rank 0 (built in the same collective order),
    then rank 0's commands until it says stop (0) or is gone (1)."""
    # The launcher forwards SIGTERM to every rank; rank 0 then still needs us for its last
    # checkpoint and tells us when to go. Rank 0's death ends our wait anyway.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    torch_threads(cfg.torch_threads)
    backend, ref_model = build_trainee(cfg)
    group = ranks.control_group()
    try:
        ranks.follow(ranks.LocalRanks(backend, ref_model), group)
    except RuntimeError as exc:  # the collective failed: rank 0 (or a peer) is gone
        log.error("leaving: rank 0 is unreachable (%s)", exc)
        return 1
    return 0


SPEC = ServiceSpec("trainer", TrainerConfig, build, __doc__, follower=follow)
app = service_app(SPEC)


if __name__ == "__main__":
    app()
