"""The rollout manager's client: finding a job's manager in etcd, reading its status, streaming a
step (and resuming it at a successor when the manager dies mid-step), holding an agentic step
open. The trainer, the CLI, the demo, the benchmarks and the tests all call the manager
through it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Collection
from dataclasses import dataclass
from functools import partial
from typing import Any, NoReturn, Protocol

import grpc

from rlharvest.common import aio, registry, rpc
from rlharvest.common.etcd_outage import with_etcd
from rlharvest.common.pb import rollout_manager_pb2 as mpb
from rlharvest.common.pb import rollout_manager_pb2_grpc

log = logging.getLogger(__name__)


class RolloutStreamError(RuntimeError):
    """The SubmitStep stream broke (manager restarted, network); the step is retried whole."""


# ---- finding the manager -------------------------------------------------------------------


@dataclass(frozen=True)
class ManagerAt:
    """Where a job's manager answers. ``incarnation`` tells a successor from it; None when the
    endpoint was configured (--manager), which is never failed over. A job whose manager is
    split (``shards`` > 1, sharding.py): this is the leader of ``shard``; a step fans out over
    every shard (shard_client.py)."""

    endpoint: str
    incarnation: str | None = None
    shard: int = 0
    shards: int = 1

    @classmethod
    def of_member(cls, info: dict) -> ManagerAt:
        return cls(info["endpoint"], info.get("incarnation"), int(info.get("shard", 0)),
                   int(info.get("shards", 1)))


async def locate_manager(etcd: Any, job: str, configured: str = "") -> ManagerAt:
    """The configured manager, else the one registered for ``job`` (waits for it)."""
    if configured:
        return ManagerAt(configured)
    return ManagerAt.of_member(await find_manager_member(etcd, job))


async def find_manager(etcd: Any, job: str, timeout: float = 60.0) -> str:
    """Endpoint of the rollout manager registered for ``job``; waits for one to appear."""
    return (await find_manager_member(etcd, job, timeout))["endpoint"]


async def find_manager_member(etcd: Any, job: str, timeout: float = 60.0,
                              unlike: str | None = None, shard: int | None = None) -> dict:
    """The member record of ``job``'s leading rollout manager (endpoint, incarnation; a standby
    is passed over), of ``shard`` when given; waits for one to appear, and with ``unlike`` for
    one of another incarnation (a dead manager's successor). etcd away is waited out
    (etcd_outage.py), except by a single look (``timeout`` 0), which raises the outage error
    for its caller to judge."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        members = await with_etcd(partial(registry.list_members, etcd, "rollout_manager"),
                                  "looking up the job's rollout manager",
                                  deadline_s=None if timeout > 0 else 0)
        for info in sorted(members.values(), key=lambda i: i.get("endpoint", "")):
            if info.get("job") == job and info.get("role") != "standby" and \
                    (unlike is None or info.get("incarnation") != unlike) and \
                    (shard is None or int(info.get("shard", 0)) == shard):
                return info
        if loop.time() >= deadline:
            raise TimeoutError(f"no rollout manager for job {job!r} registered in etcd within "
                               f"{timeout:g}s; start one (rlharvest-rollout-manager --job {job}) "
                               "or pass --manager host:port")
        await asyncio.sleep(0.5)


async def find_successor(etcd: Any, job: str, gone: ManagerAt, broke: Exception,
                         wait_s: float, clock: Callable[[], float] = time.monotonic
                         ) -> ManagerAt:
    """The manager that succeeds ``gone``, to resume a step at. Re-raises ``broke`` (the step is
    then retried whole) when ``gone`` was configured rather than found, when it still answers
    (the stream broke, not the manager), or when no successor registers within ``wait_s``."""
    if gone.incarnation is None:
        raise broke
    deadline = clock() + wait_s
    while clock() < deadline:
        try:
            member = await find_manager_member(  # one look, no wait; the same shard's
                etcd, job, timeout=0, unlike=gone.incarnation,
                shard=gone.shard if gone.shards > 1 else None)
            return ManagerAt.of_member(member)
        except TimeoutError:
            pass
        except Exception as exc:  # etcd down or refusing a stale token: ask again
            log.warning("looking for the successor of the manager at %s: %r", gone.endpoint, exc)
            await asyncio.sleep(0.5)
        with contextlib.suppress(TimeoutError):
            await rpc.wait_healthy(gone.endpoint, timeout=0.5)
            raise broke  # it answers: the same manager lives, the step is retried whole
    raise broke


# ---- status ----------------------------------------------------------------------------------


async def manager_status(endpoint: str, timeout: float = 5.0) -> mpb.ManagerStatus | None:
    """The manager's status, or None while it is not answering (starting, or gone)."""
    async with rpc.channel(endpoint, peer_role="manager") as chan:  # under TLS: a manager's
        try:
            return await rollout_manager_pb2_grpc.RolloutManagerStub(chan).GetStatus(
                mpb.GetStatusRequest(), timeout=timeout)
        except grpc.aio.AioRpcError:
            return None


def healthy_workers(status: mpb.ManagerStatus | None) -> list[str]:
    return [] if status is None else [w.worker_id for w in status.workers
                                      if w.state == "healthy"]


