"""RollPacker's stream trainer, the scaling decision (§4.4, Algorithm 1 lines 13-21).

Once enough of a step's responses are done, rollout no longer needs all of its workers: the
stream trainer drains half of them (their requests move, with their tokens, to the workers that
stay) and hands their GPUs to training. ``StreamScaling`` decides when and which workers; the
manager drains them and tells the trainer. Pure and synchronous, one instance per step: the
step's progress in, at most one ``ScaleDown`` out.

When. At each *milestone* — 20%, 25%, ... 50% of the step's requests completed — it projects the
peak KV demand of the remaining requests and scales if that peak fits the KV capacity of the
workers that would stay, less a headroom. Milestones are a fixed grid, not Algorithm 1's "5% more
since the last check" (``Delta_R``): a fixed grid gives the same evaluations however coarsely
progress is reported, and at most seven per step. Several milestones crossed in one update are
evaluated once, at the highest of them: every projection reads the same current state, so
evaluating it several times would only repeat the same answer. An update past 50% evaluates
nothing, even if it crossed a milestone on the way (Algorithm 1 line 14 checks ``<= 0.5`` at the
time of the check: scaling later leaves little rollout left to overlap training with).

Which. The least-loaded ``floor(n / 2)`` workers by running tokens, ties by worker id: they hold
the fewest tokens to recompute where their requests land (migration is recomputation-based).
"Half" of an odd n rounds down: the majority stays on rollout, which keeps the risk on the side
of rollout throughput, and one worker never scales. The paper's "do not split a communication
group" check holds by construction: a worker is one model replica with its whole TP group.

The projection, per remaining request i (prompt p_i, output so far g_i):

* Final length. ``L_i = min(max_tokens, Q_q(H | h > g_i))``: the q-quantile of the historical
  response lengths H *longer than the request already is* — a request still running at g tokens
  will end beyond g, so the lengths it can still take are the history's tail past g (a request
  already past the history's median is predicted from the long tail, not the median). No
  history past g_i: ``max_tokens``, the only bound left. Q is the upper empirical quantile (the
  ceil(q*m)-th smallest of the m tail samples), so it is always a length seen in the history.
* Peak. Let c_i = p_i + g_i be its context now and d_i = L_i - g_i the tokens it has left. Under
  continuous batching every running request gains one token per engine step, so t steps from now
  the live requests hold ``S(t) = sum over {i: d_i >= t} of (c_i + t)``. S grows between
  finishes and drops just after one, so its maximum is at a finish: ``peak = max over k of
  (C_k + k * d_(k))`` with the d sorted in decreasing order and C_k the sum of the k largest
  ones' c (ties resolve themselves: the last of a tie counts the whole tie). This is exact when
  the predictions are exact and every request decodes from now on, and an upper bound whenever
  each true length is at most its prediction: a shorter request leaves S sooner and never adds
  to it (S is non-decreasing in every d_i).
* Skew. Requests do not all decode in lockstep: a migrated request waits for its re-prefill, a
  request held in the manager waits for a slot. If none starts more than ``start_skew`` steps
  late, then at any time t a live request holds at most c_i + t tokens and has d_i >= t - skew
  left: the live ones at t hold at most S(t - skew) + skew * R, so the true peak is at most
  ``peak + skew * R`` for R remaining requests.
* Any schedule. Whatever the order, no request ever holds more than its final context, so
  ``sum of (c_i + d_i)`` bounds every schedule. The projection is the smaller of the two bounds;
  ``start_skew=None`` keeps only the schedule-free one.

The quantile. q = 1 makes the projection a sure bound for lengths drawn from the history's own
distribution. Below 1 a request may outrun its prediction, but the peak rarely does: predictions
at one quantile end the requests nearly together (the worst case for a peak), while true
lengths spread the finishes out and peak lower. The median alone is not enough where a share of
the responses hits max_tokens (a bimodal history: it underestimated a third of the tests'
trials); 0.9 underestimated none of them (lognormal, heavy-tailed, bimodal; 8 and 32 requests),
at the price of projecting typically 1.4-5x the true peak (more on wider distributions), which
moves scaling to a later milestone, where fewer requests remain, rather than risking the
preemptions scaling must not cause.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from rlharvest.common.errors import InvalidArgument

MILESTONES_PERCENT: tuple[int, ...] = (20, 25, 30, 35, 40, 45, 50)

# 0.9: conservative for the peak even with a mass of truncated responses (module docstring),
# below 1 so the single longest response of the history does not decide every prediction.
DEFAULT_QUANTILE = 0.9
# 10% of the staying workers' KV stays free: paged KV rounds every context up to a block, the
# capacity is pooled while each request lives on one worker (the balancer cannot split one), and
# the response-length distribution drifts between steps. Exceeding it costs preemptions (§4.2),
# which is the slowdown scaling must not cause.
DEFAULT_HEADROOM = 0.10
# Steps by which a request may start decoding late: a migrated request's recompute prefill
# (a 32k-token context in 2048-token chunks is 16 engine steps) with room to spare.
DEFAULT_START_SKEW = 64


class StreamScalingError(InvalidArgument, ValueError):
    """Progress or settings the scaling decision cannot use; the message says which and why."""


@dataclass(frozen=True)
class RemainingRequest:
    """A request of the step that has not completed: its prompt and its tokens so far."""

    prompt_tokens: int
    output_tokens: int

    @property
    def context_tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens


@dataclass(frozen=True)
class WorkerKV:
    """One rollout worker as the decision sees it: its KV capacity and what runs on it."""

    worker_id: str
    kv_capacity_tokens: int
    running: tuple[RemainingRequest, ...] = ()

    @property
    def running_tokens(self) -> int:
        """Its load: the tokens it would have to hand over (and others recompute) if drained."""
        return sum(r.context_tokens for r in self.running)


@dataclass(frozen=True)
class ScaleDown:
    """Drain ``drain`` (least loaded first) and give their GPUs to training."""

    milestone_percent: int
    drain: tuple[str, ...]
    keep: tuple[str, ...]
    projected_peak_tokens: int
    capacity_tokens: int  # the KV capacity of ``keep``
    usable_tokens: int  # capacity less the headroom: the projection had to fit this


@dataclass(frozen=True)
class Evaluation:
    """One milestone's check, kept for logs and metrics whether it scaled or not."""

    milestone_percent: int
    completed: int
    projected_peak_tokens: int | None  # None: fewer than 2 workers, nothing projected
    usable_tokens: int | None
    scaled: bool


