"""The trainer's side of its two peers: the job's rollout manager (SubmitStep stream, seeding
windows) and the node's transfer agent (publish). Both are found in etcd unless configured."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from collections.abc import AsyncIterator, Mapping
from functools import partial
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, NoReturn

import grpc
import torch

from rlharvest.common import aio, keys, registry, rpc
from rlharvest.common.etcd_outage import with_etcd
from rlharvest.common.pb import rollout_manager_pb2 as mpb, rollout_manager_pb2_grpc
from rlharvest.common.retry import Backoff
from rlharvest.services.trainer import metrics
from rlharvest.services.trainer.backend import served_as

if TYPE_CHECKING:
    from rlharvest.services.transfer_agent.delta_publish import DeltaStats

log = logging.getLogger(__name__)


class RolloutStreamError(RuntimeError):
    """The SubmitStep stream broke (manager restarted, network); the step is retried whole."""


async def find_manager(etcd, job: str, timeout: float = 60.0) -> str:
    """Endpoint of the rollout manager registered for ``job``; waits for one to appear."""
    return (await find_manager_member(etcd, job, timeout))["endpoint"]


async def find_manager_member(etcd, job: str, timeout: float = 60.0,
                              unlike: str | None = None) -> dict:
    """The member record of ``job``'s leading rollout manager (endpoint, incarnation; a standby
    is passed over); waits for one to appear, and with ``unlike`` for one of another
    incarnation (a dead manager's successor). etcd away is waited out (etcd_outage.py), except
    by a single look (``timeout`` 0), which raises the outage error for its caller to judge."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        members = await with_etcd(partial(registry.list_members, etcd, "rollout_manager"),
                                  "looking up the job's rollout manager",
                                  deadline_s=None if timeout > 0 else 0)
        for info in sorted(members.values(), key=lambda i: i.get("endpoint", "")):
            if info.get("job") == job and info.get("role") != "standby" and \
                    (unlike is None or info.get("incarnation") != unlike):
                return info
        if loop.time() >= deadline:
            raise TimeoutError(f"no rollout manager for job {job!r} registered in etcd within "
                               f"{timeout:g}s; start one (rlharvest-rollout-manager --job {job}) "
                               "or pass --manager host:port")
        await asyncio.sleep(0.5)


async def stream_step(endpoint: str, request: mpb.SubmitStepRequest,
                      max_message_bytes: int) -> AsyncIterator[mpb.StepEvent]:
    """SubmitStep's events. Refusals that retrying cannot fix (INVALID_ARGUMENT) propagate as
    AioRpcError; a broken stream becomes RolloutStreamError."""
    # peer_role: under TLS only a manager's certificate is taken (the endpoint comes from etcd;
    # another role's holder could hand the trainer made-up rollouts).
    async with rpc.channel(endpoint, max_message_bytes=max_message_bytes,
                           peer_role="manager") as chan:
        stub = rollout_manager_pb2_grpc.RolloutManagerStub(chan)
        try:
            async for event in stub.SubmitStep(request):
                yield event
        except grpc.aio.AioRpcError as exc:
            _raise_stream_error(exc, f"SubmitStep to {endpoint} broke")


def _raise_stream_error(exc: grpc.aio.AioRpcError, what: str) -> NoReturn:
    """A refusal that retrying cannot fix (INVALID_ARGUMENT) propagates as it is; anything
    else becomes a RolloutStreamError, which retries the step."""
    if exc.code() is grpc.StatusCode.INVALID_ARGUMENT:
        raise exc
    raise RolloutStreamError(f"{what}: {exc.code().name}: {exc.details()}") from exc


@dataclass
class StepScope:
    """An agentic step held open on the manager: once the step's turns played, the remote
    timings the manager measured (Algorithm 1's inputs; None if the manager could not give
    them)."""

    remote: mpb.RemoteTimings | None = None


SCOPE_END_TIMEOUT_S = 10.0


@contextlib.asynccontextmanager
async def hold_agentic_step(endpoint: str, step_id: str,
                            window_s: float) -> AsyncIterator[StepScope]:
    """An agentic step (its turns are Generate calls) held open on the manager while the body
    runs (``HoldSeedWindow``), with RLBoost's seeding window of ``window_s`` (0: none, the step
    is only measured). The window is open once this yields, so turns submitted in the body can
    start on the seed workers. When the body ends normally the manager is told, and its answer,
    the step's remote timings, lands in ``StepScope.remote``. A manager that dies meanwhile ends
    the window; its successor holds none (the seed workers then take turns to the end, as in
    the co-located fallback), and the turns' own streams retry the step."""
    played: asyncio.Future[bool] = asyncio.get_running_loop().create_future()

    async def requests() -> AsyncIterator[mpb.SeedWindowRequest]:
        yield mpb.SeedWindowRequest(step_id=step_id, window_s=window_s)
        if await played:  # a failed body only cancels: the manager measures no abandoned step
            yield mpb.SeedWindowRequest(step_id=step_id, end=True)

    async with rpc.channel(endpoint, peer_role="manager") as chan:
        call = rollout_manager_pb2_grpc.RolloutManagerStub(chan).HoldSeedWindow(requests())
        try:
            opened = await call.read()
        except grpc.aio.AioRpcError as exc:
            _raise_stream_error(exc, f"HoldSeedWindow at {endpoint} failed")
        if opened is grpc.aio.EOF:
            raise RolloutStreamError(f"HoldSeedWindow at {endpoint} ended before it opened")
        scope = StepScope()
        try:
            yield scope
            played.set_result(True)
            scope.remote = await _scope_timings(call, endpoint)
        finally:
            if not played.done():  # else a call that already ended leaves requests() waiting
                played.set_result(False)
            call.cancel()


async def _scope_timings(call, endpoint: str) -> mpb.RemoteTimings | None:
    """The manager's last event of a step scope: advisory (Algorithm 1 skips a step without)."""
    try:
        last = await aio.wait_for(call.read(), SCOPE_END_TIMEOUT_S)
    except (grpc.aio.AioRpcError, asyncio.TimeoutError) as exc:  # not TimeoutError on 3.10
        log.warning("no remote timings for the step from %s: %s", endpoint, exc)
        return None
    if last is grpc.aio.EOF or not last.HasField("remote"):
        return None
    return last.remote


async def announced_version(etcd, job: str) -> int | None:
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
