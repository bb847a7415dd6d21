"""Every trainer rank publishes its own shard of a version (issue 21, ``--publish-mode shards``).

The alternative to rank 0 gathering the model and publishing it whole: each of the N ranks
copies its flat slice of every tensor (``transfer_agent/flat_shards.py``; under ZeRO-3 the
partition it already holds, so nobody gathers) and sends it to the same transfer agent on a
thread of its own, while the rank goes on. The agent joins the slices once all N arrived and only
then announces the version. ``bench/trainer_publish.py`` measures both ways.

Rank 0 starts every rank's publish with one command and later asks each how it ended: the
version is out when every rank's shard was accepted and one of them completed it (a rank's
reply with no shard missing). A restarted agent has lost the other ranks' staged shards, so
"every rank accepted" alone is not enough; rank 0 then publishes the version again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from rlharvest.common.retry import retry
from rlharvest.services.trainer.rollout_client import PUBLISH_BACKOFF, PUBLISH_RETRYABLE

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShardTarget:
    """Where every rank publishes a version, and as which trainer run (a restarted run's shards
    never join a dead run's: the agent keeps the larger run)."""

    endpoint: str
    job: str
    bucket_bytes: int
    run: int


class RankPublisher:
    """One rank's side: ``start`` copies the shard and returns; ``wait`` reports how it ended."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="publish-shard")
        self._pending: tuple[int, Future[bool]] | None = None

    def start(self, version: int, shard: Mapping[str, torch.Tensor],
              full_shapes: Mapping[str, tuple[int, ...]], rank: int, size: int,
              target: ShardTarget) -> None:
        """Send ``shard`` (this rank's copied slices) in the background; a newer ``start``
        supersedes an unfinished one only after it ended (one publish per rank at a time)."""
        if self._pending is not None:
            self._pending[1].exception()  # wait; its outcome no longer matters
        future = self._pool.submit(_publish_blocking, version, dict(shard), dict(full_shapes),
                                   rank, size, target)
        self._pending = (version, future)

    def wait(self, version: int) -> bool:
        """Whether this rank's shard of ``version`` completed the version at the agent (False:
        accepted, other ranks' shards still missing). Raises what the publish raised."""
        if self._pending is None or self._pending[0] != version:
            raise RuntimeError(f"this rank was never asked to publish version {version}")
        return self._pending[1].result()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _publish_blocking(version: int, shard: dict[str, torch.Tensor],
                      full_shapes: dict[str, tuple[int, ...]], rank: int, size: int,
                      target: ShardTarget) -> bool:
    from rlharvest.services.transfer_agent import client

    async def once() -> bool:
        reply = await client.publish(target.endpoint, target.job, version, shard,
                                     bucket_bytes=target.bucket_bytes, run=target.run,
                                     dp_rank=rank, dp_size=size, full_shapes=full_shapes)
        return not reply.shards_missing

    async def with_retries() -> bool:
        return await retry(once, attempts=5,
                           retry_if=lambda exc: isinstance(exc, PUBLISH_RETRYABLE),
                           backoff=PUBLISH_BACKOFF,
                           what=f"rank {rank}'s shard of version {version}")

    done = asyncio.run(with_retries())
    log.info("rank %d: shard of version %d %s", rank, version,
             "completed the version" if done else "staged")
    return done