class LengthPredictor:
    """Final response lengths from a history, conditioned on the length reached so far."""

    def __init__(self, history: Iterable[int], max_tokens: int, quantile: float) -> None:
        """``history``: finished response lengths (output tokens) of a comparable step, e.g.
        the previous one; lengths beyond ``max_tokens`` are clamped to it (this step cannot run
        them). ``quantile`` in (0, 1]."""
        _require(isinstance(max_tokens, int) and max_tokens >= 1,
                 f"max_tokens must be a positive int, got {max_tokens!r}")
        _require(0.0 < quantile <= 1.0,
                 f"quantile must be in (0, 1], got {quantile!r}; 0.9 is a conservative choice")
        lengths = list(history)
        _require(bool(lengths), "the response-length history is empty: scaling needs at least "
                                "one finished length (the previous step's)")
        bad = [h for h in lengths if not isinstance(h, int) or h < 1]
        _require(not bad, f"history lengths must be positive ints, got {bad[:3]!r}")
        self.max_tokens, self.quantile = max_tokens, quantile
        self._sorted = sorted(min(h, max_tokens) for h in lengths)

    def final_length(self, output_tokens: int) -> int:
        """Predicted final output length of a request that has ``output_tokens`` and runs on."""
        tail_start = bisect_right(self._sorted, output_tokens)  # the history longer than it
        tail = len(self._sorted) - tail_start
        if tail == 0:
            return max(self.max_tokens, output_tokens)
        # round(): q * m computed in floats can land a hair above an integer (0.9 * 10).
        k = max(1, math.ceil(round(self.quantile * tail, 9)))
        return self._sorted[tail_start + k - 1]


def project_peak_kv(remaining: Sequence[RemainingRequest], predictor: LengthPredictor,
                    start_skew: int | None = DEFAULT_START_SKEW) -> int:
    """Projected peak KV tokens of ``remaining``: an upper bound of the live-context peak while
    each request ends within its predicted length and (unless ``start_skew`` is None) none
    starts decoding more than ``start_skew`` steps late. Derivation in the module docstring."""
    if not remaining:
        return 0
    now = [r.context_tokens for r in remaining]
    left = [predictor.final_length(r.output_tokens) - r.output_tokens for r in remaining]
    any_schedule = sum(now) + sum(left)
    if start_skew is None:
        return any_schedule
    return min(any_schedule, _lockstep_peak(now, left) + start_skew * len(remaining))


def _lockstep_peak(now: Sequence[int], left: Sequence[int]) -> int:
    """max over k of (C_k + k * d_(k)), the d in decreasing order (module docstring)."""
    peak = prefix = 0
    for k, (d, c) in enumerate(sorted(zip(left, now), reverse=True), start=1):
        prefix += c
        peak = max(peak, prefix + k * d)
    return peak


