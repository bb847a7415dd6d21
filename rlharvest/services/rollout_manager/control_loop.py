"""The manager's decision loop: steps, tracker, worker pool, Algorithm 2, failure policy; no I/O.

The async service (and the policy simulator, which drives this very class) feeds it events —
a step added or abandoned, a completion delivered, worker joins/losses/drains/version changes,
loads and refusals, batched step outputs, engine-step stats — and calls ``tick`` whenever
something may have changed (a completion, a timer). Every command it returns has already been
applied to the tracker; the caller only carries it out. The service hands over each worker event
whole (``worker_event``) and gets one ``Outcome`` (outcome.py) back: commands, rows for the
clients, completions already delivered, the step policies' verdicts and the steps that ended. Refusals it raises (``StepError``,
``UnknownVersion``) are ``common.errors`` kinds, so the service answers them with their status.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

import numpy as np

from rlharvest.common import delta_batch
from rlharvest.common.delta_batch import Rows
from rlharvest.common.pb import common_pb2
from rlharvest.common.pb import rollout_worker_pb2 as wpb

from rlharvest.services.rollout_manager.balancer import (
    InstanceLoad,
    LazyIds,
    MoveCosts,
    SelectFn,
    dispatch_waiting,
    kv_memory_load,
    rebalance,
    select_instance,
)
from rlharvest.services.rollout_manager.batching_profile import (
    StepStatsLike,
    ThroughputProfile,
    decode_sample,
)
from rlharvest.services.rollout_manager.commands import (
    Abort,
    Command,
    Dispatch,
    Fail,
    Forget,
    MigrationCause,
    Migrate,
    Release,
)
from rlharvest.services.rollout_manager.failure import HOLD_AFTER, FailureConfig, FailurePolicy
from rlharvest.services.rollout_manager.outcome import (
    Delivery,
    Outcome,
    client_rows,
    completion_of,
    decode,
)
from rlharvest.services.rollout_manager.migration_cost import LengthModel, WorkerPace
from rlharvest.services.rollout_manager.remote_timing import RemoteStepTimings, RemoteTiming
from rlharvest.services.rollout_manager.sharding import Withdrawal
from rlharvest.services.rollout_manager.step import Step, check_seed_window
from rlharvest.services.rollout_manager.step_policy import PlainStep, StepPolicy
from rlharvest.services.rollout_manager.tail_batching import TailBatchingStep
from rlharvest.services.rollout_manager.tp_accounting import PreemptionTally
from rlharvest.services.rollout_manager.step_book import StepBook, admit_version
from rlharvest.services.rollout_manager.turn_routing import TurnRouter
from rlharvest.services.rollout_manager.tracker import (
    ApplyReport,
    DeltaLike,
    DroppedDelta,
    NewRequest,
    RequestState,
    RequestTracker,
    StepError,
    StepLimits,
)
from rlharvest.services.rollout_manager.worker_pool import (
    CAPPED_KINDS,
    HANDED_OVER_KINDS,
    SERVING_KIND,
    WorkerPool,
    WorkerState,
    WorkerView,
)


MigrationRule = Literal["paper", "cost-aware"]


@dataclass(frozen=True)
class ControlConfig:
    theta: int = 2  # Θ: most pending requests per worker before dispatch is delayed
    continuous_lb: bool = True  # False only for the "no migration" baselines
    # Which moves CONTINUOUSLB makes (balancer.py): "cost-aware" (the default), only a move
    # whose predicted time saved beats its resume prefill, once a step, never back, none of a
    # seed worker's or a lent co-executor's (MoveCosts); "paper", Algorithm 2's executing case as
    # written (the excess over B to any idle worker), the baseline. The pending case is the
    # paper's under both.
    migration_rule: MigrationRule = "cost-aware"
    # The resume cost's prefill rate (tokens/s) until a worker has measured its own.
    prefill_tokens_per_s: float = 10_000.0
    migration_min_gain: float = 0.1  # MoveCosts.min_gain
    max_moves_per_tick: int = 64  # bounds one tick's work; the next tick continues
    profile_epsilon: float = 0.1  # B reaches (1 - ε) of the best throughput
    # The recompute baseline of RLBoost §6.4.3 (Fig. 14) only: a request released by a lost
    # worker restarts from its prompt instead of resuming from its last token.
    recompute_on_loss: bool = False
    # A worker that refuses a request for memory (RESOURCE_EXHAUSTED: a co-executor whose
    # serving burst took its KV budget back) or because it still holds it (ALREADY_EXISTS: a
    # migration's abort there is queued behind its engine step), or a co-executor that gives
    # one up on its own, gets no new request for this long. Without it the manager sent the
    # request back every tick (thousands of refusals a run in bench/agentic_routing.py
    # --coexec 1).
    refusal_hold_s: float = 0.25
    job: str = ""  # step outputs made with another job's weights are refused (worker_event)
    failure: FailureConfig = field(default_factory=FailureConfig)
    limits: StepLimits = field(default_factory=StepLimits)


_NONE_LEFT: set[str] = set()


class AcceptanceRule(Protocol):
    """A short round's rule (tail_batching.py): accept ``prompts`` groups of ``responses``."""

    @property
    def prompts(self) -> int: ...
    @property
    def responses(self) -> int: ...


