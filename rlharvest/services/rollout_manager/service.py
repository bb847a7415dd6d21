"""The rollout manager's async shell: it only moves bytes. Worker events go to ``RolloutControl``
(pure, control_loop.py) whole, one call each, and the ``Outcome`` it returns is carried out:
commands to the workers (workers.py), rows and completions to the clients' streams. The optional
features watch it all as ``ManagerObserver``s (observer.py); the shell never knows which run.
No policy lives here: which refusals mean "try elsewhere", which steps may start, what a client
going away drops and when P is frozen are the core's."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import grpc

from rlharvest.common import errors, server_guard
from rlharvest.common.aio import wait_event
from rlharvest.common.delta_batch import Rows
from rlharvest.common.pb import rollout_manager_pb2 as mpb, rollout_manager_pb2_grpc
from rlharvest.common.pb import rollout_worker_pb2 as wpb
from rlharvest.services.rollout_manager import metrics
from rlharvest.services.rollout_manager.client_stream import ClientStream
from rlharvest.services.rollout_manager.commands import Command
from rlharvest.services.rollout_manager.control_loop import RolloutControl
from rlharvest.services.rollout_manager.observer import ManagerObserver, Submission
from rlharvest.services.rollout_manager.outcome import Delivery, Outcome
from rlharvest.services.rollout_manager.status import Reporter
from rlharvest.services.rollout_manager.step import Step
from rlharvest.services.rollout_manager.workers import Workers


class ManagerService(rollout_manager_pb2_grpc.RolloutManagerServicer):
    def __init__(self, control: RolloutControl, etcd, *, job: str, max_message_bytes: int,
                 client_queue: int, tick_interval_s: float,
                 observers: Sequence[ManagerObserver] = (),
                 shard: tuple[int, int] = (0, 1)) -> None:
        if control.config.job != job:
            raise ValueError(f"the core fences job {control.config.job!r}, the service serves "
                             f"{job!r}; build the core with ControlConfig(job={job!r})")
        self.control = control
        self._client_queue = client_queue
        self._tick_interval = tick_interval_s
        self._observers = list(observers)
        self._step_streams: dict[int, ClientStream] = {}  # step key -> the stream reading it
        self._wake = asyncio.Event()
        self.workers = Workers(control, etcd, job=job, max_message_bytes=max_message_bytes,
                               on_event=self._on_worker_event, execute=self.execute,
                               wake=self.wake, observers=self._observers, shard=shard)
        self.report = Reporter(control)
        self.accepting = True
        self.leading = True  # False while a standby (main.py's election)
        for observer in self._observers:
            observer.bind(self)

    def stop_accepting(self) -> None:
        """Shutting down: new steps are refused (UNAVAILABLE) from now on."""
        self.accepting = False

    def wake(self) -> None:
        self._wake.set()

    async def run_ticks(self) -> None:
        while True:
            await wait_event(self._wake, self._tick_interval)
            self._wake.clear()
            for observer in self._observers:  # before the tick: it dispatches what they freed
                self.execute(observer.before_tick())
            with metrics.TICK_SECONDS.time():
                self.execute(self.control.tick())
            for observer in self._observers:
                observer.after_tick()
            self.report.update_rate()

    # ---- worker events, and carrying out what the core decided --------------------------------

    async def _on_worker_event(self, worker_id: str, event: wpb.WorkerEvent) -> None:
        out = self.control.worker_event(worker_id, event)
        self.report.worker_event(worker_id, out)
        behind = self._carry_out(out, worker_id)
        # Only now, with every row and completion of this event queued: a worker lost while
        # its read waits here (cancelled) must not take a finished request's completion with
        # it (the core has it delivered, so nothing would deliver it again).
        for stream in behind:
            await stream.room()  # a slow client holds this worker's stream here: backpressure

    def execute(self, commands: Sequence[Command]) -> None:
        self._carry_out(self.control.settle(commands))

    def _carry_out(self, out: Outcome, worker_id: str = "") -> list[ClientStream]:
        """Returns the streams whose client was already behind (the caller waits for them)."""
        for c in out.commands:
            self.workers.command(c, out.payloads)
        behind = self._forward(out.rows)
        for delivery in out.deliveries:
            self._deliver(delivery)
        if out.lost:
            self.workers.gone(worker_id, out.lost, len(out.commands))
        if out.wake:
            self.wake()
        return behind

    def _forward(self, rows: list[tuple[int, Rows]]) -> list[ClientStream]:
        # Every step's rows are queued before any wait, in the order the tracker took them
        # (client_stream.put_rows): a wait on one slow client must not hold back another step's
        # rows while a migrated request's next worker sends the rows after them.
        return [stream for key, part in rows
                if (stream := self._step_streams.get(key)) is not None and stream.put_rows(part)]

    def _deliver(self, d: Delivery) -> None:
        metrics.COMPLETIONS.labels(d.outcome).inc()
        if d.discarded_tokens:
            metrics.TOKENS_DISCARDED.inc(d.discarded_tokens)
        stream = self._step_streams.get(d.step.key)
        if stream is not None:
            stream.put_completion(d.completion)
        for observer in self._observers:
            observer.delivered(d)
        if stream is not None and d.verdicts:  # before the step's end, if this was its last
            stream.put_verdicts([mpb.GroupVerdict(group_id=v.group_id, accepted=v.accepted)
                                 for v in d.verdicts])
        if d.ended:  # and froze P if it is a step of the RL loop
            self._end_stream(d.step)

    def _end_stream(self, step: Step) -> None:
        remote = self.report.remote(step.remote) \
            if step.remote is not None and step.profiled else None
        stream = self._step_streams.pop(step.key, None)
        for observer in self._observers:
            observer.step_ended(step, remote)
        if stream is not None:
            stream.end(remote)

    # ---- client RPCs ---------------------------------------------------------------------------

    async def SubmitStep(self, request: mpb.SubmitStepRequest,
                         context: grpc.aio.ServicerContext) -> AsyncIterator[mpb.StepEvent]:
        async for event in self._stream_step(Submission.of_step(request), context):
            yield event

    async def Generate(self, request: mpb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[mpb.StepEvent]:
        async for event in self._stream_step(Submission.of_generate(request), context):
            yield event

    async def _stream_step(self, submission: Submission, context: grpc.aio.ServicerContext
                           ) -> AsyncIterator[mpb.StepEvent]:
        await self._admit_client(context)
        claims = (observer.claim(submission) for observer in self._observers)
        stream = next((s for s in claims if s is not None), None)
        if stream is None:
            stream = await self._start_step(submission, context)
        self.wake()
        try:
            while (event := await stream.take()) is not None:
                yield event
        finally:
            if not [o for o in self._observers if o.client_left(stream)]:
                self.abandon(stream)

    async def _start_step(self, submission: Submission, context: grpc.aio.ServicerContext
                          ) -> ClientStream:
        version = submission.weight_version
        try:
            submission.check()
            step = self.control.add_step(
                submission.step_id, submission.new_requests(), version,
                announced_version=await self.workers.announced_for(version),
                profiled=submission.profiled, acceptance=submission.acceptance,
                seed_window_s=submission.seed_window_s)
        except errors.ServiceError as exc:
            metrics.STEPS.labels("refused").inc()
            await errors.abort(context, exc)
        metrics.STEPS.labels("accepted").inc()
        stream = self.open_stream(step)
        for observer in self._observers:
            observer.step_started(step, stream, submission)
        return stream

    def open_stream(self, step: Step) -> ClientStream:
        stream = ClientStream(step, self._client_queue)
        if not step.ended:  # an ended step's cleanup ran already: nothing would remove it
            self._step_streams[step.key] = stream
        return stream

    def abandon(self, stream: ClientStream) -> None:
        # Nobody reads this stream any more: a worker's read loop waiting in room() for the
        # client to make room must go on now (its rows are dropped), not until the stall
        # timeout declares that worker lost.
        stream.detach()
        ended = stream.step.ended  # then its end's cleanup ran already
        commands = self.control.abandon_step(stream.step)
        if self.accepting:
            self.execute(commands)
        # Shutting down: the requests stay on the workers, which keep them for the successor
        # (session_hub.py) instead of aborting them; the trainer resumes the step there.
        if not ended:
            for observer in self._observers:
                observer.step_ended(stream.step, None)
        if self._step_streams.get(stream.step.key) is stream:
            del self._step_streams[stream.step.key]

    async def _admit_client(self, context: grpc.aio.ServicerContext) -> None:
        """A step's client is served by the leader only, while it accepts work."""
        if not self.accepting:
            await errors.abort(context, errors.Unavailable("manager is shutting down; submit "
                                                           "the step to its successor"))
        await server_guard.require_job(context, self.control.config.job)  # this job's trainer
        if not self.leading:
            await errors.abort(context, errors.Unavailable(
                "this manager stands by for the job's leader; submit the step to the manager "
                "whose etcd record says role 'leader'"))

    async def HoldSeedWindow(self, requests: AsyncIterator[mpb.SeedWindowRequest],
                             context: grpc.aio.ServicerContext
                             ) -> AsyncIterator[mpb.SeedWindowEvent]:
        """An agentic step's scope (its turns are Generate calls): the first request opens the
        seeding window for ``window_s`` and the remote timings; the seed workers are lent to
        training from the close until the call ends. A request with ``end`` ends it with the
        step's remote timings, Algorithm 1's inputs. A client that goes away ends it without
        (so does a half-close without ``end``: grpc reads a cancelled call as an ended one)."""
        await self._admit_client(context)
        incoming = aiter(requests)
        first = await anext(incoming, None)
        if first is None:
            return
        key = ("seed-window", first.step_id)
        try:
            self.control.open_scope(key, first.window_s)
        except errors.ServiceError as exc:
            await errors.abort(context, exc)
        held = [w for observer in self._observers
                for w in observer.scope_opened(key, first.window_s)]
        ended = False
        try:
            yield mpb.SeedWindowEvent(seed_worker_ids=held)
            async for request in incoming:
                if request.end:
                    ended = True
                    break
        finally:  # also when cancelled: the seed workers are back before any last event
            timings = self.control.close_scope(key)
            for observer in self._observers:
                observer.scope_closed(key)
        if ended and timings is not None:
            yield mpb.SeedWindowEvent(remote=self.report.remote(timings))

    async def Withdraw(self, request: mpb.WithdrawRequest,
                       context: grpc.aio.ServicerContext) -> mpb.WithdrawReply:
        """A sharded job's client takes requests to another shard (sharding.py): queued ones,
        and with ``running`` those on a worker too. No await between the core's choice and
        the reply: no tick dispatches or finishes one meanwhile, and every row the tracker took
        of them is on the client's stream before the reply."""
        await self._admit_client(context)
        if request.max_requests < 0:
            await errors.abort(context, errors.InvalidArgument(
                f"max_requests {request.max_requests} must be 0 (no limit) or more"))
        out = self.control.withdraw(list(request.request_ids), request.max_requests,
                                    request.running)
        self.execute(out.commands)
        for step in out.ended:
            self._end_stream(step)
        if out.taken:
            metrics.WITHDRAWN.inc(len(out.taken))
        return mpb.WithdrawReply(request_ids=out.taken, tokens=out.tokens)

    async def GetStatus(self, request: mpb.GetStatusRequest, context) -> mpb.ManagerStatus:
        return self.report.status(self.workers.endpoints)

    # ---- observability ---------------------------------------------------------------------------

    def refresh_gauges(self) -> None:
        self.report.refresh_gauges()
        for observer in self._observers:
            observer.refresh_gauges()

    def health(self) -> dict:
        return self.report.health(len(self.workers.links))
