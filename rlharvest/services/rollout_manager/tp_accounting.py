"""What the rollout manager feeds RollPacker's TP planner (tp_planner.py), and the record it
publishes: pure, no clock, no I/O (tp_publisher.py does the etcd side).

**Preemptions of a step.** Workers report ``Load.preemptions``, their total since start, in every
load message (the session's first event and every step's outputs). ``PreemptionTally`` turns
those totals into increases per worker, summed into one running count; a step's preemptions are
that count at its end minus the count at its start, i.e. the sum over workers of the increase of
their totals while the step ran. Decisions:

- a total that went *down* is a restarted worker (a new process under the same id): its whole new
  total is new;
- the *first* total seen from a worker is only its baseline (counts 0): a manager that restarts
  next to running workers must not read their lifetime totals as one step's preemptions. A worker
  reports before it runs anything (the session's first event), so a fresh worker loses nothing;
- totals of workers that left are kept (one int per id), so one that comes back (same process,
  a new lease) does not count its total twice;
- the count is per worker, not per request: preemptions of requests of another step running at
  the same time (a concurrent ``Generate``, overlapping steps) count for both. Per-request counts
  would need the workers to report them.

**Round kind.** A step submitted with an acceptance rule is a tail batching *short* round; any
other ``SubmitStep`` counts as *long*: the manager cannot tell a long round from a plain step
(without tail batching every step is "long", which is the one state the planner needs then).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from rlharvest.common.records import json_object
from rlharvest.services.rollout_manager.tp_planner import (
    TpDecision,
    TpPlan,
    TpPlanner,
    length_histogram,
)

# Response lengths are bucketed before they reach the planner (and its persisted state): the
# histogram stays small (at most max_new_tokens / 64 buckets) and the cost model reads each
# bucket as its upper edge, erring towards longer responses.
LENGTH_BUCKET_TOKENS = 64


def round_kind(has_acceptance: bool) -> str:
    """The planner's round kind of a step: "short" with an acceptance rule, else "long"."""
    return "short" if has_acceptance else "long"


class PreemptionTally:
    """Per-worker preemption totals -> increases, and per-step windows over their sum."""

    def __init__(self) -> None:
        self._last: dict[str, int] = {}  # worker id -> the last total it reported
        self._open: dict[object, int] = {}  # step key -> ``seen`` when the step started
        self.seen = 0  # preemptions seen since this manager started, all workers

    def report(self, worker_id: str, total: int) -> int:
        """A worker's total since its start; returns how many preemptions are new."""
        if total < 0:
            raise ValueError(f"worker {worker_id}: a preemption total cannot be negative, got "
                             f"{total}")
        last = self._last.get(worker_id)
        self._last[worker_id] = total
        if last is None:
            return 0  # the baseline
        new = total - last if total >= last else total  # went down: a new process
        self.seen += new
        return new

    def forget(self, worker_id: str) -> None:
        """The worker is gone for good: the same id reporting again is a new baseline."""
        self._last.pop(worker_id, None)

    def open(self, step: object) -> None:
        """``step`` (any hashable key) starts now."""
        self._open[step] = self.seen

    def close(self, step: object) -> int | None:
        """``step`` ended: the preemptions seen since it opened (None if it was never opened)."""
        start = self._open.pop(step, None)
        return None if start is None else self.seen - start

    def drop(self, step: object) -> None:
        """``step`` ended without a count (abandoned): forget it."""
        self._open.pop(step, None)


def step_histogram(lengths: Iterable[int]) -> dict[int, int] | None:
    """The planner's length input for a step's finished responses (None: no response)."""
    return length_histogram(lengths, LENGTH_BUCKET_TOKENS) or None


@dataclass(frozen=True)
class StepReport:
    """One observed step, as the record shows it."""

    step_id: str
    kind: str
    preemptions: int
    responses: int  # finished responses whose lengths went into the histogram
    decision: TpDecision

    def to_json(self) -> dict[str, object]:
        return {"step_id": self.step_id, "kind": self.kind, "preemptions": self.preemptions,
                "responses": self.responses, "tp_before": self.decision.tp_before,
                "tp_after": self.decision.tp_after, "decision": self.decision.reason}


def plan_record(planner: TpPlanner, *, job: str, manager_id: str, steps: int,
                last_step: StepReport | None, updated_unix: float) -> bytes:
    """What ``keys.tp_plan_key(job)`` holds (JSON): the published plan at the top level (so
    ``TpPlan.from_json`` reads the record as it is), then who wrote it and the last observed
    step, and ``state``, the planner's ``state_dict()`` a restarted manager resumes from::

        {"short_tp": 1, "long_tp": 2, "reason": "long: preemptions rose ...: TP 1 -> 2",
         "job": "j", "manager": "manager-0", "gpus_per_node": 8, "steps": 2,
         "last_step": {"step_id", "kind", "preemptions", "responses", "tp_before",
                       "tp_after", "decision"} | null,
         "updated_unix": 1700000000.0, "state": {...}}
    """
    return json.dumps({
        **planner.published().to_json(), "job": job, "manager": manager_id,
        "gpus_per_node": planner.gpus_per_node, "steps": steps,
        "last_step": None if last_step is None else last_step.to_json(),
        "updated_unix": updated_unix, "state": planner.state_dict()}).encode()


@dataclass(frozen=True)
class PlanRecord:
    plan: TpPlan
    steps: int
    state: Mapping[str, object] | None  # the planner's state_dict(); None if missing
    raw: Mapping[str, object]


def parse_plan_record(raw: bytes | None) -> PlanRecord | None:
    """A stored record, or None when absent; ValueError when it is not a plan record."""
    if raw is None:
        return None
    data = json_object(raw, "TP plan record")
    plan = TpPlan.from_json(data)
    steps, state = data.get("steps", 0), data.get("state")
    return PlanRecord(plan, steps if isinstance(steps, int) and steps >= 0 else 0,
                      state if isinstance(state, dict) else None, data)
