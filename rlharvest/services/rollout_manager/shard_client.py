"""A step on a job whose rollout manager is split into shards (sharding.py): the client finds
every shard's leader, splits the step's requests in proportion to each shard's capacity,
streams one part per shard into the trainer's one reader, and ends the step once every part
ended. Each part fails over on its own (``StepStream``: a shard's standby takes its part over
with every token). While the parts run, queued requests move from a shard with a backlog to a
shard whose workers went idle: the source withdraws them (Withdraw: atomically, only those
that never reached a worker there) and the client submits them to the destination as a part
of their own, so none runs twice."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from rlharvest.common import rpc
from rlharvest.common.pb import rollout_manager_pb2 as mpb
from rlharvest.common.pb import rollout_manager_pb2_grpc
from rlharvest.services.rollout_manager.client import (
    ManagerAt,
    StepReader,
    StepStream,
    find_manager_member,
    manager_status,
)
from rlharvest.services.rollout_manager.sharding import ShardLoad, plan_moves, split_by_capacity

log = logging.getLogger(__name__)
# How long a move waits for the rows its source streamed before it answered.
TOKENS_WAIT_S = 10.0


async def find_shard_leaders(etcd: Any, job: str, shards: int,
                             timeout: float = 60.0) -> dict[int, ManagerAt]:
    """Every shard's leader (waits for each to register)."""
    async def one(shard: int) -> ManagerAt:
        return ManagerAt.of_member(await find_manager_member(etcd, job, timeout, shard=shard))
    found = await asyncio.gather(*(one(s) for s in range(shards)))
    return dict(enumerate(found))


def _serving(status: mpb.ManagerStatus | None, version: int) -> list[mpb.WorkerStatus]:
    """A shard's workers that can run a step of ``version`` now."""
    return [] if status is None else [w for w in status.workers
                                      if w.state == "healthy" and w.weight_version == version]


def shard_load(status: mpb.ManagerStatus | None, version: int) -> ShardLoad:
    """A shard's queue (waiting in its manager, and queued on its workers beyond their slots)
    and the idle slots of its workers on ``version``; nothing for one not answering."""
    serving = _serving(status, version)
    idle = sum(max(0, w.capacity - w.assigned) for w in serving)
    queued_on_workers = sum(max(0, w.assigned - w.capacity) for w in serving)
    return ShardLoad((0 if status is None else status.waiting) + queued_on_workers, idle)


def capacity(status: mpb.ManagerStatus | None, version: int) -> int:
    """Slots of a shard's workers on ``version``: its share of a step of that version."""
    return sum(w.capacity for w in _serving(status, version))


async def withdraw(endpoint: str, request_ids: Sequence[str], limit: int
                   ) -> dict[str, int]:
    """Those of ``request_ids`` the shard at ``endpoint`` gave up, queued ones first, then
    running ones (aborted there), with the tokens it had of each; none when it did not answer
    (then it keeps them all, and a successor of it resumes them)."""
    async with rpc.channel(endpoint, peer_role="manager") as chan:
        try:
            reply = await rollout_manager_pb2_grpc.RolloutManagerStub(chan).Withdraw(
                mpb.WithdrawRequest(request_ids=request_ids, max_requests=limit, running=True),
                timeout=5.0)
        except grpc.aio.AioRpcError as exc:
            log.info("withdrawing from %s: %s", endpoint, exc.details())
            return {}
    return dict(zip(reply.request_ids, reply.tokens))


class _Part:
    """One shard's part of the step: its requests as last submitted, those still open."""

    def __init__(self, shard: int, request: mpb.SubmitStepRequest, stream: StepStream) -> None:
        self.shard = shard
        self.request = request
        self.stream = stream
        self.open = {r.request_id for r in request.requests}
        self.task: asyncio.Task[None]  # its stream, started at once (ShardedStep._start)

    def candidates(self) -> list[str]:
        """Open requests, the last queued first (a manager dispatches its oldest first)."""
        return [r.request_id for r in reversed(self.request.requests)
                if r.request_id in self.open]

    def remove(self, request_ids: Sequence[str]) -> list[mpb.RolloutRequest]:
        """The withdrawn requests leave this part (a resume here no longer names them)."""
        gone = set(request_ids)
        taken = [r for r in self.request.requests if r.request_id in gone]
        kept = [r for r in self.request.requests if r.request_id not in gone]
        del self.request.requests[:]
        self.request.requests.extend(kept)
        self.open -= gone
        return taken


