"""Each new version out to the node's transfer agent, in the background: snapshotted right
after its optimizer step, awaited only before the next step's rollout (the workers cannot
hold it sooner), published again when its agent died before any worker pulled it. One rank
publishes the whole model, or with ``--publish-mode shards`` every rank its own shard."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from rlharvest.common import rpc
from rlharvest.common.authorization import SERVICE_ROLES
from rlharvest.common.retry import retry
from rlharvest.services.trainer import metrics, publish
from rlharvest.services.trainer.backend import Where
from rlharvest.services.trainer.compute import ComputeThread
from rlharvest.services.trainer.config import TrainerConfig
from rlharvest.services.trainer.device import module_device, published_dtype
from rlharvest.services.trainer.ranks import LeaderRanks, RankFailed, Ranks
from rlharvest.services.trainer.seed_role import SeedRole
from rlharvest.services.trainer.shard_publish import ShardTarget

if TYPE_CHECKING:
    from rlharvest.services.transfer_agent.delta_publish import DeltaStats

log = logging.getLogger(__name__)

SHARD_PUBLISH_ATTEMPTS = 3  # each rank also retries its own shard on transport errors

# A publish that ended: its seconds, and what the version changed when it went as deltas.
Published = tuple[float, "DeltaStats | None"]


async def _result(task: asyncio.Task[Published]) -> Published:
    return await task


class Publishing:
    def __init__(self, cfg: TrainerConfig, etcd: Any, ranks: Ranks, compute: ComputeThread,
                 model: torch.nn.Module, weights_are_sharded: bool, seed: SeedRole | None,
                 clock: Callable[[], float]) -> None:
        self._cfg = cfg
        self._etcd = etcd
        self._ranks = ranks
        self._compute = compute
        self._seed = seed  # the trainer's own engine takes each version too
        self._clock = clock
        self._dtype = dtype = published_dtype(cfg.publish_dtype)
        self._publisher = (publish.Publisher(etcd, cfg.job, cfg.agent, cfg.bucket_bytes,
                                             cfg.publish_deltas, dtype)
                           if cfg.publish else None)
        # A GPU trainer's deltas are found and encoded on the GPU (ROSE §4.2: only what changed
        # crosses to the host); its version copy is made there, in the serving dtype. Not under
        # ZeRO-3: a model partitioned because it does not fit one GPU would not fit there whole,
        # twice (the version and the record of the last), so it goes to host memory.
        device = module_device(model)
        self._where = Where(device, dtype) \
            if device.type != "cpu" and cfg.publish_deltas and not weights_are_sharded else None
        # Every rank publishes its own shard; one rank always publishes whole.
        self._shards = cfg.publish_mode == "shards" and isinstance(ranks, LeaderRanks)
        self._run_number = time.time_ns() // 1_000_000  # a restart's shards never join ours
        # What the next step awaits before its rollout: the last version's publish.
        self._in_flight: Callable[[], Awaitable[Published]] | None = None

    @property
    def enabled(self) -> bool:
        return self._publisher is not None

    def as_served(self, tensors: dict[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        """The weights as the workers serve them (in the publish dtype): the seed engine rolls
        out the same policy as they do, wherever the trainer snapshotted them."""
        return publish.as_served(tensors, self._dtype)

    async def announced(self) -> int | None:
        """The newest version the job announced, or that a live agent holds without having
        announced it yet (etcd was away): a restarted trainer must not publish that number
        again."""
        announced = await publish.announced_version(self._etcd, self._cfg.job)
        if self._publisher is None:
            return announced
        held = await self._publisher.latest_held()
        return max((v for v in (announced, held) if v is not None), default=None)

    async def start(self, version: int) -> None:
        """Snapshot the weights now and hand them to the agent in the background: the trainer
        goes on at once; the next step waits for it only before submitting its rollout."""
        if self._shards:
            await self._start_shards(version)
            return
        # On the training thread, as every rank command: a copy of the whole model (seconds
        # for a large one on the CPU; under ZeRO-3 a gather every rank joins) must not stall
        # the event loop. Cast to the serving dtype there too, once for the seed engine and
        # the publisher both (the publisher's cast of tensors already in it copies nothing).
        tensors = await self._compute.run(self._served_snapshot)
        if self._seed is not None:  # the trainer's own engine: in memory, before the next step
            await self._seed.load(tensors, version)
        task = asyncio.get_running_loop().create_task(self._publish(version, tensors),
                                                      name=f"publish v{version}")
        self._in_flight = partial(_result, task)

    def _served_snapshot(self) -> Mapping[str, torch.Tensor]:
        return self.as_served(self._ranks.weights(where=self._where))

    async def _publish(self, version: int, tensors: Mapping[str, torch.Tensor]) -> Published:
        assert self._publisher is not None
        started = self._clock()
        try:
            # An agent restarting is an outage to wait out, as etcd's is: a supervisor brings
            # it back, and a trainer that gave up after a few seconds stopped the whole job.
            await retry(partial(self._publisher.publish, version, tensors), attempts=None,
                        deadline_s=self._cfg.publish_wait_s,
                        retry_if=lambda exc: isinstance(exc, publish.PUBLISH_RETRYABLE),
                        backoff=publish.PUBLISH_BACKOFF, what=f"publishing version {version}")
        except publish.PUBLISH_RETRYABLE as exc:
            raise RuntimeError(f"could not publish version {version}: "
                               f"{rpc.error_text(exc, SERVICE_ROLES['transfer_agent'])}"
                               ) from exc
        elapsed = self._clock() - started
        metrics.PUBLISH_SECONDS.observe(elapsed)
        log.info("published version %d in %.2fs", version, elapsed)
        return elapsed, self._publisher.last_stats

    async def _start_shards(self, version: int) -> None:
        """Every rank copies its shard now, in the serving dtype, and sends it on its own thread
        (as a delta against its last shard, with ``--publish-deltas``); the next step asks the
        ranks how that ended and what the version changed (a command, so it waits until then:
        the compute thread stays free for the checkpoint meanwhile). Versions stay unchanged
        until that step trains, so an incomplete version (the agent restarted and lost shards)
        is simply published again."""
        started = self._clock()
        await self._send_shards(version)
        self._in_flight = partial(self._finish_shards, version, started)

    async def _send_shards(self, version: int) -> None:
        assert self._publisher is not None and isinstance(self._ranks, LeaderRanks)
        endpoint = await retry(self._publisher.endpoint, attempts=None,
                               deadline_s=self._cfg.publish_wait_s,
                               backoff=publish.PUBLISH_BACKOFF,
                               retry_if=lambda exc: isinstance(exc, LookupError),
                               what="finding a transfer agent")
        target = ShardTarget(endpoint, self._cfg.job, self._cfg.bucket_bytes, self._run_number,
                             self._dtype, self._cfg.publish_deltas)
        await self._compute.run(self._ranks.publish_shards, version, target)

    async def _finish_shards(self, version: int, started: float) -> Published:
        assert isinstance(self._ranks, LeaderRanks)
        ranks = self._ranks
        for attempt in range(1, SHARD_PUBLISH_ATTEMPTS + 1):
            try:
                if await self._compute.run(ranks.await_published, version):
                    break
                problem = "every shard was accepted but none completed the version"
            except RankFailed as exc:
                problem = str(exc)
            if attempt == SHARD_PUBLISH_ATTEMPTS:
                raise RuntimeError(f"could not publish version {version} as shards: {problem}")
            log.warning("publishing version %d again (%s)", version, problem)
            await self._send_shards(version)
        elapsed = self._clock() - started
        metrics.PUBLISH_SECONDS.observe(elapsed)
        log.info("published version %d as %d shards in %.2fs", version, ranks.world_size,
                 elapsed)
        stats = ranks.last_stats
        if stats is not None:
            metrics.PUBLISH_CHANGED.set(stats.changed_fraction)
            metrics.PUBLISH_PAYLOAD.set(stats.payload_bytes / max(stats.dense_bytes, 1))
            log.info("version %d: %.3f%% of the elements changed over %d shards; sent %.2f "
                     "of %.2f MB", version, 100 * stats.changed_fraction, ranks.world_size,
                     stats.payload_bytes / 1e6, stats.dense_bytes / 1e6)
        return elapsed, stats

    @property
    def in_flight(self) -> bool:
        return self._in_flight is not None

    async def wait(self) -> Published | None:
        """The last version's publish, once it ended (None: none was under way)."""
        in_flight, self._in_flight = self._in_flight, None
        return None if in_flight is None else await in_flight()

    async def lost(self, version: int) -> bool:
        """Whether ``version`` is nowhere: published to an agent that died before any worker
        pulled it, so no live agent's holder record lists it (the records live on the agents'
        leases) and no worker of the job holds it. Shards and version 0 are never lost here."""
        if self._publisher is None or self._shards or version == 0:
            return False
        return not await self._publisher.held_anywhere(version)
