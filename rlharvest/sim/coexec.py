"""A serving device with rollout harvested in its slack, simulated (ROSE §4.1).

Drives the co-executor's real scheduler (``rlharvest/services/coexecutor/scheduler.py``) and admission
with a virtual clock: serving requests arrive, prefill (monolithic), then decode one token per
step in one batch; the rollout side always has work (a backlog of decode steps of its batch).
Every action takes exactly the time the latency profile says (``rollout_cost_s`` for a rollout
step), so "exact profiles" holds by construction. Reports, per serving request, TTFT and every
inter-token gap, and the rollout steps run.

Pure and deterministic: a trace in, a result out.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from rlharvest.services.coexecutor.admission import (
    DecodeBatch,
    DualSloAdmission,
    PendingPrefill,
    ServingWork,
)
from rlharvest.services.coexecutor.scheduler import ActionKind, CoexecScheduler, RolloutUnit
from rlharvest.sim.serving_trace import TraceRequest


@dataclass
class ServedRequest:
    ttft_s: float = math.nan
    gaps_s: list[float] = field(default_factory=list)  # between consecutive tokens
    done: bool = False


@dataclass
class CoexecResult:
    served: dict[str, ServedRequest]
    rollout_steps: int
    rollout_busy_s: float
    serving_busy_s: float
    end_s: float
    # Busy time inside [0, window_s] only (an action straddling window_s counts its part
    # inside): shares over one span that is the same for every run on a trace, whatever each
    # run's end_s. window_s None: the whole run (the same as the totals above).
    window_s: float | None = None
    rollout_busy_in_window_s: float = 0.0
    serving_busy_in_window_s: float = 0.0

    def tpot_s(self, request_id: str) -> float:
        """The request's time per output token: (t_last - t_first) / (n - 1), as served."""
        gaps = self.served[request_id].gaps_s
        return sum(gaps) / len(gaps) if gaps else 0.0

    def attained(self, ttft_budget_s: float, tpot_budget_s: float) -> float:
        """The share of requests that got their first token and met both SLOs."""
        ok = [r.ttft_s <= ttft_budget_s and self.tpot_s(rid) <= tpot_budget_s
              for rid, r in self.served.items()]
        return sum(ok) / len(ok) if ok else 1.0

    def ttft_misses(self, budget_s: float, eps: float = 1e-9) -> list[str]:
        return [rid for rid, r in self.served.items() if not r.ttft_s <= budget_s + eps]

    def gap_misses(self, budget_s: float, eps: float = 1e-9) -> list[str]:
        return [rid for rid, r in self.served.items() if any(g > budget_s + eps for g in r.gaps_s)]


def simulate(trace: Sequence[TraceRequest], admission: DualSloAdmission, *,
             rollout_cost_s: float | None, until_s: float, headroom_pages: int = 0,
             free_pages: int = 1 << 30, window_s: float | None = None) -> CoexecResult:
    """Run until ``until_s`` (virtual seconds); ``rollout_cost_s`` None: serving alone. The
    trace's request i is ``s<i>`` in the result. ``window_s``: also sum each side's busy time
    inside [0, window_s] (``rollout_busy_in_window_s``, ``serving_busy_in_window_s``)."""
    profile = admission.profile
    scheduler = CoexecScheduler(admission, headroom_pages)
    named = [(f"s{i}", r) for i, r in enumerate(trace)]
    arrivals = sorted(named, key=lambda item: item[1].arrival)
    served = {rid: ServedRequest() for rid, _ in named}
    outputs = {rid: r.output_tokens for rid, r in named}
    queue: list[PendingPrefill] = []
    batch: dict[str, tuple[float, int]] = {}  # decoding: id -> (last token time, tokens out)
    now, nxt, steps, busy, serving_busy = 0.0, 0, 0, 0.0, 0.0
    window = math.inf if window_s is None else window_s
    in_window = {"rollout": 0.0, "serving": 0.0}

    def spend(side: str, start: float, cost: float) -> None:
        in_window[side] += max(0.0, min(start + cost, window) - start)
    unit = [RolloutUnit("decode", rollout_cost_s)] if rollout_cost_s is not None else []
    while now < until_s:
        while nxt < len(arrivals) and arrivals[nxt][1].arrival <= now:
            rid, r = arrivals[nxt]
            queue.append(PendingPrefill(rid, r.arrival, r.prompt_tokens))
            nxt += 1
        oldest = min((t for t, _ in batch.values()), default=math.inf)
        work = ServingWork(tuple(queue), DecodeBatch(len(batch), oldest))
        action = scheduler.next_action(now, work, unit, free_pages)
        if action.kind is ActionKind.ROLLOUT:
            assert rollout_cost_s is not None
            spend("rollout", now, rollout_cost_s)
            now += rollout_cost_s
            steps, busy = steps + 1, busy + rollout_cost_s
        elif action.kind is ActionKind.SERVING_PREFILL:
            pending = next(p for p in queue if p.request_id == action.request_id)
            queue.remove(pending)
            cost = profile.prefill_s(pending.prompt_tokens)
            spend("serving", now, cost)
            now, serving_busy = now + cost, serving_busy + cost
            served[pending.request_id].ttft_s = now - pending.arrival
            batch[pending.request_id] = (now, 1)
            _finish_done(batch, outputs, served)
        elif action.kind is ActionKind.SERVING_DECODE:
            cost = profile.decode_s(len(batch))
            spend("serving", now, cost)
            now, serving_busy = now + cost, serving_busy + cost
            for rid, (last, out) in list(batch.items()):
                served[rid].gaps_s.append(now - last)
                batch[rid] = (now, out + 1)
            _finish_done(batch, outputs, served)
        else:  # idle until the next arrival
            if nxt == len(arrivals):
                break
            now = max(now, arrivals[nxt][1].arrival)
    return CoexecResult(served, steps, busy, serving_busy, now, window_s,
                        in_window["rollout"], in_window["serving"])


def _finish_done(batch: dict[str, tuple[float, int]], outputs: dict[str, int],
                 served: dict[str, ServedRequest]) -> None:
    for rid, (_, out) in list(batch.items()):
        if out >= outputs[rid]:
            del batch[rid]
            served[rid].done = True
