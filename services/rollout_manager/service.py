"""The rollout manager's async shell: turns etcd membership, worker streams and client calls into
events for ``RolloutControl`` (pure, control_loop.py) and carries out the commands it returns.
No policy lives here."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator

import grpc

from rlharvest.common import keys, registry
from rlharvest.common.pb import common_pb2, rollout_manager_pb2 as mpb, rollout_manager_pb2_grpc
from rlharvest.common.pb import rollout_worker_pb2 as wpb
from rlharvest.services.rollout_manager import metrics
from rlharvest.services.rollout_manager.commands import Command, Dispatch, Fail, Migrate, Release
from rlharvest.services.rollout_manager.control_loop import RolloutControl
from rlharvest.services.rollout_manager.tracker import NewRequest, RequestState, StepError
from rlharvest.services.rollout_manager.worker_link import WorkerLink
from rlharvest.common.engine_types import sampling_from_proto

log = logging.getLogger(__name__)

_SAMPLE_INTERVAL_S = 0.25  # throughput samples per worker for the batching profile P

# Worker CommandError codes after which the request may simply go elsewhere.
_RETRYABLE = {grpc.StatusCode.FAILED_PRECONDITION.value[0], grpc.StatusCode.UNAVAILABLE.value[0],
              grpc.StatusCode.ALREADY_EXISTS.value[0], grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]}


# One client event holds at most this many tokens (deltas + completions) so merged events stay far
# below any message size limit; more waiting output starts another event.
_MAX_EVENT_TOKENS = 1 << 16


class _ClientStream:
    """One client's SubmitStep/Generate stream.

    Output waiting for the client is merged into the newest unsent event instead of queued as one
    event per worker step: a client that falls behind gets fewer, larger events, and the manager
    serializes fewer messages (bench/manager_relay.py). At most ``max_events`` events wait; a
    producer beyond that waits for the client (backpressure onto the worker streams).
    """

    def __init__(self, request_ids: list[str], max_events: int):
        self.outstanding = set(request_ids)
        self._events: deque[tuple[mpb.StepEvent, list[int]]] = deque()  # event, [its tokens]
        self._max_events = max_events
        self._ready = asyncio.Event()
        self._room = asyncio.Event()
        self._room.set()
        self._ended = False

    def _tail(self, tokens: int) -> mpb.StepEvent:
        if not self._events or self._events[-1][1][0] + tokens > _MAX_EVENT_TOKENS:
            self._events.append((mpb.StepEvent(), [0]))
            if len(self._events) >= self._max_events:
                self._room.clear()
        event, size = self._events[-1]
        size[0] += tokens
        self._ready.set()
        return event

    async def put_deltas(self, deltas: list, tokens: int) -> None:
        """Forward accepted wire deltas (copied into the event in C, not one by one)."""
        while not self._room.is_set():
            await self._room.wait()
        self._tail(tokens).deltas.extend(deltas)

    def put_completion(self, completion: mpb.Completion) -> None:
        """Never waits and never drops: a completion may exceed the event bound by one."""
        self._tail(len(completion.token_ids)).completions.append(completion)

    def end(self) -> None:
        self._ended = True
        self._ready.set()

    async def take(self) -> mpb.StepEvent | None:
        """The next event for the client; None once the step ended and everything was taken."""
        while not self._events:
            if self._ended:
                return None
            self._ready.clear()
            await self._ready.wait()
        event, _ = self._events.popleft()
        if len(self._events) < self._max_events:
            self._room.set()
        return event


def _unfinished(delta: common_pb2.TokenDelta) -> common_pb2.TokenDelta:
    copy = common_pb2.TokenDelta()
    copy.CopyFrom(delta)
    copy.finished, copy.finish_reason = False, ""
    return copy


class ManagerService(rollout_manager_pb2_grpc.RolloutManagerServicer):
    def __init__(self, control: RolloutControl, etcd, *, job: str, max_message_bytes: int,
                 client_queue: int, tick_interval_s: float):
        self._control = control
        self._etcd = etcd
        self._announced_key = keys.weights_announced_key(job)
        self._max_message_bytes = max_message_bytes
        self._client_queue = client_queue
        self._tick_interval = tick_interval_s
        self._links: dict[str, WorkerLink] = {}
        self._endpoints: dict[str, dict] = {}
        self._streams: dict[str, _ClientStream] = {}  # request id -> the stream that wants it
        self._wake = asyncio.Event()
        self._rate: deque[tuple[float, int]] = deque()  # (when, tokens) over the last 5 s
        self._rate_tokens = 0
        self._sampled_at: dict[str, float] = {}
        self.accepting = True

    # ---- background loops ----------------------------------------------------------------------

    async def watch_workers(self) -> None:
        async for event in registry.watch_members(self._etcd, "rollout_worker"):
            if event.kind == "leave":
                self._lose(event.member_id, "etcd lease expired or worker deregistered")
            elif event.kind == "join" or event.member_id not in self._links:
                await self._join(event.member_id, event.info)
            else:
                self._update(event.member_id, event.info)
            self._wake.set()

    async def run_ticks(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), self._tick_interval)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            self._execute(self._control.tick())
            self._update_rate()

    # ---- membership ----------------------------------------------------------------------------

    async def _join(self, worker_id: str, info: dict) -> None:
        old = self._links.pop(worker_id, None)
        if old is not None:  # the same id came back: a new process
            self._lose(worker_id, "re-registered")
            await old.close()
        if info.get("draining"):
            return
        link = WorkerLink(worker_id, info["endpoint"], self._on_worker_event, self._on_broken,
                          self._max_message_bytes)
        self._links[worker_id] = link
        self._endpoints[worker_id] = info
        self._control.worker_joined(worker_id, int(info["weight_version"]), int(info["capacity"]),
                                    str(info.get("kind", "dedicated")))
        log.info("worker %s joined at %s with version %s", worker_id, info["endpoint"],
                 info["weight_version"])

    def _update(self, worker_id: str, info: dict) -> None:
        self._endpoints[worker_id] = info
        view = self._control.pool.get(worker_id) if worker_id in self._control.pool else None
        if view is None:
            return
        if int(info["weight_version"]) != view.weight_version:
            self._execute(self._control.worker_version_changed(worker_id, int(info["weight_version"])))
        # Draining arrives over the worker's stream with its deadline (_on_worker_event).

    def _on_broken(self, worker_id: str, reason: str) -> None:
        if worker_id in self._links and not self._links[worker_id].alive:
            self._lose(worker_id, reason)
            self._wake.set()

    def _lose(self, worker_id: str, reason: str) -> None:
        if worker_id not in self._control.pool:
            return
        commands = self._control.worker_lost(worker_id, reason)
        if commands:
            log.warning("worker %s lost (%s): %d requests go elsewhere, tokens kept", worker_id,
                        reason, len(commands))
        self._execute(commands)
        link = self._links.pop(worker_id, None)
        if link is not None:
            asyncio.get_running_loop().create_task(link.close())

    # ---- worker events -------------------------------------------------------------------------

    async def _on_worker_event(self, worker_id: str, event: wpb.WorkerEvent) -> None:
        which = event.WhichOneof("event")
        if worker_id not in self._control.pool:
            return
        if which == "step":
            await self._on_step(worker_id, event.step)
        elif which == "load":
            self._on_load(worker_id, event.load)
        elif which == "error":
            self._on_command_error(worker_id, event.error)
        elif which == "draining":
            deadline = time.monotonic() + max(event.draining.deadline_unix - time.time(), 0)
            self._execute(self._control.worker_draining(worker_id, deadline))
            self._wake.set()

    async def _on_step(self, worker_id: str, step: wpb.StepOutputs) -> None:
        # The hot path: the wire deltas go to the tracker and on to the client as they are; no
        # Python object is built per delta (bench/manager_relay.py measures this loop).
        report = self._control.step_outputs(worker_id, step.deltas)
        self._on_load(worker_id, step.load)
        tokens = report.accepted_tokens
        metrics.TOKENS.inc(tokens)
        self._rate.append((time.monotonic(), tokens))
        self._rate_tokens += tokens
        for dropped in report.dropped:
            metrics.TOKENS_DROPPED.labels(dropped.reason).inc(dropped.tokens)
        accepted = report.accepted
        if report.aborted:  # the client must not read "finished" on a request that goes on
            aborted = set(report.aborted)
            accepted = [_unfinished(d) if d.request_id in aborted else d for d in accepted]
        by_stream: dict[_ClientStream, list] = {}
        streams = self._streams
        for delta in accepted:
            stream = streams.get(delta.request_id)
            if stream is not None:
                by_stream.setdefault(stream, []).append(delta)
        for stream, deltas in by_stream.items():
            # A slow client holds this worker's stream here: backpressure.
            await stream.put_deltas(deltas, tokens if len(by_stream) == 1 else
                                    sum(len(d.token_ids) for d in deltas))
        for rid in report.finished:  # after its last delta, in the same or a later event
            stream = streams.get(rid)
            if stream is not None:
                stream.put_completion(self._completion(rid))
            if rid in self._control.tracker:  # not abandoned by its client meanwhile
                self._done(rid, "finished")
        if report.finished or report.aborted:
            self._wake.set()

    def _on_load(self, worker_id: str, load: common_pb2.Load) -> None:
        # One throughput sample per worker per interval is plenty for P (§4.2.1), and taking one
        # walks all of the worker's requests: not something to do for every step message.
        now = time.monotonic()
        if load.executing and load.tokens_per_second and \
                now - self._sampled_at.get(worker_id, 0.0) >= _SAMPLE_INTERVAL_S:
            self._sampled_at[worker_id] = now
            self._control.record_throughput(worker_id, load.executing, load.tokens_per_second)

    def _on_command_error(self, worker_id: str, error: wpb.CommandError) -> None:
        rid = error.request_id
        if rid not in self._control.tracker:
            return
        req = self._control.tracker.get(rid)
        if req.done or req.worker_id != worker_id:
            return  # about an assignment the request already left
        if error.code in _RETRYABLE:
            self._control.tracker.release(rid)
            metrics.MIGRATIONS.labels("refused").inc()
        else:  # the worker refuses the request itself (e.g. longer than its context): final
            self._fail(rid, f"worker {worker_id} refused the request: {error.message}")
        self._wake.set()

    # ---- carrying out commands -----------------------------------------------------------------

    def _execute(self, commands: list[Command]) -> None:
        for c in commands:
            if isinstance(c, Dispatch):
                self._send(c.worker_id, c.request_id)
            elif isinstance(c, Migrate):
                metrics.MIGRATIONS.labels(c.cause).inc()
                self._abort(c.src, c.request_id)
                self._send(c.dst, c.request_id)
            elif isinstance(c, Release):
                metrics.MIGRATIONS.labels(c.cause).inc()
                self._abort(c.worker_id, c.request_id)
            elif isinstance(c, Fail):
                self._notify_failed(c.request_id)

    def _send(self, worker_id: str, request_id: str) -> None:
        link = self._links.get(worker_id)
        if link is None or not link.alive:
            self._lose(worker_id, "no live stream")
            return
        link.add(self._control.tracker.resume_payload(request_id))

    def _abort(self, worker_id: str, request_id: str) -> None:
        link = self._links.get(worker_id)
        if link is not None:
            link.abort([request_id])

    def _fail(self, request_id: str, reason: str) -> None:
        self._control.tracker.fail(request_id, reason)
        self._notify_failed(request_id)

    def _notify_failed(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.put_completion(self._completion(request_id))
        self._done(request_id, "failed")

    def _completion(self, request_id: str) -> mpb.Completion:
        req = self._control.tracker.get(request_id)
        return mpb.Completion(request_id=req.request_id, group_id=req.group_id,
                              token_ids=req.token_ids, logprobs=req.logprobs,
                              weight_version=req.weight_version, finish_reason=req.finish_reason,
                              failed=req.state.value == "failed", migrations=req.migrations)

    def _done(self, request_id: str, outcome: str) -> None:
        metrics.COMPLETIONS.labels(outcome).inc()
        self._control.tracker.forget(request_id)  # delivered: the manager holds it no longer
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.outstanding.discard(request_id)
            if not stream.outstanding:
                stream.end()
                # A step ended: its throughput samples become P for the next (§4.2.1), which
                # is what lets CONTINUOUSLB move executing requests at the next step's tail.
                self._control.finish_step()

    # ---- client RPCs ---------------------------------------------------------------------------

    async def SubmitStep(self, request: mpb.SubmitStepRequest,
                         context: grpc.aio.ServicerContext) -> AsyncIterator[mpb.StepEvent]:
        async for event in self._stream_step(list(request.requests), request.weight_version,
                                             request.no_worker_deadline_s, context):
            yield event

    async def Generate(self, request: mpb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[mpb.StepEvent]:
        async for event in self._stream_step([request.request], request.weight_version,
                                             request.no_worker_deadline_s, context):
            yield event

    async def _stream_step(self, requests: list[mpb.RolloutRequest], version: int,
                           deadline_s: float, context) -> AsyncIterator[mpb.StepEvent]:
        if not self.accepting:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "manager is shutting down")
        await self._check_version(version, context)
        if deadline_s < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"no_worker_deadline_s {deadline_s} is negative; 0 means the "
                                "manager's no_worker_timeout_s")
        new = [NewRequest(r.request_id, r.group_id, tuple(r.prompt_token_ids),
                          sampling_from_proto(r.sampling), version, deadline_s or None)
               for r in requests]
        try:
            ids = self._control.add_step(new)
        except StepError as exc:
            metrics.STEPS.labels("refused").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        metrics.STEPS.labels("accepted").inc()
        stream = _ClientStream(ids, self._client_queue)
        for rid in ids:
            self._streams[rid] = stream
        self._wake.set()
        try:
            while True:
                event = await stream.take()
                if event is None:
                    return
                yield event
        finally:
            self._abandon(stream)

    async def _check_version(self, version: int, context) -> None:
        if version < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"weight_version {version} is negative")
        known = {v.weight_version for v in self._control.pool.all()}
        if version in known:
            return
        announced = await registry.get_versioned(self._etcd, self._announced_key)
        if announced is not None and version <= announced["version"]:
            return
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                            f"weight version {version} is unknown: no worker holds it and it was "
                            f"never announced (workers hold {sorted(known) or 'nothing'}); "
                            "publish it first or ask for a version a worker holds")

    def _abandon(self, stream: _ClientStream) -> None:
        """The client went away: its unfinished requests are aborted, not left to run."""
        for rid in list(stream.outstanding):
            if self._streams.get(rid) is stream:
                req = self._control.tracker.get(rid)
                if req.worker_id is not None:
                    self._abort(req.worker_id, rid)
                self._control.tracker.fail(rid, "client cancelled the step")
                self._control.tracker.forget(rid)
                self._streams.pop(rid, None)

    async def GetStatus(self, request: mpb.GetStatusRequest, context) -> mpb.ManagerStatus:
        counters = self._control.tracker.counters
        workers = []
        for view in self._control.pool.all():
            info = self._endpoints.get(view.worker_id, {})
            workers.append(mpb.WorkerStatus(
                worker_id=view.worker_id, endpoint=info.get("endpoint", ""), kind=view.kind,
                weight_version=view.weight_version, state=view.state.value,
                assigned=self._control.tracker.assigned_count(view.worker_id)))
        return mpb.ManagerStatus(
            workers=workers, in_flight=self._control.tracker.unfinished(),
            waiting=len(self._control.tracker.waiting()),
            tokens_generated=counters.tokens_generated,
            tokens_regenerated=counters.tokens_regenerated, migrations=counters.migrations,
            completions=counters.finished, failures=counters.failed)

    # ---- observability ---------------------------------------------------------------------------

    def refresh_gauges(self) -> None:
        """The gauges that walk the tracker, computed when /metrics is scraped."""
        tracker = self._control.tracker
        metrics.IN_FLIGHT.set(tracker.unfinished())
        metrics.WAITING.set(len(tracker.waiting()))
        metrics.TOKENS_REGENERATED.set(tracker.counters.tokens_regenerated)
        states: dict[str, int] = {"healthy": 0, "draining": 0, "lost": 0}
        for view in self._control.pool.all():
            states[view.state.value] += 1
            on_worker = tracker.on_worker(view.worker_id)
            metrics.ASSIGNED.labels(view.worker_id).set(len(on_worker))
            metrics.PENDING.labels(view.worker_id).set(
                sum(1 for r in on_worker if r.state is RequestState.PENDING))
        for state, count in states.items():
            metrics.WORKERS.labels(state).set(count)
        self._update_rate()

    def _update_rate(self) -> None:
        # Every tick, so the window stays 5 s of entries whether or not anyone scrapes.
        now = time.monotonic()
        while self._rate and self._rate[0][0] <= now - 5:
            self._rate_tokens -= self._rate.popleft()[1]
        metrics.TOKENS_PER_SECOND.set(self._rate_tokens / 5)

    def health(self) -> dict:
        return {"status": "ok", "workers": len(self._links),
                "in_flight": self._control.tracker.unfinished(),
                "tokens_regenerated": self._control.tracker.counters.tokens_regenerated}
