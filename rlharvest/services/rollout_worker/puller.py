"""The worker side of weight transfer (RLBoost §4.3, ROSE §4.2): pair with a transfer agent,
watch the job's announced version, and pull every newer version — as a sparse delta against the
version this worker holds when its agent still has that one — then load it between engine steps.

A pull that fails (the agent died mid-pull, data stayed damaged, deltas failed verification) is
retried from another agent whose holder record lists the version; deltas that apply at no holder
are pulled again dense, from the holders whose failure a dense pull avoids
(``client.may_serve_dense``). With no agent registered the worker keeps serving what it has and
waits; so it does while etcd is away (the outage logged once, etcd_outage.py), trying again every
``_RETRY_S``."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from typing import Any

import aetcd
import grpc
import torch
from prometheus_client import Counter, Gauge, Histogram

from rlharvest.common import keys, registry, rpc
from rlharvest.common.aio import wait_event
from rlharvest.common.etcd_outage import etcd_answered, tolerate
from rlharvest.common.engine_types import EngineInputError
from rlharvest.services.rollout_worker.service import WorkerService
from rlharvest.services.transfer_agent.checksum import tensor_linear_sum
from rlharvest.services.transfer_agent.client import (
    AGENT_ROLE,
    DeltaApplyError,
    PullError,
    PullResult,
    holders,
    may_serve_dense,
    pull,
    agent_channel,
    sums_fingerprint,
)
from rlharvest.services.transfer_agent.replication import pick_agent

log = logging.getLogger(__name__)

PULLS = Counter("rlh_worker_pulls_total", "Weight pulls completed", ["kind"])  # dense|delta
PULL_BYTES = Counter("rlh_worker_pull_bytes_total", "Weight bytes pulled")
PULL_SECONDS = Histogram("rlh_worker_pull_seconds", "Announcement seen to version loaded",
                         buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))
PULL_FAILOVERS = Counter("rlh_worker_pull_failovers_total", "Pulls retried at another agent")
REJECTED_BUCKETS = Counter("rlh_worker_pull_rejected_buckets_total",
                           "Buckets that failed their checksum and were pulled again")
DELTA_RATIO = Gauge("rlh_worker_pull_delta_ratio", "Pulled / dense bytes of the last pull")
FINGERPRINT = Gauge("rlh_worker_weights_fingerprint", "client.weights_fingerprint of the pulled "
                    "weights (CRC-32 of names and tensor checksums)")
PULLING = Gauge("rlh_worker_pull_in_progress", "1 while a pull is under way")

_POLL_S = 1.0  # a missed watch event costs at most this
_RETRY_S = 0.5


class Puller:
    def __init__(self, etcd, service: WorkerService, worker_id: str, job: str, *,
                 tp_rank: int = 0, tp_size: int = 1, lease_ttl: int = 5,
                 streams: int = 4, held_device: str = "cpu") -> None:
        self.etcd = etcd
        self.service = service
        self.worker_id = worker_id
        self.job = job
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.lease_ttl = lease_ttl
        self.streams = streams
        self.held: dict[str, torch.Tensor] = {}  # the tensors of held_version, as pulled
        # Where ``held`` lives (--held-weights): deltas apply there (delta_codec on a GPU).
        self.held_device = torch.device(held_device)
        self.held_version: int | None = None
        # Their linear sums: the next delta verifies against them without re-reading held.
        self.held_sums: dict[str, int] = {}
        self._channels: dict[str, grpc.aio.Channel] = {}  # endpoint -> open agent channel
        self.pulling = False  # a pull (and its load) under way
        self.paired: str | None = None  # agent id
        self._last_agent: str | None = None  # paired before, in an earlier run()
        self._refused: set[int] = set()  # versions the engine refused: wait for the next one
        self._wake = asyncio.Event()
        self._lease: aetcd.Lease | None = None  # of the pairing record, made at the first pairing
        self._keepalive_task: asyncio.Task | None = None

    async def run(self) -> None:
        watcher = asyncio.create_task(registry.wake_on_change(
            self.etcd, keys.weights_announced_key(self.job), self._wake, retry_delay=_POLL_S),
            name="announcement watch")
        try:
            while True:
                try:
                    pulled = await self._step()
                except Exception as exc:
                    tolerate(exc, "the weight puller's etcd reads")  # an outage logged once
                    await asyncio.sleep(_RETRY_S)
                    continue
                etcd_answered()  # _step reads etcd first: it answered
                if not pulled:
                    await asyncio.sleep(_RETRY_S)
                    continue
                self._wake.clear()
                await wait_event(self._wake, _POLL_S)
        finally:
            watcher.cancel()
            channels, self._channels = self._channels, {}
            for channel in channels.values():
                await channel.close()
            if self._keepalive_task is not None:
                self._keepalive_task.cancel()
            lease, self._lease, self._keepalive_task = self._lease, None, None
            self.paired = None  # run again (a placed worker back on this job): pair afresh
            if lease is not None:
                try:
                    await lease.revoke()  # the pairing record goes with it
                except Exception as exc:
                    log.warning("could not drop pairing record: %r", exc)

    async def _step(self) -> bool:
        """Pull the announced version if it is newer than the held one; False to retry soon."""
        announced = await registry.get_versioned(self.etcd, keys.weights_announced_key(self.job))
        version = announced["version"] if announced else None
        if version is None or version in self._refused or \
                (self.held_version is not None and version <= self.held_version):
            return True
        self.pulling = True  # cleared only by a pull that ran to its end (see forget)
        pulled = await self._pull(version)
        self.pulling = False
        return pulled

    def forget(self) -> None:
        """Drop the held tensors: a pull stopped half-way may have applied part of a delta in
        place, so the next pull is dense."""
        self.held, self.held_version, self.pulling = {}, None, False
        self.held_sums = {}

    def _to_held_device(self, pulled: dict[str, torch.Tensor],
                        held: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``pulled`` on the held copy's device. A dense tensor is copied into the tensor of its
        name and form in ``held`` (the held copy when the pull began: runs in a thread, while
        ``forget`` may replace ``self.held``), so the device never holds two copies of the model
        besides the engine's; one without a held twin is moved (its old tensor dropped first)."""
        out = {}
        for name, tensor in pulled.items():
            if _is_on(tensor, self.held_device):  # a delta applied in place, or already there
                out[name] = tensor
                continue
            old = held.pop(name, None)
            if old is not None and old.shape == tensor.shape and old.dtype == tensor.dtype \
                    and _is_on(old, self.held_device):
                out[name] = old.copy_(tensor)
            else:
                del old
                out[name] = tensor.to(self.held_device)
        return out

    def _channel(self, endpoint: str) -> grpc.aio.Channel:
        """One open channel per agent: a sparse pull then costs no connection set-up."""
        if endpoint not in self._channels:
            self._channels[endpoint] = agent_channel(endpoint)
        return self._channels[endpoint]

    async def _pair(self, agents: dict[str, dict]) -> str | None:
        """Keep the paired agent while it lives; otherwise take the least-paired live one and
        record the pairing under this worker's own lease."""
        if self.paired is not None and self.paired in agents:
            return self.paired
        found = await self.etcd.get_prefix(keys.pairing_key("x")[:-1].encode())
        pairings = {kv.key.decode().rsplit("/", 1)[-1]: json.loads(kv.value)["agent_id"]
                    for kv in found}
        pairings.pop(self.worker_id, None)
        choice = pick_agent(agents, pairings)
        if choice is None:
            return None
        if self._lease is None:
            self._lease = await self.etcd.lease(self.lease_ttl)
            self._keepalive_task = asyncio.create_task(self._keepalive(self._lease),
                                                       name="pairing lease")
        await self.etcd.put(keys.pairing_key(self.worker_id).encode(), json.dumps({
            "agent_id": choice, "endpoint": agents[choice]["endpoint"], "job": self.job}).encode(),
            lease=self._lease)
        if self.paired is not None:
            log.warning("paired agent %s is gone; paired with %s", self.paired, choice)
        else:  # a placed worker pairs again each time its job's turn comes back: said once
            log.log(logging.DEBUG if choice == self._last_agent else logging.INFO,
                    "paired with transfer agent %s", choice)
        self.paired = self._last_agent = choice
        return choice

    async def _keepalive(self, lease: aetcd.Lease) -> None:
        await registry.keep_lease(lease, self.lease_ttl, "the pairing record")
        # Lapsed (etcd unreachable, or the loop stalled, past the TTL): the record went with
        # it. The next pull pairs again, on a new lease, so agents stay evenly paired.
        log.warning("the pairing lease lapsed and took worker %s's pairing with %s; pairing "
                    "again at the next pull", self.worker_id, self.paired)
        if self._lease is lease:
            self._lease, self._keepalive_task, self.paired = None, None, None

    async def _pull(self, version: int) -> bool:
        """Pull ``version`` from the paired agent, else from any agent holding it; load it.
        Returns False when no agent could serve it yet (the caller retries)."""
        members = await registry.list_members(self.etcd, "transfer_agent")
        agents = {info["agent_id"]: info for info in members.values() if "agent_id" in info}
        records = await holders(self.etcd, self.job)
        # Pair among the agents that serve this job when some do (a pairing to an agent that
        # never holds the job's weights would make every pull a failover).
        serving = {a: info for a, info in agents.items() if a in records} or agents
        paired = await self._pair(serving)
        if paired is None:
            log.info("no transfer agent registered; keeping version %s", self.held_version)
            return False
        order = [paired] + sorted(a for a, r in records.items()
                                  if a != paired and a in agents and version in r.get("versions", ()))
        loop = asyncio.get_running_loop()
        started = loop.time()
        PULLING.set(1)
        try:
            # Deltas first. Deltas that fail verification may be damaged at that holder alone,
            # so the next holder is tried; when no holder's deltas apply (the held copy is not
            # the base they name), the version comes dense, which needs no held tensors, from
            # the holders a dense pull may succeed at: not one that is gone, lacks the version
            # or sent damaged bytes, which would fail again after its time.
            previous: str | None = None
            failures: dict[str, BaseException] = {}
            asking = order
            for dense in (False, True):
                for agent in asking:
                    if previous is not None and agent != previous:
                        PULL_FAILOVERS.inc()
                    previous = agent
                    try:
                        result = await self._pull_from(agents[agent]["endpoint"], version, dense)
                    except (grpc.aio.AioRpcError, PullError) as exc:
                        failures[agent] = exc
                        what = rpc.error_text(exc, AGENT_ROLE)
                        log.warning("%s pull of version %d from agent %s failed: %s",
                                    "dense" if dense else "delta", version, agent, what)
                        continue
                    await self._load(result, agent, loop.time() - started)
                    return True
                if not any(isinstance(failures[a], DeltaApplyError) for a in asking):
                    return False  # a dense round's failures are never DeltaApplyError
                asking = [agent for agent in order if may_serve_dense(failures[agent])]
                log.warning("no holder's deltas of version %d apply to the held version %s; "
                            "pulling it dense from %s", version, self.held_version, asking)
            return False
        finally:
            PULLING.set(0)

    async def _pull_from(self, endpoint: str, version: int, dense: bool) -> PullResult:
        """``version`` from the agent at ``endpoint``: as deltas against the held version where
        the agent still has it, or (``dense``) whole, without the held tensors."""
        # Deltas in place: the engine copies what it loads, so ``held`` is ours alone, and a
        # delta then costs no fresh copy of the model (apply_pull undoes a half-applied delta,
        # so a failed pull leaves the held tensors at held_version).
        against: dict[str, Any] = {} if dense else dict(
            held=self.held, held_version=self.held_version, inplace=True,
            held_sums=self.held_sums)
        return await pull(endpoint, self.job, version=version, tp_rank=self.tp_rank,
                          tp_size=self.tp_size, streams=self.streams,
                          channel=self._channel(endpoint), **against)

    async def _load(self, result: PullResult, agent: str, seconds: float) -> None:
        # Sums the agent did not know are computed once here (a pass the fingerprint needs
        # anyway), from the pulled host tensors: after the copy to the device, the sum would
        # copy them back.
        sums = dict(result.sums)
        missing = sorted(result.tensors.keys() - sums.keys())
        if missing:  # a full pass: off the event loop, which serves the engine's sessions
            computed = await asyncio.get_running_loop().run_in_executor(
                None, lambda: [tensor_linear_sum(result.tensors[name]) for name in missing])
            sums.update(zip(missing, computed))
        if self.held_device.type != "cpu":  # dense results go where the held copy lives
            try:  # off the event loop: a whole model's copy to the device
                placed = await asyncio.get_running_loop().run_in_executor(
                    None, self._to_held_device, result.tensors, self.held)
            except BaseException:
                self.forget()  # part of it may be this version: the next pull is dense
                raise
            result = dataclasses.replace(result, tensors=placed)
        try:
            await self.service.load_weights_tensors(result.tensors, result.version,
                                                    job=self.job)
        except EngineInputError as exc:
            # Refused for good, but the held tensors are this version now (deltas went in
            # place): the next version's deltas apply to them.
            self.held, self.held_version, self.held_sums = result.tensors, result.version, sums
            self._refused.add(result.version)
            log.error("version %d from agent %s does not fit this engine: %s", result.version,
                      agent, exc)
            return
        except BaseException:
            # Not loaded (an engine hiccup, or stopped), so the version must be pulled and
            # loaded again; the held tensors may already be it (deltas went in place), so
            # no held version describes them: drop them and the next pull is dense.
            self.forget()
            raise
        # Only now: a held version the engine does not serve would never be pulled again.
        self.held, self.held_version, self.held_sums = result.tensors, result.version, sums
        kind = "delta" if result.delta else "dense"
        PULLS.labels(kind).inc()
        PULL_BYTES.inc(result.payload_bytes)
        PULL_SECONDS.observe(seconds)
        REJECTED_BUCKETS.inc(result.rejected_buckets)
        DELTA_RATIO.set(result.payload_bytes / max(result.dense_bytes, 1))
        fingerprint = sums_fingerprint(self.held_sums)
        FINGERPRINT.set(fingerprint)
        log.info("loaded version %d from agent %s: %s pull, %d of %d bytes, %d buckets re-pulled, "
                 "%.2fs, fingerprint %08x (%s)", result.version, agent, kind,
                 result.payload_bytes, result.dense_bytes, result.rejected_buckets, seconds,
                 fingerprint, result.note)


def _is_on(tensor: torch.Tensor, device: torch.device) -> bool:
    """Whether ``tensor`` is on ``device`` ("cuda" without an index: on any CUDA device)."""
    return tensor.device.type == device.type and device.index in (None, tensor.device.index)
