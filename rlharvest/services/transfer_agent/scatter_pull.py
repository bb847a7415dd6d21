"""A relay pull scattered over every source agent that holds the version (WEAVE §5.2, Fig. 9:
inter-cluster scatter). The pull's packed bytes are cut into disjoint ranges by
``relay.plan_relay`` — with the pulling gateway as the receiving cluster's only agent, since it
serves its copy to the rest of its cluster itself — and each range is sent by a different holder
over its own parallel streams. Exactly one copy crosses the slow link, and every sender's uplink
carries a share of it.

Ranges from different senders fit together only if the senders packed the same bytes, so each
sender plans the pull and only those whose plan id (the CRC of the manifest, which lists every
bucket's CRC) agrees take part. Each sender encodes the whole pull to know where its range lies;
that costs CPU on the source side, not link bytes. A sender that fails mid-pull (killed,
refusing) hands the ranges it has not delivered to the senders still alive. A bucket is checked
against its CRC as soon as all its ranges are in; a damaged one is fetched again, whole.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

import grpc
import torch

from rlharvest.common import rpc
from rlharvest.common.pb import transfer_agent_pb2 as pb
from rlharvest.services.transfer_agent.bucketing import VersionManifest
from rlharvest.services.transfer_agent.checksum import bytes_checksum
from rlharvest.services.transfer_agent.client import (
    AGENT_ROLE,
    PullDecoder,
    PullError,
    PullResult,
    agent_channel,
    plan_pull,
    pull_request,
)
from rlharvest.services.transfer_agent.data_path import Part, byte_range_parts, cut_parts
from rlharvest.services.transfer_agent.http_data import (
    DEFAULT_READ_TIMEOUT_S,
    DataPathError,
    RangeFetcher,
)
from rlharvest.services.transfer_agent.relay import plan_relay

log = logging.getLogger(__name__)

# (sender, parts, on_part): fetch those parts from that sender, reporting each as it lands. A
# coroutine, not any awaitable: ScatterFetch runs each share as its own asyncio task.
FetchParts = Callable[[str, list[Part], Callable[[Part], None]], Coroutine[Any, Any, None]]


@dataclass(frozen=True)
class Sender:
    agent_id: str
    endpoint: str  # gRPC; the data endpoint comes with its PlanPull answer


@dataclass(frozen=True)
class Planned:
    sender: Sender
    plan: pb.PullPlan
    data_endpoint: str


def assign_parts(senders: Sequence[str], bucket_sizes: Sequence[int], source_cluster: str,
                 receiver: str, receiver_cluster: str) -> dict[str, list[Part]]:
    """Each sender's share of a pull whose buckets have ``bucket_sizes``: the inter-cluster
    transfers of plan_relay into a cluster whose only agent is ``receiver``, cut at bucket
    boundaries (each bucket is checksummed alone)."""
    if source_cluster == receiver_cluster:
        raise ValueError(f"a scattered pull crosses a link: the senders' cluster "
                         f"{source_cluster!r} must not be the receiver's")
    plan = plan_relay({source_cluster: list(senders), receiver_cluster: [receiver]}, senders,
                      sum(bucket_sizes), source_cluster=source_cluster)
    shares: dict[str, list[Part]] = {sender: [] for sender in senders}
    for transfer in plan.transfers:
        if transfer.cross_cluster:
            shares[transfer.src] += byte_range_parts(bucket_sizes, transfer.start, transfer.stop)
    return shares


def agreeing(planned: Sequence[Planned]) -> list[Planned]:
    """The largest group of senders with the same plan (ties: the fewest payload bytes, then
    sender order): only byte-identical packs can serve ranges of one pull."""
    if not planned:
        raise PullError("no source agent could plan this pull (see the log for why each "
                        "refused); try again once a holder is back", "UNAVAILABLE")
    groups: dict[int, list[Planned]] = {}
    for item in planned:
        groups.setdefault(item.plan.plan_id, []).append(item)
    return min(groups.values(), key=lambda group: (-len(group), group[0].plan.payload_bytes))


class ScatterFetch:
    """Runs every sender's share to completion; the parts a failed sender (DataPathError) has
    not delivered go round-robin to the senders still alive. Any other error propagates."""

    def __init__(self, senders: Sequence[str], fetch_parts: FetchParts) -> None:
        self.alive = list(senders)
        self.failures: dict[str, str] = {}
        self._fetch_parts = fetch_parts

    def spread(self, parts: Sequence[Part]) -> dict[str, list[Part]]:
        """``parts`` dealt round-robin to the live senders; PullError when none is left."""
        if parts and not self.alive:
            raise PullError(f"every source agent failed mid-pull: {self.failures}", "UNAVAILABLE")
        shares = {sender: list(parts[i::len(self.alive)]) for i, sender in enumerate(self.alive)}
        return {sender: share for sender, share in shares.items() if share}

    async def run(self, shares: Mapping[str, list[Part]],
                  on_part: Callable[[str, Part], None]) -> None:
        done: set[Part] = set()
        running: dict[asyncio.Task, tuple[str, list[Part]]] = {}

        def start(sender: str, parts: list[Part]) -> None:
            def landed(part: Part) -> None:
                done.add(part)
                on_part(sender, part)
            task = asyncio.create_task(self._fetch_parts(sender, parts, landed))
            running[task] = (sender, parts)

        for sender, parts in shares.items():
            if parts:
                start(sender, parts)
        try:
            while running:
                finished, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                for task in finished:
                    sender, parts = running.pop(task)
                    exc = task.exception()
                    if exc is None:
                        continue
                    if not isinstance(exc, DataPathError):
                        raise exc
                    self._lose(sender, exc)
                    for other, share in self.spread([p for p in parts if p not in done]).items():
                        start(other, share)
        finally:
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)

    def _lose(self, sender: str, exc: DataPathError) -> None:
        if sender in self.alive:
            self.alive.remove(sender)
            log.warning("relay source %s failed mid-pull (%s: %s); its ranges go to %s", sender,
                        exc.code, exc, self.alive or "nobody")
        self.failures[sender] = f"{exc.code}: {exc}"


class _BucketChecks:
    """Checks a bucket's CRC on a codec thread as soon as the last of its parts in this round
    lands, while other ranges still stream."""

    def __init__(self, manifest: VersionManifest, buffers: Mapping[int, bytearray],
                 parts: Sequence[Part], pool: ThreadPoolExecutor,
                 on_verified: Callable[[int], None]) -> None:
        self._manifest, self._buffers, self._pool = manifest, buffers, pool
        self._on_verified = on_verified
        self._left = Counter(index for index, _, _ in parts)
        self._tasks: list[asyncio.Task] = []

    def landed(self, part: Part) -> None:
        self._left[part[0]] -= 1
        if not self._left[part[0]]:
            self.start(part[0])

    def start(self, index: int) -> None:
        self._tasks.append(asyncio.create_task(self._check(index)))

    async def _check(self, index: int) -> int | None:
        loop = asyncio.get_running_loop()
        actual = await loop.run_in_executor(self._pool, bytes_checksum, self._buffers[index])
        if actual != self._manifest.bucket_checksums[index]:
            return index
        self._on_verified(index)
        return None

    async def damaged(self) -> list[int]:
        return [i for i in await asyncio.gather(*self._tasks) if i is not None]

    def cancel(self) -> None:
        for task in self._tasks:
            task.cancel()


async def scatter_pull(senders: Sequence[Sender], job: str, version: int, *,
                       held: Mapping[str, torch.Tensor] | None, held_version: int | None,
                       receiver: str, cluster: str, source_cluster: str, streams: int = 4,
                       refetch_attempts: int = 3, codec_threads: int = 2,
                       read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
                       held_sums: Mapping[str, int] | None = None) -> PullResult:
    """Pull ``version`` of ``job`` (whole, tp_size 1) scattered over ``senders``, all of
    ``source_cluster``; deltas against ``held`` (tensors of ``held_version``) where the senders
    hold that version. ``streams`` connections in all, shared among the senders; a sender that
    sends nothing for ``read_timeout_s`` counts as failed. The result's ``sources`` says how many
    bytes came from each sender. Raises PullError when no sender can plan the pull, the plan
    cannot be scattered or decoded, every sender failed, or a bucket stayed damaged."""
    started = time.perf_counter()
    request = pull_request(job, version, held_version if held is not None else None,
                           cluster=cluster)
    chosen = agreeing(await plan_everywhere(senders, request))
    plan = chosen[0].plan
    manifest, shares = _scatter_plan(chosen, source_cluster, receiver, cluster)
    request.version = plan.version
    per_sender = max(1, -(-streams // len(chosen)))
    shares = {sender: cut_parts(share, per_sender) for sender, share in shares.items()}
    buffers = {index: bytearray(size) for index, size in enumerate(manifest.bucket_sizes)}
    sources = {item.sender.agent_id: 0 for item in chosen}
    # Not a `with` block: leaving one waits, on the event loop, for codec work that a failed pull
    # no longer needs.
    pool = ThreadPoolExecutor(codec_threads, thread_name_prefix="scatter-codec")
    try:
        decoder = PullDecoder(manifest, buffers, held or {}, held_version, False, pool,
                              held_sums)
        try:
            async with AsyncExitStack() as stack:
                fetchers = {item.sender.agent_id: await stack.enter_async_context(RangeFetcher(
                    item.data_endpoint, request, plan.plan_id, buffers, per_sender,
                    read_timeout_s)) for item in chosen}
                scatter = ScatterFetch(list(fetchers), lambda sender, parts, on_part:
                                       fetchers[sender].fetch_parts(parts, on_part))
                rejected = await _fetch_verified(manifest, buffers, scatter, shares, pool,
                                                 decoder.bucket_verified, sources,
                                                 refetch_attempts, per_sender)
        except BaseException:
            decoder.abandon()
            raise
        tensors = await decoder.finish()  # PullError when the senders' bytes do not decode
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    return PullResult(plan.version, tensors, plan.note, plan.delta_tensors > 0,
                      plan.payload_bytes, plan.dense_bytes, rejected,
                      time.perf_counter() - started, sources,
                      {e.name: e.sum for e in manifest.entries if e.sum is not None})


def _scatter_plan(chosen: Sequence[Planned], source_cluster: str, receiver: str,
                  cluster: str) -> tuple[VersionManifest, dict[str, list[Part]]]:
    """The agreed plan's manifest and each sender's share; PullError when the manifest is
    malformed or the topology is one plan_relay cannot serve (a relay must not die of either)."""
    try:
        manifest = VersionManifest.from_dict(json.loads(chosen[0].plan.manifest_json))
        shares = assign_parts([item.sender.agent_id for item in chosen], manifest.bucket_sizes,
                              source_cluster, receiver, cluster)
    except ValueError as exc:  # ManifestError, JSONDecodeError, RelayPlanError
        raise PullError(f"cannot scatter the pull over {[i.sender.agent_id for i in chosen]}: "
                        f"{type(exc).__name__}: {exc}", "INTERNAL") from exc
    return manifest, shares


async def plan_everywhere(senders: Sequence[Sender], request: pb.PullRequest) -> list[Planned]:
    """Each sender's plan for ``request``, in sender order; senders that refuse, cannot be
    reached or serve no HTTP data path are left out (and logged)."""

    async def plan_at(sender: Sender) -> Planned | None:
        try:
            async with agent_channel(sender.endpoint) as chan:
                plan, data_endpoint = await plan_pull(chan, request)
        except grpc.aio.AioRpcError as exc:
            log.info("relay source %s cannot serve version %d of %s: %s %s", sender.agent_id,
                     request.version, request.job, exc.code().name,
                     rpc.error_text(exc, AGENT_ROLE))
            return None
        if not data_endpoint:
            log.info("relay source %s serves no HTTP data path; it sends no range",
                     sender.agent_id)
            return None
        return Planned(sender, plan, data_endpoint)

    planned = await asyncio.gather(*(plan_at(sender) for sender in senders))
    return [item for item in planned if item is not None]


async def _fetch_verified(manifest: VersionManifest, buffers: Mapping[int, bytearray],
                          scatter: ScatterFetch, shares: Mapping[str, list[Part]],
                          pool: ThreadPoolExecutor, on_verified: Callable[[int], None],
                          sources: dict[str, int], refetch_attempts: int,
                          per_sender: int) -> int:
    """Fetch ``shares`` and every bucket's CRC; damaged buckets are fetched again from the live
    senders. Returns how many buckets were re-pulled."""

    def count(sender: str, part: Part) -> None:
        sources[sender] += part[2] - part[1]
        checks.landed(part)

    rejected = 0
    for attempt in range(refetch_attempts + 1):
        parts = [part for share in shares.values() for part in share]
        checks = _BucketChecks(manifest, buffers, parts, pool, on_verified)
        if attempt == 0:
            for index in (i for i, size in enumerate(manifest.bucket_sizes) if not size):
                checks.start(index)  # empty: nothing to fetch, nothing to wait for
        try:
            await scatter.run(shares, count)
            damaged = await checks.damaged()
        except BaseException:
            checks.cancel()  # no CRC is wanted any more; nothing may outlive the pull
            raise
        if not damaged:
            return rejected
        rejected += len(damaged)
        log.warning("buckets %s of version %d failed their checksum; pulling them again from "
                    "%s (attempt %d)", damaged, manifest.version, scatter.alive, attempt + 1)
        whole = [(index, 0, manifest.bucket_sizes[index]) for index in damaged]
        shares = scatter.spread(cut_parts(whole, per_sender * max(len(scatter.alive), 1)))
    raise PullError(f"buckets {damaged} of version {manifest.version} stayed damaged after "
                    f"{refetch_attempts} re-pulls from {scatter.alive}", "DATA_LOSS")
