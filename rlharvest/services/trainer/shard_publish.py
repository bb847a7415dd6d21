"""Every trainer rank publishes its own shard of a version (``--publish-mode shards``).

The alternative to rank 0 gathering the model and publishing it whole: each of the N ranks
copies its flat slice of every tensor (``transfer_agent/flat_shards.py``; under ZeRO-3 the
partition it already holds, so nobody gathers) in the serving dtype (``--publish-dtype``, cast
within that one copy) and sends it to the same transfer agent on a thread of its own, while the
rank goes on. The agent joins the slices once all N arrived and only then announces the version.
``bench/trainer_publish.py`` measures both ways.

With ``--publish-deltas`` each rank sends its shard as what changed since the shard it last
published to that agent (its own ``client.DeltaPublisher``, as the gather path's
``Publisher`` keeps one): the agent applies the delta to its slice of the version it
holds. The first shard, one to another agent, and one whose base the agent no longer holds (it
restarted, or that version never completed) go dense. The rank's host copy of its last shard
costs 1/N of the model in the serving dtype.

Rank 0 starts every rank's publish with one command and later asks each how it ended: the
version is out when every rank's shard was accepted and one of them completed it (a rank's
reply with no shard missing). A restarted agent has lost the other ranks' staged shards, so
"every rank accepted" alone is not enough; rank 0 then publishes the version again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from typing import TYPE_CHECKING

import torch

from rlharvest.common.retry import retry
from rlharvest.services.trainer.publish import PUBLISH_BACKOFF, PUBLISH_RETRYABLE

if TYPE_CHECKING:  # the transfer agent's client is imported where a rank first publishes
    from rlharvest.services.transfer_agent.client import DeltaPublisher
    from rlharvest.services.transfer_agent.delta_publish import DeltaStats

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShardTarget:
    """Where every rank publishes a version, and as which trainer run (a restarted run's shards
    never join a dead run's: the agent keeps the larger run)."""

    endpoint: str
    job: str
    bucket_bytes: int
    run: int
    dtype: torch.dtype | None = None  # floating tensors go in it (the serving dtype); None: as is
    deltas: bool = False  # each shard as a delta against the one this rank last published


@dataclass(frozen=True)
class ShardPublished:
    """How one rank's shard of a version ended: whether it completed the version at the agent
    (False: accepted, other ranks' shards still missing), and, sent with ``deltas``, what it
    changed since this rank's last shard (None without)."""

    completed: bool
    stats: DeltaStats | None = None


def combined_stats(outcomes: Sequence[ShardPublished]) -> DeltaStats | None:
    """What a version changed, from every rank's shard: changed elements over all elements (and
    bytes sent over dense bytes) of the ranks together; None unless every rank measured it."""
    parts = [o.stats for o in outcomes]
    if not parts or any(p is None for p in parts):
        return None
    from rlharvest.services.transfer_agent.delta_publish import DeltaStats

    return DeltaStats(*(sum(getattr(p, f) for p in parts)
                        for f in ("changed", "numel", "payload_bytes", "dense_bytes")))


class RankPublisher:
    """One rank's side: ``start`` copies the shard and returns; ``wait`` reports how it ended."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="publish-shard")
        self._in_flight: tuple[int, Future[ShardPublished]] | None = None
        # The shard this rank last published and to which agent: the next delta's base. Only
        # the pool's one thread touches it, one publish at a time.
        self._deltas: DeltaPublisher | None = None

    def start(self, version: int, shard: Mapping[str, torch.Tensor],
              full_shapes: Mapping[str, tuple[int, ...]], rank: int, size: int,
              target: ShardTarget) -> None:
        """Send ``shard`` (this rank's copied slices) in the background; a newer ``start``
        supersedes an unfinished one only after it ended (one publish per rank at a time)."""
        if self._in_flight is not None:
            self._in_flight[1].exception()  # wait; its outcome no longer matters
        future = self._pool.submit(self._publish_blocking, version, dict(shard),
                                   dict(full_shapes), rank, size, target)
        self._in_flight = (version, future)

    def wait(self, version: int) -> ShardPublished:
        """How this rank's shard of ``version`` ended. Raises what the publish raised."""
        if self._in_flight is None or self._in_flight[0] != version:
            raise RuntimeError(f"this rank was never asked to publish version {version}")
        return self._in_flight[1].result()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


    def _publish_blocking(self, version: int, shard: dict[str, torch.Tensor],
                          full_shapes: dict[str, tuple[int, ...]], rank: int, size: int,
                          target: ShardTarget) -> ShardPublished:
        from rlharvest.services.transfer_agent import client

        async def dense() -> ShardPublished:
            reply = await client.publish(target.endpoint, target.job, version, shard,
                                         bucket_bytes=target.bucket_bytes, run=target.run,
                                         dp_rank=rank, dp_size=size, full_shapes=full_shapes)
            return ShardPublished(not reply.shards_missing)

        async def once() -> ShardPublished:
            if not target.deltas:
                return await dense()
            if self._deltas is None:
                self._deltas = client.DeltaPublisher()
            # Encoded inline: this is the rank's publish thread already.
            reply, stats = await self._deltas.publish(
                target.endpoint, target.job, version, shard, bucket_bytes=target.bucket_bytes,
                run=target.run, dp_rank=rank, dp_size=size, full_shapes=full_shapes)
            return ShardPublished(not reply.shards_missing, stats)

        async def with_retries() -> ShardPublished:
            return await retry(once, attempts=5,
                               retry_if=lambda exc: isinstance(exc, PUBLISH_RETRYABLE),
                               backoff=PUBLISH_BACKOFF,
                               what=f"rank {rank}'s shard of version {version}")

        published = asyncio.run(with_retries())
        stats = published.stats
        log.info("rank %d: shard of version %d %s%s", rank, version,
                 "completed the version" if published.completed else "staged",
                 "" if stats is None else
                 f"; {100 * stats.changed_fraction:.3f}% of its elements changed, sent "
                 f"{stats.payload_bytes / 1e6:.2f} of {stats.dense_bytes / 1e6:.2f} MB")
        return published
