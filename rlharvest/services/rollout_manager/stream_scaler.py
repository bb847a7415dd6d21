"""The manager's side of RollPacker's stream-trainer scaling (§4.4, Algorithm 1 lines 13-21).

Opt-in (``--stream-scaling``). Per ``SubmitStep`` (not a single ``Generate``), ``StreamScaler``:

* at the step's start builds a ``StreamScaling`` (stream_scaling.py) with the step's request
  count, the previous step's finished response lengths as history and the step's max_tokens
  (stream_accounting.py says which history and which workers);
* after each delivered completion of the step notes whether a milestone (20%, 25%, ... 50% of
  its requests completed) is reached; the service's tick then (``run_due``) gathers the step's
  KV state — per candidate worker its KV capacity and the contexts (prompt + tokens so far) of
  the step's requests on it — and observes it. Deferring to the tick keeps a decision from being
  carried out in the middle of another batch of commands;
* on a ``ScaleDown``: the named workers are *lent to training* for the rest of this step
  (``RolloutControl.lend_to_training``: state ``training``, no new work, their requests moved
  to the kept workers with their tokens — a token-level migration, nothing is regenerated — or
  waiting in the manager for room there), the decision is published to etcd under
  ``keys.stream_scale_key(job)`` (``stream_accounting.scale_record``, state "lent") and counted
  (``rlh_manager_stream_scale_downs_total``, ``rlh_manager_workers_lent_to_training``);
* when the step ends (finished or abandoned) the ones still lent are healthy again and the
  record says "returned". A worker lent by one step takes no work of any other step either
  until then: it is one GPU, given to training.

The handoff goes through the record: rlharvest's trainer with ``--borrow-lent-threads`` runs its
training thread on the lent workers' share of its machine for the rest of the step
(``trainer/lent_capacity.py``); an autoscaler may read it too. Lent GPUs on other nodes would
need a new data-parallel rank mid-step, which is not built.

etcd writes run in the background (``ScalePublisher.run``): the step's stream never waits for
them. A failed write (etcd down or slow) is logged and retried every ``retry_s`` with the newest
record only; the decision and the lending do not depend on it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from rlharvest.common import keys
from rlharvest.common.etcd_outage import etcd_answered, etcd_failed
from rlharvest.common.pb import rollout_manager_pb2 as mpb
from rlharvest.services.rollout_manager import metrics
from rlharvest.services.rollout_manager.client_stream import ClientStream
from rlharvest.services.rollout_manager.commands import Command
from rlharvest.services.rollout_manager.control_loop import RolloutControl
from rlharvest.services.rollout_manager.observer import ManagerObserver, Shell, Submission
from rlharvest.services.rollout_manager.outcome import Delivery
from rlharvest.services.rollout_manager.step import Step, StepOutcome
from rlharvest.services.rollout_manager.stream_accounting import (
    KvView,
    RecordState,
    candidates,
    kv_view,
    scale_record,
    scaling_history,
    step_max_tokens,
)
from rlharvest.services.rollout_manager.stream_scaling import (
    DEFAULT_HEADROOM,
    DEFAULT_QUANTILE,
    ScaleDown,
    StreamScaling,
)

log = logging.getLogger(__name__)


class ScalePublisher:
    """Writes the latest stream scaling record to etcd in the background; never blocks."""

    def __init__(self, etcd, *, job: str, write_timeout_s: float = 10.0,
                 retry_s: float = 2.0) -> None:
        self._etcd = etcd
        self.key = keys.stream_scale_key(job)
        self._write_timeout_s = write_timeout_s
        self._retry_s = retry_s
        self._unwritten: bytes | None = None
        self._wake = asyncio.Event()
        self.written = 0  # records written (tests, logs)

    def publish(self, record: bytes) -> None:
        """Queue ``record``; it replaces any record not written yet."""
        self._unwritten = record
        self._wake.set()

    async def run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while not await self.flush():  # etcd down: retry with the newest record
                await asyncio.sleep(self._retry_s)

    async def flush(self) -> bool:
        """Write the unwritten record, if any; False when the write failed (it stays unwritten)."""
        record = self._unwritten
        if record is None:
            return True
        try:
            await asyncio.wait_for(self._etcd.put(self.key.encode(), record),
                                   self._write_timeout_s)
        except Exception as exc:  # advisory: etcd down or slow; the stream goes on
            etcd_failed(exc, f"stream scaling: writing {self.key}")  # an outage: logged once
            return False
        etcd_answered()
        if self._unwritten is record:  # no newer one queued meanwhile
            self._unwritten = None
        self.written += 1
        return True


@dataclass
class _StepScaling:
    step: Step
    request_ids: frozenset[str]
    policy: StreamScaling | None  # None once nothing is left to decide
    decision: ScaleDown | None = None
    lent: tuple[str, ...] = ()
    completed: int = 0  # at the decision
    decided_unix: float = 0.0
    evaluations: list[str] = field(default_factory=list)


class StreamScaler:
    """Per-step stream-trainer scaling on a ``RolloutControl``. Synchronous: ``ScalingObserver``
    calls it from the shell's events and its tick; the shell carries out the commands."""

    def __init__(self, control: RolloutControl, publisher: ScalePublisher | None = None, *,
                 job: str = "default", manager_id: str = "manager-0",
                 quantile: float = DEFAULT_QUANTILE, headroom: float = DEFAULT_HEADROOM,
                 clock: Callable[[], float] = time.time) -> None:
        self._control = control
        self._publisher = publisher
        self._job, self._manager_id = job, manager_id
        self.quantile, self.headroom = quantile, headroom
        self._clock = clock
        self.history: list[int] = []  # the previous finished step's response lengths
        self._steps: dict[int, _StepScaling] = {}
        self._due: set[int] = set()
        self.decisions: list[ScaleDown] = []  # every decision taken (tests, logs)
        metrics.WORKERS_LENT.set(0)

    # ---- the step's life -----------------------------------------------------------------------

    def step_started(self, step: Step) -> None:
        """A ``SubmitStep`` was admitted: its decision starts from the previous step's lengths."""
        tracker = self._control.tracker
        try:
            max_tokens = step_max_tokens(tracker.get(r).sampling.max_tokens
                                         for r in step.request_ids)
            policy = StreamScaling(len(step.request_ids),
                                   scaling_history(self.history, max_tokens), max_tokens,
                                   quantile=self.quantile, headroom=self.headroom)
        except Exception:  # advisory: scaling must never break a step's stream
            log.exception("stream scaling: step %s left out", step.step_id)
            return
        self._steps[step.key] = _StepScaling(step, frozenset(step.request_ids), policy)

    def progressed(self, step: Step) -> bool:
        """A completion of ``step`` was delivered. True when a milestone may be reached: call
        ``run_due`` soon (the service's next tick)."""
        s = self._steps.get(step.key)
        if s is None or s.policy is None:
            return False
        if s.policy.due(len(s.request_ids) - len(step.outstanding)):
            self._due.add(step.key)
            return True
        return False

    def run_due(self) -> list[Command]:
        """Observe the steps that reached a milestone; the commands of any lending."""
        out: list[Command] = []
        due, self._due = sorted(self._due), set()
        for key in due:
            s = self._steps.get(key)
            if s is not None and s.policy is not None:
                out += self._observe(s)
        return out

    def step_ended(self, step: Step, lengths: list[int] | None) -> list[str]:
        """``step`` ended: ``lengths``, its finished response lengths, or None when it was
        abandoned (the history stays). Lent workers go back to rollout; returns them. Calling it
        again for the same step does nothing."""
        if lengths:
            self.history = list(lengths)
        self._due.discard(step.key)
        s = self._steps.pop(step.key, None)
        if s is None or s.decision is None:
            return []
        returned = self._control.return_from_training(s.lent)
        metrics.WORKERS_LENT.set(len(self._control.pool.lent_to_training()))
        log.info("stream scaling: step %s ended; %s back to rollout", step.step_id,
                 ", ".join(returned) or "none of the lent workers")
        self._publish(s, "returned", returned_unix=self._clock())
        return returned

    # ---- the decision --------------------------------------------------------------------------

    def view(self, step: Step) -> KvView:
        """The step's progress and KV state as the decision takes it (stream_accounting.py)."""
        tracker, pool = self._control.tracker, self._control.pool
        request_ids = self._steps[step.key].request_ids if step.key in self._steps \
            else frozenset(step.request_ids)
        remaining = [tracker.get(r) for r in step.outstanding if r in tracker]
        capacities = candidates(pool.eligible(step.weight_version))
        others = {w: sum(r.context_length for r in tracker.on_worker(w)
                         if r.request_id not in request_ids) for w in capacities}
        return kv_view(len(request_ids), remaining, capacities, others)

    def _observe(self, s: _StepScaling) -> list[Command]:
        assert s.policy is not None
        try:
            view = self.view(s.step)
            decision = s.policy.observe(view.completed, view.workers, view.waiting)
        except Exception:  # advisory: a bad input stops scaling for this step, not the step
            log.exception("stream scaling: step %s not observed; no scaling for it",
                          s.step.step_id)
            s.policy = None
            return []
        for e in s.policy.evaluations[len(s.evaluations):]:
            s.evaluations.append(f"{e.milestone_percent}%: peak {e.projected_peak_tokens} "
                                 f"usable {e.usable_tokens}")
            if not e.scaled:
                log.info("stream scaling: step %s at %d%% (%d done): projected peak %s tokens "
                         "> %s usable on the kept half; not scaling", s.step.step_id,
                         e.milestone_percent, e.completed, e.projected_peak_tokens,
                         e.usable_tokens)
        if decision is None:
            if s.policy.settled(view.completed):
                s.policy = None
            return []
        s.policy = None
        commands = self._control.lend_to_training(decision.drain)
        s.decision, s.lent = decision, decision.drain
        s.completed, s.decided_unix = view.completed, self._clock()
        self.decisions.append(decision)
        metrics.STREAM_SCALE_DOWNS.inc()
        metrics.WORKERS_LENT.set(len(self._control.pool.lent_to_training()))
        log.info("stream scaling: step %s at %d%% (%d of %d done): projected peak %d tokens fits "
                 "%d usable on %s; %s lent to training for the rest of the step (%d requests "
                 "move, tokens kept)", s.step.step_id, decision.milestone_percent,
                 view.completed, len(s.request_ids), decision.projected_peak_tokens,
                 decision.usable_tokens, ", ".join(decision.keep), ", ".join(decision.drain),
                 len(commands))
        self._publish(s, "lent", returned_unix=None)
        return commands

    def _publish(self, s: _StepScaling, state: RecordState, returned_unix: float | None) -> None:
        if self._publisher is None or s.decision is None:
            return
        self._publisher.publish(scale_record(
            s.decision, job=self._job, manager_id=self._manager_id, step_id=s.step.step_id,
            state=state, completed=s.completed, total=len(s.request_ids),
            quantile=self.quantile, headroom=self.headroom, decided_unix=s.decided_unix,
            returned_unix=returned_unix, updated_unix=self._clock()))


