"""The trainer's side of the node's transfer agent: publishing a version (whole, or as what
changed since the last one), the job's announced and held versions, the serving dtype. The
agent is found in etcd unless configured."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from functools import partial
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import grpc
import torch

from rlharvest.common import keys, registry
from rlharvest.common.etcd_outage import with_etcd
from rlharvest.common.retry import Backoff
from rlharvest.services.trainer import metrics
from rlharvest.services.trainer.backend import served_as

if TYPE_CHECKING:
    from rlharvest.services.transfer_agent.delta_publish import DeltaStats

log = logging.getLogger(__name__)


async def announced_version(etcd: Any, job: str) -> int | None:
    """The version the job's agents last announced in etcd (None: none yet)."""
    record = await with_etcd(partial(registry.get_versioned, etcd,
                                     keys.weights_announced_key(job)),
                             "reading the job's announced version")
    return int(record["version"]) if record is not None else None


# No agent yet, or one restarting: publishing again soon may succeed (whole or a rank's shard).
PUBLISH_RETRYABLE = (grpc.aio.AioRpcError, LookupError, TimeoutError, ConnectionError)
PUBLISH_BACKOFF = Backoff(first_s=0.5, max_s=2.0, jitter=0.0)


def as_served(tensors: Mapping[str, torch.Tensor],
              dtype: torch.dtype | None) -> Mapping[str, torch.Tensor]:
    """The weights in the serving dtype workers get them in (floating tensors only; None: as
    they are)."""
    if dtype is None:
        return tensors
    return {name: t.to(served_as(t, dtype)) for name, t in tensors.items()}


class Publisher:
    """Hands each new version to the node's transfer agent (its client, not a second path).
    With ``deltas``, each version goes as what changed since the last one this agent took
    (``LastPublished``): sparse where that is smaller, with linear sums chained so workers
    verify it without re-reading their copy. An agent that lost the base (it restarted) refuses
    the delta; the version then goes dense."""

    def __init__(self, etcd, job: str, agent: str, bucket_bytes: int,
                 deltas: bool = True, dtype: torch.dtype | None = None) -> None:
        try:
            from rlharvest.services.transfer_agent import client
        except ImportError as exc:
            raise RuntimeError(
                "publishing needs the transfer agent's client "
                "(rlharvest.services.transfer_agent.client), which is not installed here; run "
                "with --no-publish to train without publishing (only step 1 is on-policy)") from exc
        self._client = client
        self._etcd = etcd
        self._job = job
        self._agent = agent
        self._bucket_bytes = bucket_bytes
        self._deltas = deltas
        self._dtype = dtype  # the serving dtype floating tensors are published in (None: as is)
        self._deltas_to = client.DeltaPublisher()  # its record of the last version, per agent
        self.last_stats: DeltaStats | None = None  # of the last delta publish
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="publish-codec")

    async def endpoint(self) -> str:
        """The agent to publish to: the configured one, else one registered in etcd
        (LookupError while none is)."""
        return self._agent or await with_etcd(partial(self._client.find_agent, self._etcd),
                                              "looking up a transfer agent")

    async def _holders(self) -> list[dict]:
        """The holder records of the job's live agents."""
        agents = await with_etcd(partial(self._client.holders, self._etcd, self._job),
                                 "reading the job's weight holders")
        return list(agents.values())

    async def latest_held(self) -> int | None:
        """The newest version a live agent holds for the job (None: none holds any). An agent
        may hold a version it could not announce yet (etcd was away): a restarted trainer must
        not publish that number again."""
        return max((int(r["latest"]) for r in await self._holders() if "latest" in r),
                   default=None)

    async def held_anywhere(self, version: int) -> bool:
        """Whether a live agent's holder record lists ``version`` (the records live on the
        agents' leases) or a worker of the job holds it."""
        if any(version in record.get("versions", ()) for record in await self._holders()):
            return True
        workers = await with_etcd(partial(registry.list_members, self._etcd, "rollout_worker"),
                                  "reading the job's workers")
        return any(info.get("job") == self._job and info.get("weight_version") == version
                   for info in workers.values())

    async def publish(self, version: int, tensors: Mapping[str, torch.Tensor]) -> str:
        """Publish ``version``; returns the agent endpoint used. Retries while no agent runs."""
        agent = await self.endpoint()
        # A cast of the whole model (seconds on the CPU for a large one): off the event loop.
        tensors = await asyncio.get_running_loop().run_in_executor(
            self._pool, as_served, tensors, self._dtype)
        if not self._deltas:
            await self._client.publish(agent, self._job, version, dict(tensors),
                                       bucket_bytes=self._bucket_bytes)
            return agent
        loop = asyncio.get_running_loop()
        # Off the loop on the default executor, the tensors encoding side by side on the
        # pool's threads (the encode does not hold a pool thread it would wait on).
        _, stats = await self._deltas_to.publish(
            agent, self._job, version, tensors, bucket_bytes=self._bucket_bytes,
            offload=lambda work: loop.run_in_executor(None, work),
            parallel_map=self._pool.map)
        self.last_stats = stats
        metrics.PUBLISH_CHANGED.set(stats.changed_fraction)
        metrics.PUBLISH_PAYLOAD.set(stats.payload_bytes / max(stats.dense_bytes, 1))
        where = next(iter(tensors.values())).device if tensors else "cpu"
        log.info("version %d: %.3f%% of the elements changed; sent %.2f of %.2f MB (encoded "
                 "on %s)", version, 100 * stats.changed_fraction, stats.payload_bytes / 1e6,
                 stats.dense_bytes / 1e6, where)
        return agent