class RolloutControl:
    def __init__(self, config: ControlConfig, clock: Callable[[], float],
                 select: SelectFn = select_instance, router: TurnRouter | None = None,
                 wall_clock: Callable[[], float] = time.time) -> None:
        """``clock``: monotonic seconds; ``wall_clock``: Unix seconds, only to read a
        worker's drain deadline, which it states as a Unix time."""
        self.config = config
        # Trajectories' turns (ROSE §4.3). Not ``router or ...``: an empty router is falsy.
        self.router = router if router is not None else TurnRouter(clock=clock)
        self.tracker = RequestTracker(config.limits, clock)
        self.pool = WorkerPool(clock)
        self.failure = FailurePolicy(config.failure, clock)
        self.steps = StepBook(clock, config.profile_epsilon)
        self.remote = RemoteTiming(clock)  # Algorithm 1's remote-instance timings per step
        self._clock = clock
        self._wall_clock = wall_clock
        self.preemptions = PreemptionTally()  # the workers' reported totals (tp_accounting.py)
        self._select = select
        self._outbox: list[Command] = []  # decided outside tick (protocol errors), sent by tick
        self._router_expired_at = clock()
        # The cost-aware rule's inputs (migration_cost.py): each worker's pace, the last
        # finished step's lengths, and the workers each request left within its step.
        self._pace: dict[str, WorkerPace] = {}
        self._lengths = LengthModel()
        self._left: dict[str, set[str]] = {}
        self._relocated: set[str] = set()  # moved by the executing case within their step
        self._costs = None if config.migration_rule == "paper" else MoveCosts(
            self._expected_remaining, self._context_of, self._left_by,
            config.prefill_tokens_per_s, config.migration_min_gain,
            self._relocated.__contains__, self._figures)

    @property
    def profiles(self) -> dict[str, ThroughputProfile]:
        """P per worker kind, as frozen by the last finished step (step_book.py)."""
        return self.steps.profiles

    # ---- steps --------------------------------------------------------------------------------

    def add_step(self, step_id: str, requests: Sequence[NewRequest], weight_version: int, *,
                 announced_version: int | None = None, policy: StepPolicy | None = None,
                 profiled: bool = True, acceptance: AcceptanceRule | None = None,
                 seed_window_s: float = 0.0) -> Step:
        """Admit a step whose every request runs on ``weight_version``, which a worker must hold
        or the job must have announced (``announced_version``: the newest announced, None for
        none). Nothing is added when the step is refused (StepError, UnknownVersion, an
        acceptance rule the step cannot meet, a bad window). The step runs under ``policy``, or
        tail batching's under ``acceptance``, else plain; ``profiled=False`` for a request that
        is not a step of the RL loop (a single Generate): its end never freezes P.
        ``seed_window_s``: the step's seeding window (seed_window.py)."""
        check_seed_window(seed_window_s)
        if acceptance is not None:
            policy = TailBatchingStep({r.request_id: r.group_id for r in requests},
                                      acceptance.prompts, acceptance.responses)
        admit_version(weight_version, self._held_versions(), announced_version)
        for r in requests:
            if r.weight_version != weight_version:
                raise StepError(f"request {r.request_id!r} has weight_version "
                                f"{r.weight_version}; a step runs on one version, {weight_version}")
        ids = self.tracker.add_step(requests)
        step = self.steps.open(step_id, weight_version, ids, policy or PlainStep(), profiled,
                               seed_window_s)
        self.tracker.label(ids, step.key)
        self.remote.step_opened(step.key)
        return step

    def version_held(self, weight_version: int) -> bool:
        """Whether some worker holds the version (then add_step needs no announced version)."""
        return weight_version in self._held_versions()

    def deliver(self, request_id: str, succeeded: bool = True) -> Step | None:
        """The request's completion (finished or failed) reached its client: the manager forgets
        it. Returns its step when that was the step's last one: the step has ended, and if it is
        profiled its samples are P now. A request no longer tracked (its step was abandoned
        meanwhile) is ignored."""
        if request_id not in self.tracker:
            return None
        req = self.tracker.get(request_id)
        if req.trajectory_id:  # the history's KV is where the turn finished
            self.router.finished(req.trajectory_id, req.finished_on if succeeded else None,
                                 req.last_turn)
        if succeeded and (of := self.steps.step_of(request_id)) is not None:
            of.finished_lengths.append(req.generated)
        self.tracker.forget(request_id)
        self._left.pop(request_id, None)
        self._relocated.discard(request_id)
        step = self.steps.delivered(request_id, succeeded)
        if step is not None:
            step.remote = self.remote.step_closed(step.key)
            if step.profiled and step.finished_lengths:
                self._lengths = LengthModel(step.finished_lengths)
        return step

    def abandon_step(self, step: Step) -> list[Command]:
        """The client went away: its undelivered requests are dropped (aborted where they run)
        and the step ends, without freezing P. A step that already ended is left as it is."""
        out: list[Command] = []
        self.remote.step_closed(step.key)
        for request_id in self.steps.abandon(step):
            if request_id not in self.tracker:
                continue
            worker_id = self.tracker.get(request_id).worker_id
            if worker_id is not None:
                out.append(Abort(request_id, worker_id))
            self.tracker.fail(request_id, "client cancelled the step")
            self.tracker.forget(request_id)
            self._left.pop(request_id, None)
            self._relocated.discard(request_id)
        return out

    def withdraw(self, request_ids: Sequence[str], limit: int = 0,
                 running: bool = False) -> Withdrawal:
        """Of ``request_ids``, up to ``limit`` (0: all) leave their steps: a sharded job's
        client moves them to another shard (sharding.py). Those waiting here that never went
        to a worker go first; with ``running`` then the rest waiting here, those queued on a
        worker and those running, fewest tokens first (aborted there: the client has every
        token this manager took of them). Never one a worker kept from a dead leader or owes
        the rows of (its tokens are not all here yet). No completion is sent for them."""
        out = Withdrawal()
        for request_id in self._withdrawable(request_ids, running)[:limit or None]:
            worker_id = self.tracker.get(request_id).worker_id
            if worker_id is not None:
                out.commands.append(Abort(request_id, worker_id))
            out.tokens.append(self.tracker.withdraw(request_id))
            out.taken.append(request_id)
            self._left.pop(request_id, None)
            if (step := self.steps.withdrawn(request_id)) is not None:
                step.remote = self.remote.step_closed(step.key)
                out.ended.append(step)
        return out

    def _withdrawable(self, request_ids: Sequence[str], running: bool) -> list[str]:
        held = {rid for w in self.pool.all() for rid in (*w.kept, *w.adopted)}
        ranked = []
        for request_id in request_ids:
            req = self.tracker.get(request_id) if request_id in self.tracker else None
            if req is None or req.done or request_id in held or \
                    self.steps.step_of(request_id) is None:
                continue
            fresh = req.worker_id is None and req.handle == req.added_as
            if fresh or running:
                rank = 0 if fresh else 1 if req.worker_id is None else \
                    2 if req.state is RequestState.PENDING else 3
                ranked.append((rank, req.generated if rank == 3 else 0, request_id))
        return [rid for *_, rid in sorted(ranked, key=lambda r: (r[0], r[1]))]

    # ---- workers ------------------------------------------------------------------------------

    def worker_joined(self, worker_id: str, weight_version: int, capacity: int,
                      kind: str, admission: str = "slots", vocab_size: int = 0,
                      start_weights: str = "") -> None:
        """``admission``: "slots" or "kv_memory" (worker_pool.py); ValueError for another, and
        for a worker whose model's vocabulary differs from the job's. ``vocab_size`` 0: the
        worker did not say (it is taken as serving the job's model). ``start_weights``: the
        fingerprint of its version-0 weights."""
        self._check_vocabulary(worker_id, vocab_size)
        self.pool.join(worker_id, weight_version, capacity, kind, admission, start_weights)
        self.steps.add_kind(kind)
        self._count_remote()

    def _check_vocabulary(self, worker_id: str, vocab_size: int) -> None:
        """The first worker that states its vocabulary fixes the job's (unless configured); one
        serving another model would emit token ids that mean something else, so it is refused."""
        known = self.tracker.vocab_size
        if not vocab_size or vocab_size == known:
            return
        if known:
            raise ValueError(f"it serves a model with a vocabulary of {vocab_size} tokens, but "
                             f"this job's model has {known}; start it with the job's model")
        self.tracker.vocab_size = vocab_size

    def worker_lost(self, worker_id: str, reason: str) -> list[Command]:
        """Stream broke, lease vanished, or the worker left: its requests wait, tokens kept
        (discarded instead under ``recompute_on_loss``, the baseline)."""
        if not self.pool.mark_lost(worker_id, reason):
            return []
        ids = [r.request_id for r in self.tracker.on_worker(worker_id)]
        released = self._apply(self.failure.release_all(worker_id, ids, "lost"))
        if self.config.recompute_on_loss:
            for request_id in ids:
                self.tracker.restart_from_prompt(request_id)
        return released

    def _forget(self, worker_id: str) -> Forget:
        """A lost worker that holds nothing leaves every record (a spot worker comes back
        under a new id, so they would pile up); a later join of its id starts afresh."""
        self.pool.forget(worker_id)
        self._pace.pop(worker_id, None)
        self.tracker.forget_worker(worker_id)
        self.preemptions.forget(worker_id)
        return Forget(worker_id)

    def worker_keeps(self, worker_id: str, request_ids: Sequence[str]) -> list[Command]:
        """A worker's new session says it still runs these requests of a session that broke.
        Those this manager has waiting for the worker's version go back to it at the next
        tick, bypassing Algorithm 2 (they hold its capacity already), and continue with every
        token. Those placed elsewhere, finished or of another version meanwhile are dropped
        there (Abort). Unknown ones are remembered: a successor manager learns them before
        the trainer resubmits its step (the worker drops them itself if nobody does). A worker
        names them all on each new session and whenever a session of it breaks: the list
        replaces the one before (so ids it dropped meanwhile are forgotten here too)."""
        view = self.pool.get(worker_id)
        view.kept = set()
        out: list[Command] = []
        for rid in request_ids:
            req = self.tracker.get(rid) if rid in self.tracker else None
            if req is not None and req.worker_id == worker_id:
                continue  # dispatched back already (a tick ran first): it was adopted
            if req is None or (req.state is RequestState.WAITING and
                               req.weight_version == view.weight_version):
                view.kept.add(rid)
            else:
                out.append(Abort(rid, worker_id))
        return out

    def worker_draining(self, worker_id: str, deadline: float) -> list[Command]:
        self.pool.mark_draining(worker_id, deadline)
        return self._evacuate(worker_id, "drain", keep_without_room=True)

    def job_start_weights(self, fingerprint: str) -> list[Command]:
        """The job's start weights (its trainer's record; "" for none): version-0 requests go
        only to workers whose own are these, and leave those whose are not."""
        self.pool.start_weights = fingerprint
        return [c for w in list(self.pool.all()) for c in self._evacuate_stale(w.worker_id)]

    def worker_version_changed(self, worker_id: str, weight_version: int,
                               start_weights: str | None = None) -> list[Command]:
        """A worker now holds another version: none of its requests may decode there any more."""
        self.pool.set_version(worker_id, weight_version, start_weights)
        return self._evacuate_stale(worker_id)

    def _evacuate_stale(self, worker_id: str) -> list[Command]:
        """Move the requests of a version the worker does not hold (for the job) elsewhere."""
        view = self.pool.get(worker_id)
        stale = [r for r in self.tracker.on_worker(worker_id)
                 if not view.holds(r.weight_version, self.pool.start_weights)]
        out: list[Command] = []
        for version in sorted({r.weight_version for r in stale}):
            ids = [r.request_id for r in stale if r.weight_version == version]
            out += self._apply(self.failure.evacuate(
                worker_id, ids, self._loads(version), self.config.theta, "version",
                keep_without_room=False, select=self._select))
        return out

    def step_outputs(self, worker_id: str, rows: Rows) -> ApplyReport:
        """One batch of ``worker_id``'s step outputs (the hot path: array operations only)."""
        return self._after_outputs(worker_id, self.tracker.apply_outputs(worker_id, rows))

    def step_deltas(self, worker_id: str, deltas: Sequence[DeltaLike]) -> ApplyReport:
        """``step_outputs`` for deltas as objects (tests, the policy simulator)."""
        return self._after_outputs(worker_id, self.tracker.apply_deltas(worker_id, deltas))

    def _after_outputs(self, worker_id: str, report: ApplyReport) -> ApplyReport:
        if report.accepted_tokens:  # rows with tokens: an end alone is no progress
            self.pool.note_progress(worker_id)
            if self.pool.get(worker_id).kind in CAPPED_KINDS:
                self._remote_produced(worker_id, report)
        if report.aborted and self.pool.get(worker_id).kind == SERVING_KIND:
            # A co-executor gives requests up on its own to take memory back for serving
            # (memory_sharing.py): like a refusal for memory, it has no room for now.
            self.pool.note_refusal(worker_id)
        released: set[str] = set()
        for dropped in report.dropped:
            if dropped.reason in ("position", "version") and dropped.request_id not in released:
                # The assignee and the manager disagree about this request: take it off that
                # worker (tokens kept) rather than risk a gap or an off-policy token. Once: a
                # batch may name a request in several refused rows, all judged before this.
                released.add(dropped.request_id)
                self.tracker.release(dropped.request_id)
                self._outbox.append(Release(dropped.request_id, worker_id, "protocol"))
        return report

    def engine_step(self, worker_id: str, stats: StepStatsLike) -> None:
        """One engine step of the worker (its batch size, duration and tokens): a sample of P
        at the mean context of the worker's requests, for every profiled step in flight. Steps
        that say nothing about decode batching are left out (``decode_sample``). Every step
        is also the worker's pace for the cost-aware migration rule (migration_cost.py)."""
        if self._costs is not None and worker_id in self.pool:
            self._pace.setdefault(worker_id, WorkerPace()).record(stats)
        if not self.steps.capturing:
            return
        sample = decode_sample(stats)
        context = self.tracker.mean_context(worker_id)
        if sample is None or context is None or worker_id not in self.pool:
            return
        self.steps.sample(self.pool.get(worker_id).kind, sample[0], sample[1], context)

    def worker_load(self, worker_id: str, pending: int, executing: int,
                    kv_capacity_tokens: int | None = None,
                    kv_used_tokens: int | None = None) -> None:
        """The worker's own queue and batch as it last reported them (read for kv_memory), and
        its KV capacity and use (read by stream-trainer scaling, and for a co-executor by the
        turn router: the room its rollout budget leaves); None keeps what is known."""
        self.pool.report_load(worker_id, pending, executing,
                              self.tracker.assigned_count(worker_id), kv_capacity_tokens,
                              kv_used_tokens)

    def lend_to_training(self, worker_ids: Sequence[str],
                         cause: MigrationCause = "scale_down") -> list[Command]:
        """Stream-trainer scaling (RollPacker §4.4): the healthy ones of ``worker_ids`` take no
        new work from now on and hand their requests over, tokens kept, to the eligible workers
        through SELECTINSTANCE; a request no one has room for waits in the manager (aborted on
        the lent worker, tokens kept) rather than decoding on: the lent worker is to hold
        nothing (a request it kept from a broken session goes back to it, and on at a later tick
        once its tokens are in: ``_adopt``). Workers in another state are left as they are."""
        # All lent before any moves: a request must not move onto another worker being lent.
        lent = [w for w in worker_ids if w in self.pool and self.pool.lend_to_training(w)]
        out: list[Command] = []
        for worker_id in lent:
            out += self._evacuate(worker_id, cause, keep_without_room=False)
        return out

    def return_from_training(self, worker_ids: Sequence[str]) -> list[str]:
        """The lending step ended: the ones still lent are healthy again (and take work from
        the next tick on). Returns those."""
        return [w for w in worker_ids if self.pool.return_from_training(w)]

    def command_refused(self, worker_id: str, request_id: str, code: int,
                        message: str, handle: int = 0) -> list[Command]:
        """The worker refused a command about the request (``code``: a gRPC status value; an
        add's refusal names the dispatch by its ``handle``)."""
        if request_id not in self.tracker:
            return []
        req = self.tracker.get(request_id)
        if req.done or req.worker_id != worker_id or (handle and handle != req.handle):
            return []  # about an assignment the request already left (maybe for this worker)
        decided = self.failure.refused(request_id, worker_id, code, message)
        if code in HOLD_AFTER:
            self.pool.note_refusal(worker_id)
        return self._apply([decided]) if decided is not None else []

    # ---- one worker event, one outcome -------------------------------------------------------

    def worker_event(self, worker_id: str, event: wpb.WorkerEvent) -> Outcome:
        """One event of the worker's Session stream, whole: everything the shell must do about
        it (outcome.py). Events of a worker the core does not know are ignored."""
        if worker_id not in self.pool:
            return Outcome()
        which = event.WhichOneof("event")
        if which == "step":
            return self._step_event(worker_id, event.step)
        if which == "load":
            return self._load_event(worker_id, event.load)
        if which == "error":
            e = event.error
            return self.settle(self.command_refused(worker_id, e.request_id, e.code, e.message,
                                                    e.handle), wake=True)
        if which == "kept":
            return self.settle(self.worker_keeps(worker_id, list(event.kept.request_ids)),
                               wake=True)
        if which == "draining":
            # The worker states its deadline in Unix time; the core keeps monotonic ones.
            left = max(event.draining.deadline_unix - self._wall_clock(), 0)
            return self.settle(self.worker_draining(worker_id, self._clock() + left), wake=True)
        return Outcome()

    def _step_event(self, worker_id: str, step: wpb.StepOutputs) -> Outcome:
        # The hot path (bench/manager_relay.py): the batch's columns go to the tracker and on
        # to the client as arrays; no Python object is built per row or per token.
        if step.batch.job != self.config.job:
            return self._other_job(worker_id, step.batch)
        rows, malformed = decode(step.batch)
        report = self.step_outputs(worker_id, rows)
        out = self._load_event(worker_id, step.load)  # before this event's completions
        self.engine_step(worker_id, step.stats)
        out.malformed, out.accepted_tokens = malformed, report.accepted_tokens
        out.dropped = report.dropped
        if malformed:
            out.dropped = [DroppedDelta("", worker_id, "malformed", len(step.batch.token_ids) // 4)]
        out.rows = client_rows(report)
        out.deliveries = [d for rid in report.finished  # after its last row
                          if (d := self._delivery(rid, "finished")) is not None]
        out.wake = bool(report.finished or report.aborted)
        return out

    def _other_job(self, worker_id: str, batch: common_pb2.DeltaBatch) -> Outcome:
        """The worker holds another job's weights now: none of its tokens are this job's."""
        reason = f"sent tokens of job {batch.job!r}'s weights"
        out = self.settle(self.worker_lost(worker_id, reason), wake=True)
        out.dropped = [DroppedDelta("", worker_id, "other_job", len(batch.token_ids) // 4)]
        out.lost = reason
        return out

    def _load_event(self, worker_id: str, load: common_pb2.Load) -> Outcome:
        self.worker_load(worker_id, load.pending, load.executing, load.kv_capacity_tokens,
                         load.kv_used_tokens)
        return Outcome(preemptions=self.preemptions.report(worker_id, max(load.preemptions, 0)))

    def settle(self, commands: Sequence[Command], wake: bool = False) -> Outcome:
        """Commands decided anywhere (a tick, a loss, an observer), with what carrying them out
        takes: the payload of each send, and the failed requests' completions, delivered."""
        out = Outcome(commands=list(commands), wake=wake)
        for c in commands:  # before the deliveries: a delivered request is forgotten
            if isinstance(c, (Dispatch, Migrate)) and c.request_id in self.tracker:
                out.payloads[c.request_id] = self.tracker.resume_payload(c.request_id)
        for c in commands:
            if isinstance(c, Fail) and (d := self._delivery(
                    c.request_id, "cancelled" if c.cancelled else "failed")) is not None:
                out.deliveries.append(d)
        return out

    def _delivery(self, request_id: str, outcome: str) -> Delivery | None:
        """The request's completion, delivered (``deliver``); None when its step is gone."""
        step = self.steps.step_of(request_id)
        if step is None or request_id not in self.tracker:
            return None
        req = self.tracker.get(request_id)
        completion = completion_of(req, cancelled=outcome == "cancelled")
        discarded = req.generated if outcome == "cancelled" else 0
        ended = self.deliver(request_id, succeeded=outcome == "finished") is not None
        return Delivery(step, completion, outcome, tuple(step.policy.verdicts(step)), ended,
                        discarded)

    def replay(self, step: Step) -> Rows | None:
        """The tokens so far of the step's undelivered requests, named by their index in the
        step: a re-attached client's first rows (None: there are none)."""
        rows = delta_batch.RowsBuilder(step.weight_version)
        for index, rid in enumerate(step.request_ids):
            if rid in step.outstanding and (req := self.tracker.get(rid)).generated:
                rows.add(index, 0, req.token_ids, req.logprobs)
        return rows.build() if len(rows) else None

    def open_scope(self, key: Hashable, window_s: float) -> None:
        """An agentic step's scope (HoldSeedWindow) with its seeding window: its remote
        timings run from now (remote_timing.py)."""
        check_seed_window(window_s)
        self.remote.scope_opened(key)

    def close_scope(self, key: Hashable) -> RemoteStepTimings | None:
        return self.remote.scope_closed(key)

    # ---- the loop -----------------------------------------------------------------------------

    def tick(self) -> list[Command]:
        self._count_remote()  # joins, losses, drains and cap changes all pass through here
        if len(self.router) and self._clock() - self._router_expired_at >= 1.0:
            self.router.expire()  # abandoned trajectories' entries, at most once a second
            self._router_expired_at = self._clock()
        out, self._outbox = self._outbox, []
        busy = self.tracker.busy
        for loss in self.failure.detect_losses(self.pool.all(), busy):
            out += self.worker_lost(loss.worker_id, loss.reason)
        for worker_id in self.failure.to_forget(self.pool.all(), busy):
            out.append(self._forget(worker_id))
        for w in list(self.pool.all()):
            if w.state is WorkerState.DRAINING and self._busy(w.worker_id):
                out += self._evacuate(w.worker_id, "drain", keep_without_room=True)
            elif w.state is WorkerState.TRAINING and self._busy(w.worker_id):
                out += self._evacuate(w.worker_id, "scale_down", keep_without_room=False)
        for step in self.steps.live():  # before dispatch: nothing is sent only to be cut
            out += self._apply(self._cut(step))
        waiting = self._waiting_by_version()
        for version, ids in waiting.items():
            # Requests a worker kept from a broken session go back to it first; then turns,
            # by where their history is (turn_routing.py); then everything else by Algorithm 2
            # on the loads those left.
            if adopted := self._adopt(version, ids):
                out += self._apply(adopted)
                taken = {c.request_id for c in adopted}
                ids = [r for r in ids if r not in taken]
            turns = [r for r in ids if self._trajectory_of(r)]
            if turns:
                out += self._apply(self.router.dispatch(
                    turns, self._trajectory_of, self._loads(version), self.config.theta,
                    self._select, self._kv_need))
                ids = [r for r in ids if not self._trajectory_of(r)]
            out += self._apply(dispatch_waiting(ids, self._loads(version), self.config.theta,
                                                self._select, self._kv_need))
        if any(w.kept for w in self.pool.all()):
            out += self._drop_stale_kept()
        if self.config.continuous_lb:
            for version in self._busy_versions():
                if self._settled(version):
                    continue
                out += self._apply(rebalance(self._loads(version), self.config.max_moves_per_tick,
                                             self._costs))
        starved = self.failure.starved(self._waiting_by_version(),
                                       lambda v: bool(self.pool.eligible(v)), self._wait_limit)
        return out + self._apply(starved)

    def _settled(self, version: int) -> bool:
        """Every eligible worker runs requests within its slots: nothing pending, none idle, so
        CONTINUOUSLB has nothing to do under either rule (its pending case needs a pending
        request, its executing case an idle worker). Told from counts, without building a
        load per worker: most ticks of a step at thousands of workers end here. A kv_memory
        worker's counts are its reports', so with one the loads are built."""
        for w in self.pool.eligible(version):
            assigned = self.tracker.assigned_count(w.worker_id)
            if w.admission != "slots" or not 0 < assigned <= w.capacity:
                return False
        return True

    def _drop_stale_kept(self) -> list[Abort]:
        """Kept copies of requests that run elsewhere or ended meanwhile (their keeper was not
        eligible, or the request was placed first): dropped on the keeper."""
        out = []
        for w in self.pool.all():
            for rid in [r for r in w.kept if r in self.tracker]:
                req = self.tracker.get(rid)
                if req.state is not RequestState.WAITING:
                    w.kept.discard(rid)
                    if req.worker_id != w.worker_id:
                        out.append(Abort(rid, w.worker_id))
        return out

    def _adopt(self, version: int, waiting: Sequence[str]) -> list[Dispatch]:
        """Waiting requests a worker keeps (``worker_keeps``): dispatched back to it when it is
        eligible or lent to training."""
        # A lent worker takes back what it kept too: the tokens it made since its session broke
        # reach the tracker only through that adoption (a seed worker lent at once by a
        # successor's 0-length window after a failover). It hands them on once they are in
        # (``_evacuate``), as it hands on everything it holds.
        lent = [w for w in self.pool.all()
                if w.state is WorkerState.TRAINING and w.holds(version, self.pool.start_weights)]
        holders = {rid: w for w in self.pool.eligible(version) + lent for rid in w.kept}
        if not holders:
            return []
        out = []
        for rid in waiting:
            if (worker := holders.get(rid)) is not None:
                worker.kept.discard(rid)
                worker.adopted.add(rid)
                out.append(Dispatch(rid, worker.worker_id))
        return out

    def _owed(self, worker_id: str) -> set[str]:
        """Requests dispatched back to the worker that kept them whose first rows (every token
        it made while no manager held them) have not come: moved now, those rows would be
        dropped as stale and the tokens generated again elsewhere."""
        view = self.pool.get(worker_id)
        if not view.adopted:  # nearly every worker, every tick: no set to rebuild
            return view.adopted
        view.adopted = {rid for rid in view.adopted if rid in self.tracker
                        and self.tracker.get(rid).worker_id == worker_id
                        and self.tracker.get(rid).state is RequestState.PENDING}
        return view.adopted

    def _cut(self, step: Step) -> list[Fail]:
        """Fail the outstanding requests the step's policy no longer needs (step_policy.py)."""
        cut = step.policy.cut(step, self._clock())
        if not cut:
            return []
        fails = []
        for request_id in sorted(cut):
            if request_id not in step.outstanding:
                raise ValueError(f"step policy {step.policy.name!r} cut {request_id!r}, which "
                                 f"is not an outstanding request of step {step.step_id!r}")
            req = self.tracker.get(request_id)
            if not req.done:  # finished meanwhile: its completion is on its way
                fails.append(Fail(request_id, f"cut by the {step.policy.name} step policy",
                                  req.worker_id, cancelled=True))
        return fails

    def _wait_limit(self, request_id: str) -> tuple[float, float | None]:
        req = self.tracker.get(request_id)
        return req.created_at, req.no_worker_timeout_s

    def _evacuate(self, worker_id: str, cause: MigrationCause,
                  keep_without_room: bool) -> list[Command]:
        out: list[Command] = []
        owed = self._owed(worker_id)  # they leave at a later tick, once their rows are in
        on_worker = [r for r in self.tracker.on_worker(worker_id) if r.request_id not in owed]
        for version in sorted({r.weight_version for r in on_worker}):
            ids = [r.request_id for r in on_worker if r.weight_version == version]
            out += self._apply(self.failure.evacuate(
                worker_id, ids, self._loads(version), self.config.theta, cause,
                keep_without_room, select=self._select))
        return out

    def _trajectory_of(self, request_id: str) -> str:
        return self.tracker.get(request_id).trajectory_id

    def _apply(self, commands: Sequence[Command]) -> list[Command]:
        for c in commands:
            if isinstance(c, Dispatch):
                self._note_busy(c.worker_id)
                self.tracker.assign(c.request_id, c.worker_id)
                self.pool.note_sent(c.worker_id, self._kv_need(c.request_id))
            elif isinstance(c, Migrate):
                if self._costs is not None:
                    self._left.setdefault(c.request_id, set()).add(c.src)
                    if c.cause == "executing":
                        self._relocated.add(c.request_id)
                self._note_busy(c.dst)
                self.tracker.move(c.request_id, c.dst)
                self.pool.note_sent(c.dst, self._kv_need(c.request_id))
            elif isinstance(c, Release):
                self.tracker.release(c.request_id)
            elif isinstance(c, Fail):
                self.tracker.fail(c.request_id, c.reason)
        return list(commands)

    def _count_remote(self) -> None:
        """Active remote instances (healthy spot workers not held as standby), of available."""
        healthy = {w.worker_id for w in self.pool.all()
                   if w.kind in CAPPED_KINDS and w.state is WorkerState.HEALTHY}
        self.remote.active_changed(len(healthy - self.pool.standby()), len(healthy))

    def _remote_produced(self, worker_id: str, report: ApplyReport) -> None:
        tags = report.tags[report.accepted.counts > 0]  # the steps it produced tokens of
        # The rows' steps (label: a step's key); RemoteTiming opens and closes with the live
        # steps, so it ignores the keys of steps that ended.
        self.remote.produced(np.unique(tags).tolist(), worker_id)

    def _note_busy(self, worker_id: str) -> None:
        # The stall clock of a worker that was idle starts when it gets work, not when it last
        # produced a token (which may be long ago).
        if not self._busy(worker_id):
            self.pool.note_progress(worker_id)

    def _busy(self, worker_id: str) -> bool:
        return self.tracker.busy(worker_id)

    def _waiting_by_version(self) -> dict[int, list[str]]:
        by_version: dict[int, list[str]] = {}
        for r in self.tracker.waiting():
            by_version.setdefault(r.weight_version, []).append(r.request_id)
        return by_version

    def _busy_versions(self) -> set[int]:
        busy = self.tracker.busy
        return {w.weight_version for w in self.pool.all()
                if w.state is WorkerState.HEALTHY and busy(w.worker_id)}

    def _held_versions(self) -> set[int]:
        return self.pool.held_versions()

    def _kv_need(self, request_id: str) -> int:
        """The KV tokens a request takes where it lands: its context and the next token (what a
        co-executor's admission checks against its rollout budget)."""
        return self.tracker.get(request_id).context_length + 1

    def _loads(self, weight_version: int) -> list[InstanceLoad]:
        """Algorithm 2's view of the workers eligible for ``weight_version``."""
        now, profiles = self._clock(), self.profiles
        return [self._load(w, now, profiles) for w in self.pool.eligible(weight_version)]

    def _expected_remaining(self, request_id: str) -> float:
        req = self.tracker.get(request_id)
        return self._lengths.expected_remaining(req.generated, req.sampling.max_tokens)

    def _figures(self, request_ids: Sequence[str]) -> list[tuple[float, int]]:
        """(``_expected_remaining``, ``_context_of``) of each, one tracker read per request."""
        get = self.tracker.get
        requests = [get(request_id) for request_id in request_ids]
        generated = self.tracker.generated_of(requests)
        remaining = self._lengths.expected_remaining_many(
            [(g, r.sampling.max_tokens) for g, r in zip(generated, requests)])
        return [(left, len(r.prompt_token_ids) + g)
                for left, g, r in zip(remaining, generated, requests)]

    def _context_of(self, request_id: str) -> int:
        return self.tracker.get(request_id).context_length

    def _left_by(self, request_id: str) -> set[str]:
        return self._left.get(request_id, _NONE_LEFT)

    def _load(self, w: WorkerView, now: float,
              profiles: dict[str, ThroughputProfile]) -> InstanceLoad:
        """Built from counts the tracker keeps as requests come and go (constant time per
        worker); the ids are read out only where Algorithm 2 moves some (``LazyIds``)."""
        worker_id = w.worker_id
        # A request given back to its keeper stays until its catch-up rows are in (``_owed``):
        # load like any, but not Algorithm 2's to move, so it is counted as not ours.
        owed = self._owed(worker_id)
        assigned, executing, context = self.tracker.load_counts(worker_id)
        pending = assigned - executing - len(owed)
        plateau = None if context is None else profiles[w.kind].plateau(context)
        capacity, unmanaged = w.capacity, 0
        if w.admission == "kv_memory":  # only the worker knows what its KV memory admits
            capacity, unmanaged = kv_memory_load(w.capacity, w.reported_pending,
                                                 w.reported_executing, w.assigned_at_report)
        pace = self._pace.get(worker_id)
        return InstanceLoad(worker_id, capacity, LazyIds(pending, self._queued_ids, worker_id),
                            LazyIds(executing, self._running_ids, worker_id),
                            plateau, unmanaged + len(owed), serving=w.kind == SERVING_KIND,
                            refusing=w.refusing(now, self.config.refusal_hold_s),
                            room_tokens=w.rollout_room_tokens,
                            pace=None if pace is None else pace.per_request,
                            pace_batch=1.0 if pace is None else pace.batch,
                            prefill_rate=None if pace is None else pace.prefill,
                            handed_over=w.kind in HANDED_OVER_KINDS)

    def _queued_ids(self, worker_id: str) -> tuple[str, ...]:
        """The worker's PENDING requests but those owed to it, oldest assignment first."""
        owed = self.pool.get(worker_id).adopted  # as _owed left it when the load was built
        return tuple(r.request_id for r in self.tracker.on_worker(worker_id)
                     if r.state is RequestState.PENDING and r.request_id not in owed)

    def _running_ids(self, worker_id: str) -> tuple[str, ...]:
        """The worker's EXECUTING requests in the order to move them."""
        running = [r for r in self.tracker.on_worker(worker_id)
                   if r.state is RequestState.EXECUTING]
        if self._costs is None:
            # Executing requests leave longest-so-far first: with heavy-tailed lengths those
            # are the likeliest to run longest, and they gain most from the idle worker's small
            # batch. (The cost-aware rule ranks them by what their move saves instead; in its
            # pending case a source with none queued gives up its newest assignment.)
            running.sort(key=lambda r: -r.generated)
        return tuple(r.request_id for r in running)