class ScalingObserver(ManagerObserver):
    """``StreamScaler`` on the shell's steps (observer.py). Advisory: a failure in it is logged
    and never stops a step's stream or the tick loop."""

    def __init__(self, scaler: StreamScaler) -> None:
        self.scaler = scaler
        self._shell: Shell | None = None

    def bind(self, shell: Shell) -> None:
        self._shell = shell

    def _wake(self) -> None:
        assert self._shell is not None, "bind() comes first"
        self._shell.wake()

    def step_started(self, step: Step, stream: ClientStream, submission: Submission) -> None:
        if step.profiled:
            self.scaler.step_started(step)

    def delivered(self, delivery: Delivery) -> None:
        if not delivery.ended and self.scaler.progressed(delivery.step):
            self._wake()  # a milestone: the next tick observes it (before_tick)

    def before_tick(self) -> list[Command]:
        """Observe the steps that reached a milestone; lend workers to training on a decision
        (before the core's tick: it dispatches what lending released)."""
        try:
            return self.scaler.run_due()
        except Exception:  # it must never stop the tick loop
            log.exception("stream scaling: observation failed")
            return []

    def step_ended(self, step: Step, remote: mpb.RemoteTimings | None) -> None:
        """A finished step's response lengths are the next step's history; an abandoned one
        leaves it. Workers it lent are healthy again (before the step's end reaches its
        client: they are back by then)."""
        finished = step.outcome is StepOutcome.FINISHED and step.profiled
        try:
            if self.scaler.step_ended(step, step.finished_lengths if finished else None):
                self._wake()  # the returned workers take waiting work at the next tick
        except Exception:
            log.exception("stream scaling: step %s not closed", step.step_id)