class _PartReader:
    """The trainer's reader as one part sees it: its resume covers only this part, and the
    step's remote timings reach the trainer once, from the part that ends last."""

    def __init__(self, step: ShardedStep, part: _Part, reader: StepReader) -> None:
        self._step = step
        self._part = part
        self._reader = reader

    def take(self, event: mpb.StepEvent, request_ids: list[str]) -> None:
        for c in event.completions:
            self._part.open.discard(c.request_id)
        if event.HasField("remote") and self._step.others_running(self._part):
            event.ClearField("remote")
        self._reader.take(event, request_ids)

    def resume(self, of: mpb.SubmitStepRequest | None = None) -> mpb.SubmitStepRequest:
        left = self._reader.resume(self._part.request)
        self._part.request = left
        self._part.open = {r.request_id for r in left.requests}
        return left

    def failed_over(self, successor: ManagerAt) -> None:
        self._step.leaders[self._part.shard] = successor
        self._reader.failed_over(successor)


class ShardedStep:
    """One step over the ``shards`` of ``job``'s manager, read into one reader."""

    def __init__(self, etcd: Any, job: str, shards: int, *, max_message_bytes: int,
                 resume_wait_s: float, clock: Callable[[], float] = time.monotonic,
                 poll_s: float = 0.2, on_shard: Callable[[ManagerAt], None] | None = None
                 ) -> None:
        self._etcd = etcd
        self._job = job
        self._shards = shards
        self._max_message_bytes = max_message_bytes
        self._resume_wait_s = resume_wait_s
        self._clock = clock
        self._poll_s = poll_s
        self._on_shard = on_shard
        self.leaders: dict[int, ManagerAt] = {}
        self.parts: list[_Part] = []
        self.moved = 0  # requests moved across shards
        self._serial = itertools.count(1)
        self._moving = asyncio.Lock()  # held while a move may add a part

    async def run(self, request: mpb.SubmitStepRequest, reader: StepReader,
                  may_fail_over: bool = True) -> None:
        """Every event of the step into ``reader``, until every part ended. A part that fails
        (its shard's leader gone with no successor) fails the step, as one manager would."""
        self.leaders = await find_shard_leaders(self._etcd, self._job, self._shards)
        statuses = await self._statuses()
        shards = sorted(self.leaders)
        shares = split_by_capacity(len(request.requests), [
            capacity(statuses[s], request.weight_version) for s in shards])
        first = 0
        for shard, share in zip(shards, shares):
            if share:
                self._start(shard, request, request.requests[first:first + share],
                            request.step_id, reader, may_fail_over)
                first += share
        rebalancer = asyncio.create_task(self._rebalance(request, reader, may_fail_over))
        try:
            await self._until_parts_end(rebalancer)
        finally:
            tasks = [rebalancer, *(p.task for p in self.parts)]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _until_parts_end(self, rebalancer: asyncio.Task) -> None:
        while True:
            running = {p.task for p in self.parts if not p.task.done()}
            if not running:
                async with self._moving:  # a move under way may still add a part
                    if all(p.task.done() for p in self.parts):
                        return
                continue
            done, _ = await asyncio.wait(running | {rebalancer},
                                         return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # a part's failure (or the rebalancer's bug) fails the step

    def others_running(self, part: _Part) -> bool:
        return any(not p.task.done() for p in self.parts if p is not part)

    def _start(self, shard: int, request: mpb.SubmitStepRequest,
               requests: Sequence[mpb.RolloutRequest], step_id: str, reader: StepReader,
               may_fail_over: bool) -> None:
        sub = mpb.SubmitStepRequest()
        sub.CopyFrom(request)
        sub.step_id = step_id
        del sub.requests[:]
        sub.requests.extend(requests)
        stream = StepStream(self._etcd, self._job, self.leaders[shard],
                            max_message_bytes=self._max_message_bytes,
                            resume_wait_s=self._resume_wait_s, clock=self._clock)
        part = _Part(shard, sub, stream)
        self.parts.append(part)
        if self._on_shard is not None:
            self._on_shard(stream.manager)
        part.task = asyncio.create_task(
            stream.run(sub, _PartReader(self, part, reader), may_fail_over))

    async def _statuses(self) -> dict[int, mpb.ManagerStatus | None]:
        shards = sorted(self.leaders)
        found = await asyncio.gather(*(manager_status(self.leaders[s].endpoint)
                                       for s in shards))
        return dict(zip(shards, found))

    # ---- moving queued requests across shards ------------------------------------------------

    async def _rebalance(self, request: mpb.SubmitStepRequest, reader: StepReader,
                         may_fail_over: bool) -> None:
        """Until cancelled (the step ended): move queued requests to shards whose workers are
        idle, on each shard's status every ``poll_s``."""
        while True:
            await asyncio.sleep(self._poll_s)
            loads = {s: shard_load(st, request.weight_version)
                     for s, st in (await self._statuses()).items()}
            for move in plan_moves(loads):
                await self.move(request, reader, may_fail_over, move.src, move.dst,
                                move.count)

    async def move(self, request: mpb.SubmitStepRequest, reader: StepReader,
                   may_fail_over: bool, src: int, dst: int, count: int) -> None:
        """Up to ``count`` of the step's requests on shard ``src`` go to shard ``dst``: those
        queued first, then running ones with every token (the rebalancer asks for no more
        than are queued; a caller may ask for more)."""
        async with self._moving:
            for part in [p for p in self.parts if p.shard == src and not p.task.done()]:
                if count > 0:
                    count -= await self._move_from(part, request, reader, may_fail_over, dst,
                                                   count)

    async def _move_from(self, part: _Part, request: mpb.SubmitStepRequest,
                         reader: StepReader, may_fail_over: bool, dst: int, count: int) -> int:
        submitted = part.request
        taken = await withdraw(part.stream.manager.endpoint, part.candidates(), count)
        if part.request is not submitted:
            # The part failed over while the call was under way: its resume named them, so
            # the successor runs them; the dead leader's release is moot.
            log.warning("%s: shard %d failed over during a withdrawal; %d requests stay",
                        request.step_id, part.shard, len(taken))
            return 0
        if not taken:
            return 0
        moved = mpb.SubmitStepRequest(requests=part.remove(list(taken)))
        resumed = await self._with_tokens(moved, taken, reader)
        self.moved += len(taken)
        log.info("%s: %d requests (%d tokens) move from shard %d to idle shard %d",
                 request.step_id, len(taken), sum(taken.values()), part.shard, dst)
        # A part of its own there (its step id differs: a re-attach tells them apart).
        self._start(dst, request, resumed.requests, f"{request.step_id}~{next(self._serial)}",
                    reader, may_fail_over)
        return len(taken)

    async def _with_tokens(self, moved: mpb.SubmitStepRequest, tokens: dict[str, int],
                           reader: StepReader) -> mpb.SubmitStepRequest:
        """The moved requests with every token their source had as resume payloads. The
        source queued those rows on its stream before it answered, so they come; a source
        that died meanwhile may take the last ones with it (then the destination generates
        them again, from the same seeds)."""
        deadline = self._clock() + TOKENS_WAIT_S
        while True:
            resumed = reader.resume(moved)
            have = {r.request_id: len(r.resume_token_ids) for r in resumed.requests}
            if all(have.get(rid, 0) >= n for rid, n in tokens.items()) or \
                    self._clock() >= deadline:
                return resumed
            await asyncio.sleep(0.005)


class JobStepStream(StepStream):
    """The trainer's stream of a step on its job's manager: on a sharded job (the manager it
    found says ``shards`` > 1) the step fans out over every shard (``ShardedStep``), each part
    a ``StepStream`` of its own; else, and for a short round (its acceptance counts one
    step's groups, so it runs whole on the one shard found), one ``StepStream``. Here rather
    than in client.py, so that the part streams' module does not import this one."""

    async def run(self, request: mpb.SubmitStepRequest, reader: StepReader,
                  may_fail_over: bool = True) -> None:
        if self.manager.shards <= 1 or request.HasField("acceptance"):
            await super().run(request, reader, may_fail_over)
            return
        await ShardedStep(self._etcd, self._job, self.manager.shards,
                          max_message_bytes=self._max_message_bytes,
                          resume_wait_s=self._resume_wait_s, clock=self._clock,
                          on_shard=self._on_shard).run(request, reader, may_fail_over)

    def _on_shard(self, manager: ManagerAt) -> None:
        # ``manager`` names one shard streaming now (the trainer's tail reports read it).
        self.manager = manager
