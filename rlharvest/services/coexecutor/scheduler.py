"""The co-executor's tick: one forward at a time, serving first (ROSE §4.1 "temporal sharing").

Each tick picks exactly one action:

1. a rollout unit (one prefill chunk or one decode step of the rollout batch), the first of the
   rollout side's candidates that admission lets run now: it fits the serving slack and leaves
   the headroom free (``admission.py``);
2. otherwise the serving action due: the oldest queued prefill, unless the decode batch's next
   step (due B_TPOT after its oldest last token) would then miss (``admission.decode_first``,
   the order admission's queue-aware slack assumes);
3. otherwise nothing (idle).

Under the ``always`` and ``static_partition`` policies admission never checks compute: rollout
and serving then take turns while both have work, the one-forward-at-a-time stand-in for
spatial sharing (each slowed by the other), rather than rollout starving serving.

Pure: the caller executes the action, charges its time and calls again.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from rlharvest.services.coexecutor.admission import (
    DualSloAdmission,
    ServingWork,
    Verdict,
    decode_first,
)


class ActionKind(enum.Enum):
    ROLLOUT = "rollout"
    SERVING_PREFILL = "serving_prefill"
    SERVING_DECODE = "serving_decode"
    IDLE = "idle"


@dataclass(frozen=True)
class RolloutUnit:
    """One rollout forward the rollout side could run next: its predicted cost and the pages it
    needs granted first."""

    kind: str  # "prefill_chunk" | "decode" | "step" (a decode with the prefills it admits)
    cost_s: float
    pages: int = 0


@dataclass(frozen=True)
class Action:
    kind: ActionKind
    request_id: str = ""  # SERVING_PREFILL: which request
    unit: RolloutUnit | None = None  # ROLLOUT: which unit
    verdict: Verdict | None = None  # the last admission verdict (why rollout did or did not run)


class CoexecScheduler:
    def __init__(self, admission: DualSloAdmission, headroom_pages: int) -> None:
        self.admission = admission
        self.headroom_pages = headroom_pages
        self._last_was_rollout = False

    def next_action(self, now: float, work: ServingWork, rollout: Sequence[RolloutUnit],
                    free_pages: int) -> Action:
        verdict = None
        take_turns = not self.admission.checks_compute and not work.idle
        if not (take_turns and self._last_was_rollout):
            for unit in rollout:
                verdict = self.admission.admit(now, work, unit.cost_s, free_pages - unit.pages,
                                               self.headroom_pages)
                if verdict.admitted:
                    self._last_was_rollout = True
                    return Action(ActionKind.ROLLOUT, unit=unit, verdict=verdict)
        self._last_was_rollout = False
        return serving_action(now, self.admission, work, verdict)


def serving_action(now: float, admission: DualSloAdmission, work: ServingWork,
                   verdict: Verdict | None = None) -> Action:
    """Serving's next action in its own order (``decode_first``), or IDLE."""
    first = min(work.prefills, key=lambda p: (p.arrival, p.request_id), default=None)
    if first is None and work.decode.size == 0:
        return Action(ActionKind.IDLE, verdict=verdict)
    due = work.decode.oldest_last_token + admission.slo.tpot_s
    if decode_first(now, work.decode.size, due, first.prompt_tokens if first else None,
                    admission.profile, admission.slo.tpot_s):
        return Action(ActionKind.SERVING_DECODE, verdict=verdict)
    assert first is not None
    return Action(ActionKind.SERVING_PREFILL, request_id=first.request_id, verdict=verdict)