class StreamScaling:
    """One step's scaling decision: ``observe`` after each progress update; it returns a
    ``ScaleDown`` at most once per step, at a milestone whose projection fits."""

    def __init__(self, total_requests: int, history: Iterable[int], max_tokens: int, *,
                 quantile: float = DEFAULT_QUANTILE, headroom: float = DEFAULT_HEADROOM,
                 start_skew: int | None = DEFAULT_START_SKEW) -> None:
        _require(isinstance(total_requests, int) and total_requests >= 1,
                 f"total_requests must be a positive int, got {total_requests!r}")
        _require(0.0 <= headroom < 1.0, f"headroom must be in [0, 1), got {headroom!r}")
        _require(start_skew is None or (isinstance(start_skew, int) and start_skew >= 0),
                 f"start_skew must be a non-negative int or None, got {start_skew!r}")
        self.total = total_requests
        self.predictor = LengthPredictor(history, max_tokens, quantile)
        self.headroom, self.start_skew = headroom, start_skew
        self.decision: ScaleDown | None = None
        self.evaluations: list[Evaluation] = []
        self._completed = 0
        self._next = 0  # index into MILESTONES_PERCENT of the first milestone not yet passed

    def observe(self, completed: int, workers: Sequence[WorkerKV],
                waiting: Sequence[RemainingRequest] = ()) -> ScaleDown | None:
        """The step's progress now: ``completed`` requests that will not run again (finished,
        cut or failed), every worker with the step's requests running on it, and ``waiting``,
        the remaining requests on no worker (held in the manager, or between workers).
        Returns the decision the one time it is taken, else None."""
        self._check(completed, workers, waiting)
        self._completed = completed
        milestone = self._crossed(completed)
        if milestone is None or self.decision is not None:
            return None
        if completed * 100 > 50 * self.total:
            return None  # past the window: the crossed milestones are spent unevaluated
        return self._evaluate(milestone, completed, workers, waiting)

    def due(self, completed: int) -> bool:
        """Whether ``observe`` at ``completed`` would evaluate a milestone: no decision yet, a
        milestone not passed yet is reached, and it is not past 50%. A caller whose progress is
        costly to gather (the manager walks the step's requests) observes only then: skipping
        the other updates changes no decision, as crossed milestones are evaluated once, at
        the highest, from the state at that update."""
        return (self.decision is None and completed * 100 <= 50 * self.total
                and self._next < len(MILESTONES_PERCENT)
                and completed * 100 >= MILESTONES_PERCENT[self._next] * self.total)

    def settled(self, completed: int) -> bool:
        """Nothing is left to decide from ``completed`` on: decided, or past the window."""
        return self.decision is not None or completed * 100 > 50 * self.total

    def _crossed(self, completed: int) -> int | None:
        """The highest milestone newly reached, marking it and those below it as passed."""
        reached = None
        while (self._next < len(MILESTONES_PERCENT)
               and completed * 100 >= MILESTONES_PERCENT[self._next] * self.total):
            reached = MILESTONES_PERCENT[self._next]
            self._next += 1
        return reached

    def _evaluate(self, milestone: int, completed: int, workers: Sequence[WorkerKV],
                  waiting: Sequence[RemainingRequest]) -> ScaleDown | None:
        if len(workers) < 2:  # half of one worker is none: nothing to give to training
            self.evaluations.append(Evaluation(milestone, completed, None, None, False))
            return None
        by_load = sorted(workers, key=lambda w: (w.running_tokens, w.worker_id))
        drain, keep = by_load[:len(workers) // 2], by_load[len(workers) // 2:]
        remaining = [r for w in workers for r in w.running] + list(waiting)
        peak = project_peak_kv(remaining, self.predictor, self.start_skew)
        capacity = sum(w.kv_capacity_tokens for w in keep)
        usable = math.floor(capacity * (1.0 - self.headroom))
        fits = peak <= usable
        self.evaluations.append(Evaluation(milestone, completed, peak, usable, fits))
        if not fits:
            return None
        self.decision = ScaleDown(milestone, tuple(w.worker_id for w in drain),
                                  tuple(w.worker_id for w in keep), peak, capacity, usable)
        return self.decision

    def _check(self, completed: int, workers: Sequence[WorkerKV],
               waiting: Sequence[RemainingRequest]) -> None:
        _require(isinstance(completed, int) and 0 <= completed <= self.total,
                 f"completed must be an int in [0, {self.total}], got {completed!r}")
        _require(completed >= self._completed,
                 f"completed went back from {self._completed} to {completed}: a step's "
                 f"completed count only grows; use a new StreamScaling for a new step")
        ids = [w.worker_id for w in workers]
        _require(len(set(ids)) == len(ids), f"worker ids repeat: {sorted(ids)!r}")
        for w in workers:
            _require(w.kv_capacity_tokens >= 1, f"worker {w.worker_id!r} has KV capacity "
                                                f"{w.kv_capacity_tokens}; it must be >= 1 token")
            for r in w.running:
                self._check_request(r, f"on worker {w.worker_id!r}")
        for r in waiting:
            self._check_request(r, "waiting")
        held = sum(len(w.running) for w in workers) + len(waiting)
        _require(held == self.total - completed,
                 f"{held} requests running or waiting, but {self.total} - {completed} = "
                 f"{self.total - completed} remain: pass every remaining request exactly once")

    def _check_request(self, r: RemainingRequest, where: str) -> None:
        _require(r.prompt_tokens >= 0 and r.output_tokens >= 0,
                 f"a request {where} has negative lengths: {r!r}")
        _require(r.output_tokens <= self.predictor.max_tokens,
                 f"a request {where} has {r.output_tokens} output tokens, beyond max_tokens="
                 f"{self.predictor.max_tokens}; pass the step's max_tokens")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise StreamScalingError(message)
