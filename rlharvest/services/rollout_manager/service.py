"""The rollout manager's async shell: turns etcd membership, worker streams and client calls into
events for ``RolloutControl`` (pure, control_loop.py) and carries out the commands it returns.
No policy lives here: which refusals mean "try elsewhere", which steps may start, what a client
going away drops and when P is frozen are the core's."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from functools import partial

import grpc

from rlharvest.common import delta_batch, errors, keys, registry, server_guard, start_weights
from rlharvest.common.aio import wait_event
from rlharvest.common.etcd_outage import etcd_away, with_etcd
from rlharvest.common.engine_types import sampling_from_proto
from rlharvest.common.pb import rollout_manager_pb2 as mpb, rollout_manager_pb2_grpc
from rlharvest.common.pb import rollout_worker_pb2 as wpb
from rlharvest.services.rollout_manager import metrics
from rlharvest.services.rollout_manager.client_stream import ClientStream
from rlharvest.services.rollout_manager.reattach import Journals, fingerprint
from rlharvest.services.rollout_manager.commands import (
    Abort,
    Command,
    Dispatch,
    Fail,
    Forget,
    Migrate,
    Release,
)
from rlharvest.services.rollout_manager.control_loop import RolloutControl
from rlharvest.services.rollout_manager.remote_timing import RemoteStepTimings
from rlharvest.services.rollout_manager.step import Step
from rlharvest.services.rollout_manager.seed_window import SEED_KIND, SeedWindows
from rlharvest.services.rollout_manager.stream_scaler import StreamScaler
from rlharvest.services.rollout_manager.tail_batching import TailBatchingStep
from rlharvest.services.rollout_manager.tp_accounting import PreemptionTally, round_kind
from rlharvest.services.rollout_manager.tp_publisher import TpPublisher
from rlharvest.services.rollout_manager.tracker import ApplyReport, NewRequest, RequestState
from rlharvest.services.rollout_manager.worker_link import WorkerLink, session_role

log = logging.getLogger(__name__)


class ManagerService(rollout_manager_pb2_grpc.RolloutManagerServicer):
    def __init__(self, control: RolloutControl, etcd, *, job: str, max_message_bytes: int,
                 client_queue: int, tick_interval_s: float,
                 tp_publisher: TpPublisher | None = None,
                 stream_scaler: StreamScaler | None = None, reattach_grace_s: float = 0.0):
        self._control = control
        self._etcd = etcd
        self._job = job
        self._announced_key = keys.weights_announced_key(job)
        self._cap_key = keys.instance_cap_key(job)
        self._max_message_bytes = max_message_bytes
        self._client_queue = client_queue
        self._tick_interval = tick_interval_s
        self._links: dict[str, WorkerLink] = {}
        self._endpoints: dict[str, dict] = {}
        self._streams: dict[str, ClientStream] = {}  # request id -> the stream that wants it
        self._step_streams: dict[int, ClientStream] = {}  # step key -> the stream reading it
        self._wake = asyncio.Event()
        self._rate: deque[tuple[float, int]] = deque()  # (when, tokens) over the last 5 s
        self._rate_tokens = 0
        self._last_remote: mpb.RemoteTimings | None = None
        # RollPacker's TP planner (--tp-planner): preemptions per step, finished lengths per step.
        self._preemptions = PreemptionTally()
        self._tp = tp_publisher
        self._step_lengths: dict[int, list[int]] = {}  # step key -> finished response lengths
        # RollPacker's stream-trainer scaling (--stream-scaling; stream_scaler.py).
        self._scaler = stream_scaler
        # RLBoost's seeding window: the seed workers' part of each step (seed_window.py).
        self._seeds = SeedWindows(control, self._execute, self._wake.set)
        self.accepting = True
        self.leading = True  # False while a standby (main.py's election)
        # Trainer re-attach (reattach.py): steps whose client left run on this long.
        self._journals = Journals(reattach_grace_s, time.monotonic) \
            if reattach_grace_s > 0 else None

    def stop_accepting(self) -> None:
        """Shutting down: new steps are refused (UNAVAILABLE) from now on."""
        self.accepting = False

    # ---- background loops ----------------------------------------------------------------------

    async def watch_workers(self) -> None:
        await self._watch("rollout_worker")

    async def watch_coexecutors(self) -> None:
        """Serving co-executors lent to this job (``job`` in their record) join as workers of
        kind ``serving``: the same Session contract, their own admission (ROSE's proxy)."""
        await self._watch("coexecutor")

    async def watch_start_weights(self) -> None:
        """The job's start weights by fingerprint (its trainer writes them): version-0
        requests go only to workers whose own are these."""
        key = keys.start_weights_key(self._job)
        async for event in registry.list_and_watch(self._etcd, key, prefix=False):
            raw = (event.values.get(key) if isinstance(event, registry.Listing)
                   else event.value)
            self._start_weights_seen(start_weights.parse_record(raw))

    def _start_weights_seen(self, fingerprint: str) -> None:
        if fingerprint != self._control.pool.start_weights:
            self._execute(self._control.job_start_weights(fingerprint))
            log.info("job %s starts from weights %s", self._job, fingerprint or "undeclared")
            self._wake.set()

    async def _read_start_weights(self) -> None:
        """Before a version-0 step: the record as etcd has it now. The trainer writes it just
        before its first step, and the watch may not have brought it yet; unreadable, the
        watched value stands (the watch catches up when etcd is back)."""
        key = keys.start_weights_key(self._job).encode()
        try:
            found = await with_etcd(partial(self._etcd.get, key),
                                    "reading the job's start weights", deadline_s=2.0)
        except Exception as exc:
            if not etcd_away(exc):
                raise
            return
        self._start_weights_seen(start_weights.parse_record(found.value if found else None))

    async def _watch(self, service: str) -> None:
        """Join only the members whose record names this job (a version is a job's;
        another job's worker at the same version number holds another policy): a dedicated,
        spot or seed worker's ``--job``, a co-executor lent to this job, a worker placed on a
        node whose turn is this job's (WEAVE, placement_follower.py) once it holds its weights."""
        async for event in registry.watch_members(self._etcd, service):
            if event.kind != "leave" and not self._serves_here(event.info):
                if event.member_id in self._links:  # lent to (or its node's turn is) another job
                    self._lose(event.member_id,
                               f"serves job {event.info.get('job') or 'none'!r} now")
                continue
            if event.kind == "leave":
                self._lose(event.member_id, "etcd lease expired or worker deregistered")
            elif event.kind == "join" or event.member_id not in self._links:
                await self._join(event.member_id, event.info)
            else:
                self._update(event.member_id, event.info)
            self._wake.set()

    def _serves_here(self, info: dict) -> bool:
        return info.get("job") == self._job

    async def greet_workers(self, timeout: float) -> list[str]:
        """Leadership begins (the watch loops run): wait up to ``timeout`` until every worker
        registered now has a session whose first event came, so the requests they keep for a
        successor are known before a client's step is taken. Returns those not greeted."""
        expected = set()
        for service in ("rollout_worker", "coexecutor"):
            for key, info in (await registry.list_members(self._etcd, service)).items():
                if self._serves_here(info) and not info.get("draining"):
                    expected.add(keys.parse_member_key(key)[1])
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            missing = sorted(w for w in expected
                             if w not in self._links or not self._links[w].greeted)
            if not missing or loop.time() >= deadline:
                return missing
            await asyncio.sleep(0.02)

    async def watch_instance_cap(self) -> None:
        """The job's N_prem in etcd (RLBoost Algorithm 1): workers beyond it stand by."""
        async for event in registry.list_and_watch(self._etcd, self._cap_key, prefix=False):
            raw = (event.values.get(self._cap_key) if isinstance(event, registry.Listing)
                   else event.value)
            cap = registry.parse_instance_cap(raw)
            if cap != self._control.pool.instance_cap:
                self._control.pool.set_instance_cap(cap)
                log.info("instance cap for spot workers: %s", "none" if cap is None else cap)
            metrics.INSTANCE_CAP.set(-1 if cap is None else cap)
            self._wake.set()

    async def run_ticks(self) -> None:
        while True:
            await wait_event(self._wake, self._tick_interval)
            self._wake.clear()
            if self._scaler is not None:  # before the tick: it dispatches what lending released
                self._execute(self._scale_due())
            self._execute(self._control.tick())
            self._seeds.recheck()  # a remote worker the tick found gone or drained
            self._update_rate()

    # ---- membership ----------------------------------------------------------------------------

    async def _join(self, worker_id: str, info: dict) -> None:
        old = self._links.pop(worker_id, None)
        if old is not None:  # the same id came back: a new process
            self._lose(worker_id, "re-registered")
            await old.close()
        if info.get("draining"):
            return
        try:
            self._control.worker_joined(
                worker_id, int(info["weight_version"]), int(info["capacity"]),
                str(info.get("kind", "dedicated")), str(info.get("admission", "slots")),
                int(info.get("vocab_size", 0)), str(info.get("start_weights", "")))
        except ValueError as exc:
            log.error("worker %s left out: %s", worker_id, exc)
            return
        self._links[worker_id] = WorkerLink(
            worker_id, info["endpoint"], self._on_worker_event, self._on_broken,
            self._max_message_bytes, session_role(str(info.get("kind", "dedicated"))),
            job=self._job, start_weights=lambda: self._control.pool.start_weights)
        self._endpoints[worker_id] = info
        log.info("worker %s joined at %s with version %s", worker_id, info["endpoint"],
                 info["weight_version"])
        if info.get("kind") == SEED_KIND:
            self._seeds.seed_joined(worker_id)

    def _update(self, worker_id: str, info: dict) -> None:
        self._endpoints[worker_id] = info
        view = self._control.pool.get(worker_id) if worker_id in self._control.pool else None
        if view is None:
            return
        start = str(info.get("start_weights", ""))
        if int(info["weight_version"]) != view.weight_version or start != view.start_weights:
            self._execute(self._control.worker_version_changed(
                worker_id, int(info["weight_version"]), start))
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
        self._seeds.recheck()
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
            self._control.worker_load(worker_id, event.load.pending, event.load.executing,
                                      event.load.kv_capacity_tokens, event.load.kv_used_tokens)
            self._count_preemptions(worker_id, event.load.preemptions)
        elif which == "error":
            error = event.error
            self._execute(self._control.command_refused(worker_id, error.request_id, error.code,
                                                        error.message, error.handle))
            self._wake.set()
        elif which == "kept":
            self._execute(self._control.worker_keeps(worker_id, list(event.kept.request_ids)))
            self._wake.set()
        elif which == "draining":
            deadline = time.monotonic() + max(event.draining.deadline_unix - time.time(), 0)
            self._execute(self._control.worker_draining(worker_id, deadline))
            self._wake.set()

    async def _on_step(self, worker_id: str, step: wpb.StepOutputs) -> None:
        # The hot path (bench/manager_relay.py): the batch's columns go to the tracker and on
        # to the client as arrays; no Python object is built per row or per token.
        control = self._control
        if step.batch.job != self._job:  # it holds another job's weights now: none of these
            metrics.TOKENS_DROPPED.labels("other_job").inc(len(step.batch.token_ids) // 4)
            self._lose(worker_id, f"sent tokens of job {step.batch.job!r}'s weights")
            self._wake.set()
            return
        try:
            rows = delta_batch.decode(step.batch)
        except delta_batch.MalformedBatch as exc:
            log.warning("worker %s sent a malformed batch, dropped: %s", worker_id, exc)
            metrics.TOKENS_DROPPED.labels("malformed").inc(len(step.batch.token_ids) // 4)
            rows = delta_batch.empty()
        report = control.step_outputs(worker_id, rows)
        load = step.load
        control.worker_load(worker_id, load.pending, load.executing, load.kv_capacity_tokens,
                            load.kv_used_tokens)
        self._count_preemptions(worker_id, load.preemptions)  # before this event's completions
        control.engine_step(worker_id, step.stats)
        tokens = report.accepted_tokens
        metrics.TOKENS.inc(tokens)
        self._rate.append((time.monotonic(), tokens))
        self._rate_tokens += tokens
        for dropped in report.dropped:
            metrics.TOKENS_DROPPED.labels(dropped.reason).inc(dropped.tokens)
        behind = self._forward(report) if len(report.accepted) else []
        streams = self._streams
        for rid in report.finished:  # after its last row, in the same or a later event
            stream = streams.get(rid)
            if stream is not None:  # not abandoned by its client meanwhile
                self._deliver(stream, self._completion(rid), "finished")
        if report.finished or report.aborted:
            self._wake.set()
        # Only now, with every row and completion of this event queued: a worker lost while
        # its read waits here (cancelled) must not take a finished request's completion with
        # it (the tracker has it finished, so nothing would deliver it again).
        for stream in behind:
            await stream.room()  # a slow client holds this worker's stream here: backpressure

    def _forward(self, report: ApplyReport) -> list[ClientStream]:
        """Accepted rows to the streams of their steps, renamed by their index in the step;
        returns the streams whose client was already behind (the caller waits for them)."""
        accepted = report.accepted
        if accepted.ends:  # the client must not read "ended" on a request the worker aborted
            accepted = dataclasses.replace(accepted, ends={
                r: why for r, why in accepted.ends.items() if why != "abort"})
        # Every step's rows are queued before any wait, in the order the tracker took them
        # (client_stream.put_rows): a wait on one slow client must not hold back another step's
        # rows while a migrated request's next worker sends the rows after them.
        return [stream for key, rows in delta_batch.by_key(accepted, report.tags,
                                                          report.indices)
                if (stream := self._step_streams.get(key)) is not None and stream.put_rows(rows)]

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
                if c.abort:
                    self._abort(c.worker_id, c.request_id)
            elif isinstance(c, Fail):
                if c.worker_id is not None:
                    self._abort(c.worker_id, c.request_id)
                self._notify_failed(c.request_id, c.cancelled)
            elif isinstance(c, Abort):
                self._abort(c.worker_id, c.request_id)
            elif isinstance(c, Forget):
                self._forget(c.worker_id)

    def _forget(self, worker_id: str) -> None:
        """Drop what the service keeps about a worker the core forgot (its link went at the
        loss)."""
        self._endpoints.pop(worker_id, None)
        self._preemptions.forget(worker_id)
        # Else the last values of its series stay exported for as long as the manager runs.
        metrics.ASSIGNED.remove(worker_id)
        metrics.PENDING.remove(worker_id)

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

    def _notify_failed(self, request_id: str, cancelled: bool = False) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            self._deliver(stream, self._completion(request_id, cancelled),
                          "cancelled" if cancelled else "failed")

    def _deliver(self, stream: ClientStream, completion: mpb.Completion, outcome: str) -> None:
        stream.put_completion(completion)
        if self._journals is not None:
            self._journals.record(stream.step.key, completion)
        self._done(completion.request_id, outcome)

    def _completion(self, request_id: str, cancelled: bool = False) -> mpb.Completion:
        req = self._control.tracker.get(request_id)
        if cancelled:  # not needed: its partial tokens are discarded, never trained
            metrics.TOKENS_DISCARDED.inc(req.generated)
            return mpb.Completion(request_id=req.request_id, group_id=req.group_id,
                                  weight_version=req.weight_version,
                                  finish_reason=req.finish_reason, failed=True, cancelled=True,
                                  migrations=req.migrations)
        return mpb.Completion(request_id=req.request_id, group_id=req.group_id,
                              token_ids=req.token_ids, logprobs=req.logprobs,
                              weight_version=req.weight_version, finish_reason=req.finish_reason,
                              failed=req.state.value == "failed", migrations=req.migrations)

    def _done(self, request_id: str, outcome: str) -> None:
        """The completion is in its client's stream: delivered, as far as the core is told."""
        metrics.COMPLETIONS.labels(outcome).inc()
        stream = self._streams.pop(request_id)
        lengths = self._step_lengths.get(stream.step.key)
        if lengths is not None and outcome == "finished":
            lengths.append(self._control.tracker.get(request_id).generated)
        step = self._control.deliver(request_id, succeeded=outcome == "finished")
        policy = stream.step.policy
        if isinstance(policy, TailBatchingStep):  # before the step's end, if this was its last
            stream.put_verdicts([mpb.GroupVerdict(group_id=v.group_id, accepted=v.accepted)
                                 for v in policy.verdicts(stream.step)])
        if step is None:
            if self._scaler is not None and self._scaler.progressed(stream.step):
                self._wake.set()  # a milestone: the next tick observes it (_scale_due)
            return
        # The step ended (and froze P if it is a step of the RL loop).
        remote = None
        if step.remote is not None and step.profiled:
            remote = self._report_remote(step.remote)
        self._step_streams.pop(step.key, None)
        lengths = self._step_lengths.pop(step.key, None)
        self._plan_tp(step, lengths)
        self._scale_step_ended(step, lengths)  # before the end: the workers are back by then
        self._seeds.step_ended(step.key)
        if self._journals is not None:
            self._journals.ended(step.key, remote)
        stream.end(remote)

    # ---- RollPacker's TP planner (advisory; tp_publisher.py) -----------------------------------

    def _count_preemptions(self, worker_id: str, total: int) -> None:
        new = self._preemptions.report(worker_id, max(total, 0))
        if new:
            metrics.PREEMPTIONS.inc(new)

    def _plan_tp(self, step: Step, lengths: list[int] | None) -> None:
        """The step finished: its preemptions (the increase of the workers' totals while it ran)
        and its finished response lengths go to the planner; the plan is written in the
        background. Steps with an acceptance rule are short rounds, all others long ones."""
        preemptions = self._preemptions.close(step.key)
        if self._tp is None or preemptions is None or lengths is None:
            return
        try:
            self._tp.step_ended(step.step_id, round_kind(isinstance(step.policy,
                                                                    TailBatchingStep)),
                                preemptions, lengths)
        except Exception:  # advisory: the planner must never break a step's stream
            log.exception("TP planner: step %s not observed", step.step_id)

    # ---- RollPacker's stream-trainer scaling (stream_scaler.py) ------------------------------

    def _scale_due(self) -> list[Command]:
        """Observe the steps that reached a milestone; lend workers to training on a decision."""
        assert self._scaler is not None
        try:
            return self._scaler.run_due()
        except Exception:  # it must never stop the tick loop
            log.exception("stream scaling: observation failed")
            return []

    def _scale_step_ended(self, step: Step, lengths: list[int] | None) -> None:
        """``lengths``: the finished step's response lengths (the next step's history), None
        when it was abandoned. Workers it lent are healthy again."""
        if self._scaler is None:
            return
        try:
            if self._scaler.step_ended(step, lengths):
                self._wake.set()  # the returned workers take waiting work at the next tick
        except Exception:
            log.exception("stream scaling: step %s not closed", step.step_id)

    # ---- client RPCs ---------------------------------------------------------------------------

    async def SubmitStep(self, request: mpb.SubmitStepRequest,
                         context: grpc.aio.ServicerContext) -> AsyncIterator[mpb.StepEvent]:
        acceptance = request.acceptance if request.HasField("acceptance") else None
        print_ = None  # journaled for a re-attach (reattach.py): steps without acceptance rule
        if self._journals is not None and acceptance is None:
            print_ = fingerprint(request.weight_version, request.requests)
        async for event in self._stream_step(request.step_id, list(request.requests),
                                             request.weight_version,
                                             request.no_worker_deadline_s, True, context,
                                             acceptance, request.seed_window_s, print_):
            yield event

    async def Generate(self, request: mpb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[mpb.StepEvent]:
        # One request is not a step of the RL loop: its end never freezes P.
        async for event in self._stream_step(request.request.request_id, [request.request],
                                             request.weight_version,
                                             request.no_worker_deadline_s, False, context):
            yield event

    async def _stream_step(self, step_id: str, requests: list[mpb.RolloutRequest], version: int,
                           deadline_s: float, profiled: bool,
                           context: grpc.aio.ServicerContext,
                           acceptance: mpb.Acceptance | None = None,
                           seed_window_s: float = 0.0, print_: bytes | None = None
                           ) -> AsyncIterator[mpb.StepEvent]:
        await self._admit_client(context)
        stream = self._reattach(step_id, print_) if print_ is not None else None
        if stream is None:
            stream = await self._start_step(step_id, requests, version, deadline_s, profiled,
                                            context, acceptance, seed_window_s)
            if print_ is not None:
                assert self._journals is not None  # print_ is only made with journals
                self._journals.open(step_id, stream.step.key, print_, stream)
        self._wake.set()
        try:
            while (event := await stream.take()) is not None:
                yield event
        finally:
            self._abandon(stream)

    async def _admit_client(self, context: grpc.aio.ServicerContext) -> None:
        """A step's client is served by the leader only, while it accepts work."""
        if not self.accepting:
            await errors.abort(context, errors.Unavailable("manager is shutting down; submit "
                                                           "the step to its successor"))
        await server_guard.require_job(context, self._job)  # under TLS: this job's trainer
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
        try:
            SeedWindows.check(first.window_s)
        except errors.ServiceError as exc:
            await errors.abort(context, exc)
        key = ("seed-window", first.step_id)
        seeds = self._seeds.step_started(key, first.window_s)
        self._control.remote.scope_opened(key)
        ended = False
        try:
            yield mpb.SeedWindowEvent(seed_worker_ids=seeds)
            async for request in incoming:
                if request.end:
                    ended = True
                    break
        finally:  # also when cancelled: the seed workers are back before any last event
            timings = self._control.remote.scope_closed(key)
            self._seeds.step_ended(key)
        if ended and timings is not None:
            yield mpb.SeedWindowEvent(remote=self._report_remote(timings))

    def _report_remote(self, timings: RemoteStepTimings) -> mpb.RemoteTimings:
        """A step's remote timings as its client gets them, kept for GetStatus and exported."""
        self._last_remote = mpb.RemoteTimings(**dataclasses.asdict(timings))
        metrics.observe_remote(timings)
        return self._last_remote

    async def _start_step(self, step_id: str, requests: list[mpb.RolloutRequest], version: int,
                          deadline_s: float, profiled: bool, context: grpc.aio.ServicerContext,
                          acceptance: mpb.Acceptance | None, seed_window_s: float
                          ) -> ClientStream:
        new = [NewRequest(r.request_id, r.group_id, tuple(r.prompt_token_ids),
                          sampling_from_proto(r.sampling), version, deadline_s or None,
                          tuple(r.resume_token_ids), tuple(r.resume_logprobs),
                          r.trajectory_id, r.turn, r.last_turn)
               for r in requests]
        try:
            SeedWindows.check(seed_window_s)
            if version == 0:  # fenced by the job's start weights: the latest record first
                await self._read_start_weights()
            # etcd is read only for a version no worker holds yet.
            announced = None if self._control.version_held(version) else await self._announced()
            policy = None if acceptance is None else TailBatchingStep(
                {r.request_id: r.group_id for r in requests}, acceptance.prompts,
                acceptance.responses)
            step = self._control.add_step(step_id, new, version, announced_version=announced,
                                          profiled=profiled, policy=policy)
        except errors.ServiceError as exc:
            metrics.STEPS.labels("refused").inc()
            await errors.abort(context, exc)
        metrics.STEPS.labels("accepted").inc()
        if self._tp is not None and profiled:  # a step of the RL loop, not a single Generate
            self._preemptions.open(step.key)
        if (self._tp is not None or self._scaler is not None) and profiled:
            self._step_lengths[step.key] = []
        if self._scaler is not None and profiled:
            self._scaler.step_started(step)
        if profiled:
            self._seeds.step_started(step.key, seed_window_s, step.weight_version)
        stream = ClientStream(step, self._client_queue)
        for rid in step.request_ids:
            self._streams[rid] = stream
        self._step_streams[step.key] = stream
        return stream

    def _reattach(self, step_id: str, print_: bytes) -> ClientStream | None:
        """A step submitted again by a client that went away (a trainer restarted from its
        checkpoint, or retrying): a new stream for the same step that first replays every
        completion delivered so far and the tokens of the other requests. None when there is
        none to re-attach; a detached step of that id with other requests is abandoned."""
        assert self._journals is not None
        journal, stale = self._journals.claim(step_id, print_)
        for old in stale:
            if not old.ended:
                self._abandon_now(old.stream)
        if journal is None:
            return None
        old_stream: ClientStream = journal.stream
        stream = ClientStream(old_stream.step, self._client_queue)
        for completion in journal.completions:
            stream.put_completion(completion)
        tracker = self._control.tracker
        running = 0
        replay = delta_batch.RowsBuilder(old_stream.step.weight_version)
        for index, rid in enumerate(old_stream.step.request_ids):
            if self._streams.get(rid) is not old_stream:
                continue  # delivered: in the journal
            self._streams[rid] = stream
            running += 1
            req = tracker.get(rid)
            if req.generated:
                replay.add(index, 0, req.token_ids, req.logprobs)
        if not journal.ended:  # an ended step's cleanup ran already: nothing would remove it
            self._step_streams[old_stream.step.key] = stream
        if len(replay):
            stream.replay(replay.build())
        if journal.ended:
            stream.end(journal.remote)
        journal.stream = stream
        metrics.STEP_REATTACHES.inc()
        log.info("step %s re-attached: %d completions and the tokens of %d requests replayed",
                 step_id, len(journal.completions), running)
        return stream

    async def _announced(self) -> int | None:
        """The job's announced version, read while a client's SubmitStep waits: etcd away is
        waited out for up to 30 s, then the step is refused UNAVAILABLE, which the
        trainer retries, rather than held for as long as the outage lasts."""
        try:
            announced = await with_etcd(
                partial(registry.get_versioned, self._etcd, self._announced_key),
                "reading the job's announced version", deadline_s=30.0)
        except Exception as exc:
            if not etcd_away(exc):
                raise
            raise errors.Unavailable(f"etcd unreachable for 30 s ({type(exc).__name__}) while "
                                     "reading the job's announced version; retry the step") \
                from None
        return None if announced is None else int(announced["version"])

    def _abandon(self, stream: ClientStream) -> None:
        """The client went away (or its step ended). A journaled step runs on, detached, for
        the re-attach grace (its end's cleanup already ran if it ended); else the core drops
        what it still had."""
        journals = self._journals
        journal = journals.get(stream.step.key) if journals is not None else None
        if journals is None or journal is None or journal.stream is not stream:
            self._abandon_now(stream)  # not journaled, or a stream a re-attach replaced
            return
        if journals.detach(stream.step.key) is None:
            self._abandon_now(stream)  # a completion failed: retried whole, never re-attached
            return
        if not journal.ended:
            stream.detach()
            log.info("step %s: its client went away; kept running for %.0fs for it to "
                     "re-attach", journal.step_id, journals.grace_s)
        asyncio.get_running_loop().call_later(journals.grace_s + 0.01, self._expire_journals)

    def _expire_journals(self) -> None:
        assert self._journals is not None
        for journal in self._journals.expired():
            if not journal.ended:
                log.info("step %s: not re-attached within %.0fs; abandoned", journal.step_id,
                         self._journals.grace_s)
                self._abandon_now(journal.stream)

    def _abandon_now(self, stream: ClientStream) -> None:
        # Nobody reads this stream any more: a worker's read loop waiting in room() for the
        # client to make room must go on now (its rows are dropped), not until the stall
        # timeout declares that worker lost.
        stream.detach()
        commands = self._control.abandon_step(stream.step)
        if self.accepting:
            self._execute(commands)
        # Shutting down: the requests stay on the workers, which keep them for the successor
        # (session_hub.py) instead of aborting them; the trainer resumes the step there.
        self._preemptions.drop(stream.step.key)  # a step that finished has closed it already
        self._step_lengths.pop(stream.step.key, None)
        self._scale_step_ended(stream.step, None)  # one that finished has returned them already
        self._seeds.step_ended(stream.step.key)
        for rid in stream.step.request_ids:
            if self._streams.get(rid) is stream:
                del self._streams[rid]
        if self._step_streams.get(stream.step.key) is stream:
            del self._step_streams[stream.step.key]

    async def GetStatus(self, request: mpb.GetStatusRequest, context) -> mpb.ManagerStatus:
        counters = self._control.tracker.counters
        workers = []
        standby = self._control.pool.standby()
        for view in self._control.pool.all():
            info = self._endpoints.get(view.worker_id, {})
            workers.append(mpb.WorkerStatus(
                worker_id=view.worker_id, endpoint=info.get("endpoint", ""), kind=view.kind,
                weight_version=view.weight_version,
                state="standby" if view.worker_id in standby else view.state.value,
                assigned=self._control.tracker.assigned_count(view.worker_id)))
        return mpb.ManagerStatus(
            workers=workers, in_flight=self._control.tracker.unfinished(),
            waiting=len(self._control.tracker.waiting()),
            tokens_generated=counters.tokens_generated,
            tokens_regenerated=counters.tokens_regenerated, migrations=counters.migrations,
            completions=counters.finished, failures=counters.failed,
            last_step_remote=self._last_remote)

    # ---- observability ---------------------------------------------------------------------------

    def refresh_gauges(self) -> None:
        """The gauges that walk the tracker, computed when /metrics is scraped."""
        tracker = self._control.tracker
        metrics.IN_FLIGHT.set(tracker.unfinished())
        metrics.WAITING.set(len(tracker.waiting()))
        metrics.TOKENS_REGENERATED.set(tracker.counters.tokens_regenerated)
        router = self._control.router
        for outcome, count in dataclasses.asdict(router.counts).items():
            metrics.TURNS_ROUTED.labels(outcome).set(count)
        metrics.TRAJECTORIES.set(len(router))
        metrics.STEPS_DETACHED.set(self._journals.detached() if self._journals else 0)
        states: dict[str, int] = {"healthy": 0, "draining": 0, "training": 0, "lost": 0}
        for view in self._control.pool.all():
            states[view.state.value] = states.get(view.state.value, 0) + 1
            on_worker = tracker.on_worker(view.worker_id)
            metrics.ASSIGNED.labels(view.worker_id).set(len(on_worker))
            metrics.PENDING.labels(view.worker_id).set(
                sum(1 for r in on_worker if r.state is RequestState.PENDING))
        for state, count in states.items():
            metrics.WORKERS.labels(state).set(count)
        metrics.WORKERS_LENT.set(states["training"])
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
