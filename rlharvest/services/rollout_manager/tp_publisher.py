"""The manager's side of RollPacker's TP planner (§4.2): observe each step, publish the plan.

Opt-in (``--tp-planner``) and advisory: the torch engine cannot change its TP size, so the plan is
only published, in etcd under ``keys.tp_plan_key(job)`` (format: ``tp_accounting.plan_record``),
for an operator, an autoscaler or a vLLM deployment to apply, and as ``rlh_manager_tp_plan``.

``step_ended`` runs in the step's stream (``TpPlanning``, the shell's observer, calls it when the
step's last completion is delivered, with the preemptions the workers reported while it ran,
``tp_accounting.PreemptionTally``, and its finished response lengths): it feeds the planner, which is synchronous and cheap, and hands the record to ``run``,
a background loop that writes it. The stream never waits for etcd. A failed write (etcd down) is
logged and the record stays unwritten: the next step's record replaces it and is written then.

The record carries the planner's ``state_dict()``: ``load`` (at start, before the first step)
resumes it, so a restarted manager keeps its TP sizes and baselines. A record that does not fit
this planner (another ``--gpus-per-node``, a newer version) is logged and the planner starts
from ``--initial-tp``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable

from rlharvest.common import keys
from rlharvest.common.etcd_outage import etcd_answered, etcd_failed
from rlharvest.common.pb import rollout_manager_pb2 as mpb
from rlharvest.services.rollout_manager import metrics
from rlharvest.services.rollout_manager.client_stream import ClientStream
from rlharvest.services.rollout_manager.observer import ManagerObserver, Shell, Submission
from rlharvest.services.rollout_manager.step import Step, StepOutcome
from rlharvest.services.rollout_manager.tp_accounting import (
    PreemptionTally,
    StepReport,
    parse_plan_record,
    plan_record,
    step_histogram,
)
from rlharvest.services.rollout_manager.tp_planner import ROUND_KINDS, TpDecision, TpPlanner

log = logging.getLogger(__name__)


class TpPublisher:
    def __init__(self, etcd, planner: TpPlanner, *, job: str, manager_id: str,
                 write_timeout_s: float = 10.0, clock: Callable[[], float] = time.time) -> None:
        self._etcd = etcd
        self.planner = planner
        self._job = job
        self._manager_id = manager_id
        self._key = keys.tp_plan_key(job)
        self._write_timeout_s = write_timeout_s
        self._clock = clock
        self._unwritten: bytes | None = None
        self._wake = asyncio.Event()
        self.steps = 0
        self.written = 0  # records written (tests, logs)
        self._gauges()

    async def load(self) -> bool:
        """Resume the planner from the stored record; False when there is none or it is not
        usable (the planner keeps its initial state)."""
        try:
            found = await asyncio.wait_for(self._etcd.get(self._key.encode()),
                                           self._write_timeout_s)
            record = parse_plan_record(None if found is None else found.value)
            if record is None:
                return False
            if record.state is None:
                raise ValueError("it has no planner state")
            self.planner.load_state_dict(record.state)
        except Exception as exc:  # advisory: a bad or unreadable record must not stop the job
            log.warning("TP planner: not resuming from %s (%s); starting from TP %s", self._key,
                        exc, self.planner.published().to_json())
            return False
        self.steps = record.steps
        self._gauges()
        log.info("TP planner resumed from %s after %d steps: short TP %d, long TP %d",
                 self._key, self.steps, self.planner.plan("short"), self.planner.plan("long"))
        return True

    def step_ended(self, step_id: str, kind: str, preemptions: int,
                   lengths: Iterable[int]) -> TpDecision:
        """A finished step: feed the planner, queue the record. Never waits."""
        lengths = list(lengths)
        decision = self.planner.observe(kind, preemptions, step_histogram(lengths))
        self.steps += 1
        self._gauges()
        if decision.changed:
            log.info("TP plan: %s (step %s)", decision.reason, step_id)
        report = StepReport(step_id, kind, preemptions, len(lengths), decision)
        self._unwritten = plan_record(self.planner, job=self._job, manager_id=self._manager_id,
                                    steps=self.steps, last_step=report,
                                    updated_unix=self._clock())
        self._wake.set()
        return decision

    async def run(self) -> None:
        """Write the latest unwritten record whenever there is one."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            await self.flush()

    async def flush(self) -> bool:
        """Write the unwritten record, if any; False when the write failed (it stays unwritten)."""
        record = self._unwritten
        if record is None:
            return True
        try:
            await asyncio.wait_for(self._etcd.put(self._key.encode(), record),
                                   self._write_timeout_s)
        except Exception as exc:  # advisory: etcd down or slow; the next step writes again
            etcd_failed(exc, f"TP planner: writing {self._key}")  # an outage: logged once
            return False
        etcd_answered()
        if self._unwritten is record:  # no newer one queued meanwhile
            self._unwritten = None
        self.written += 1
        return True

    def _gauges(self) -> None:
        for kind in ROUND_KINDS:
            metrics.TP_PLAN.labels(kind).set(self.planner.plan(kind))


class TpPlanning(ManagerObserver):
    """Each step of the RL loop, observed by the planner when it finishes: the preemptions
    seen while it ran and its finished response lengths; its policy says its round kind."""

    def __init__(self, publisher: TpPublisher) -> None:
        self.publisher = publisher
        self._tally: PreemptionTally | None = None

    def bind(self, shell: Shell) -> None:
        self._tally = shell.control.preemptions

    @property
    def tally(self) -> PreemptionTally:
        assert self._tally is not None, "bind() comes first"
        return self._tally

    def step_started(self, step: Step, stream: ClientStream, submission: Submission) -> None:
        if step.profiled:  # a step of the RL loop, not a single Generate
            self.tally.open(step.key)

    def step_ended(self, step: Step, remote: mpb.RemoteTimings | None) -> None:
        if step.outcome is not StepOutcome.FINISHED:
            self.tally.drop(step.key)
            return
        preemptions = self.tally.close(step.key)
        if preemptions is None:
            return
        try:
            self.publisher.step_ended(step.step_id, step.policy.round_kind, preemptions,
                                      step.finished_lengths)
        except Exception:  # advisory: the planner must never break a step's stream
            log.exception("TP planner: step %s not observed", step.step_id)