async def wait_workers(endpoint: str, count: int = 0, names: Collection[str] = (),
                       timeout: float = 60.0, poll_s: float = 0.2) -> mpb.ManagerStatus:
    """Until at least ``count`` workers, ``names`` among them, are healthy in the manager's
    status (a worker is healthy once registered on the manager's current version). Raises
    TimeoutError naming what was missing, so a stuck start-up says which member never came."""
    deadline = time.monotonic() + timeout
    while True:
        status = await manager_status(endpoint)
        healthy = healthy_workers(status)
        missing = sorted(set(names) - set(healthy))
        if status is not None and len(healthy) >= count and not missing:
            return status
        if time.monotonic() > deadline:
            raise TimeoutError(f"the manager at {endpoint} did not see its workers within "
                               f"{timeout:.0f}s: healthy {healthy}, wanted {count or ''} "
                               f"{missing or ''}".rstrip())
        await asyncio.sleep(poll_s)


# ---- a step ----------------------------------------------------------------------------------


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


class StepReader(Protocol):
    """What a step's stream is read into (the trainer's step)."""

    def take(self, event: mpb.StepEvent, request_ids: list[str]) -> None:
        """One event; ``request_ids`` are the submission's, which its rows index."""

    def resume(self, of: mpb.SubmitStepRequest | None = None) -> mpb.SubmitStepRequest:
        """After the stream broke: what is left of the step (of ``of``, one shard's part of it,
        when given), with the tokens each unfinished request already has (no requests: every
        request's end had streamed)."""

    def failed_over(self, successor: ManagerAt) -> None:
        """The rest of the step goes to ``successor`` now."""


class StepStream:
    """One step's SubmitStep on one manager (a sharded job's: on one shard,
    ``shard_client.JobStepStream`` fans a step out). When the manager dies mid-step the step
    is resumed at its successor (found in etcd within ``resume_wait_s``) with every token
    already generated, instead of being retried whole."""

    def __init__(self, etcd: Any, job: str, manager: ManagerAt, *, max_message_bytes: int,
                 resume_wait_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._etcd = etcd
        self._job = job
        self.manager = manager  # the one streaming now
        self._max_message_bytes = max_message_bytes
        self._resume_wait_s = resume_wait_s
        self._clock = clock

    async def run(self, request: mpb.SubmitStepRequest, reader: StepReader,
                  may_fail_over: bool = True) -> None:
        """Every event of the step into ``reader``, until every request ended. Without
        ``may_fail_over`` (a short round: its acceptance state died with the manager) a dead
        manager fails the step."""
        submit = request
        while submit.requests:
            try:
                await self._stream(submit, reader)
                return
            except grpc.aio.AioRpcError as exc:
                if submit is request:
                    raise
                raise RolloutStreamError(f"the successor refused {request.step_id}'s resume: "
                                         f"{exc.details()}") from exc
            except RolloutStreamError as exc:
                submit = reader.resume()
                if not submit.requests:
                    return  # every request's end had streamed: nothing to resume
                if not may_fail_over:
                    raise
                await self._fail_over(request.step_id, submit, exc)
                reader.failed_over(self.manager)

    async def _stream(self, submit: mpb.SubmitStepRequest, reader: StepReader) -> None:
        ids = [r.request_id for r in submit.requests]
        async for event in stream_step(self.manager.endpoint, submit, self._max_message_bytes):
            reader.take(event, ids)

    async def _fail_over(self, step_id: str, submit: mpb.SubmitStepRequest,
                         broke: RolloutStreamError) -> None:
        gone = self.manager
        self.manager = await find_successor(self._etcd, self._job, gone, broke,
                                            self._resume_wait_s, self._clock)
        # The seeding window is over: the successor resumes the requests on its workers.
        submit.seed_window_s = 0.0
        log.warning("%s: the manager at %s is gone (%s); resuming %d requests with %d tokens "
                    "already generated at %s", step_id, gone.endpoint, broke,
                    len(submit.requests), sum(len(r.resume_token_ids) for r in submit.requests),
                    self.manager.endpoint)


# ---- an agentic step -------------------------------------------------------------------------


@dataclass
class StepScope:
    """An agentic step held open on the manager: once the step's turns played, the remote
    timings the manager measured (Algorithm 1's inputs; None if the manager could not give
    them)."""

    remote: mpb.RemoteTimings | None = None


SCOPE_END_TIMEOUT_S = 10.0


async def _scope_requests(step_id: str, window_s: float, played: asyncio.Future[bool]
                          ) -> AsyncIterator[mpb.SeedWindowRequest]:
    yield mpb.SeedWindowRequest(step_id=step_id, window_s=window_s)
    if await played:  # a failed body only cancels: the manager measures no abandoned step
        yield mpb.SeedWindowRequest(step_id=step_id, end=True)


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
    async with rpc.channel(endpoint, peer_role="manager") as chan:
        call = rollout_manager_pb2_grpc.RolloutManagerStub(chan).HoldSeedWindow(
            _scope_requests(step_id, window_s, played))
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
            if not played.done():  # else a call that already ended leaves the requests waiting
                played.set_result(False)
            call.cancel()


async def _scope_timings(call: Any, endpoint: str) -> mpb.RemoteTimings | None:
    """The manager's last event of a step scope: advisory (Algorithm 1 skips a step without)."""
    try:
        last = await aio.wait_for(call.read(), SCOPE_END_TIMEOUT_S)
    except (grpc.aio.AioRpcError, asyncio.TimeoutError) as exc:  # not TimeoutError on 3.10
        log.warning("no remote timings for the step from %s: %s", endpoint, exc)
        return None
    if last is grpc.aio.EOF or not last.HasField("remote"):
        return None
    return last.remote
