"""Dual-SLO admission of rollout work on a serving device (ROSE §4.1 Eq. 1-2, §4.3).

One forward runs at a time. Before each rollout unit (one prefill chunk, or one decode step of
the rollout batch) the executor asks whether serving can afford it:

- compute: the unit's predicted cost c fits in the serving SLO slack S, keeping ``margin`` of
  each budget unused (a share: measured steps scatter around the profile, and requests arrive
  while a unit runs);
- memory: after the unit's pages are granted, at least the headroom H of the pool stays free.

The slack, per ``slack_mode``:

- ``paper`` — Eq. 1 and 2 as written: S_prf = min over queued prefills r of
  (t_r^arr + B_TTFT) - t_now - T̂_prf(L_r, mono); S_dec = (t^last + B_TPOT) - t_now - T̂_dec(b)
  for the decode batch (its oldest last token); S = min(S_prf, S_dec) (PD-colocated serving).
  Eq. 1 ignores that queued prefills run one after another, so a unit that fits every request's
  own slack can still push the last of them past its TTFT (tests/unit/test_coexec_admission.py
  shows one). Kept for the Fig. 9 comparisons.
- ``queue_aware`` (default; our deviation) — the same deadlines, checked by running the known
  serving work forward from t_now + c in the order serving will run it (``decode_first``:
  queued prefills first, oldest first, unless the decode batch's next step, due B_TPOT after
  its last, would then miss; every prefilled request joins the batch), and admitting only if
  every deadline is still met. (The reported slack is that run's smallest margin from t_now;
  a delay can be admissible beyond it, since later decode deadlines move with the delay.) With exact profiles and no new arrivals, rollout then causes no serving SLO miss
  (property-tested in the scheduler's tests); a request arriving while a unit runs waits at most
  that unit, which the chunk size bounds.

Policies (Fig. 9 and Table 2 baselines): ``dual`` (both SLOs), ``ttft_only``, ``tpot_only``,
``always`` (no compute check: spatial sharing) and ``static_partition`` (no compute check; the
memory split is the memory policy's). Pure: times are arguments.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass

from rlharvest.common.errors import InvalidArgument
from rlharvest.services.coexecutor.latency_profile import LatencyProfile

_MAX_SIM_STEPS = 100_000  # a decode step that takes no time would never let the prefills run
_EPS = 1e-9  # float rounding of summed step times is no miss


class AdmissionPolicy(str, enum.Enum):
    DUAL = "dual"
    TTFT_ONLY = "ttft_only"
    TPOT_ONLY = "tpot_only"
    ALWAYS = "always"
    STATIC_PARTITION = "static_partition"


class SlackMode(str, enum.Enum):
    PAPER = "paper"
    QUEUE_AWARE = "queue_aware"


@dataclass(frozen=True)
class SloConfig:
    ttft_s: float  # B_TTFT
    tpot_s: float  # B_TPOT
    margin: float = 0.0  # share of each budget a unit leaves unused (the paper's is 0)

    def __post_init__(self) -> None:
        for key in ("ttft_s", "tpot_s"):
            value = getattr(self, key)
            if not math.isfinite(value) or value <= 0:
                raise InvalidArgument(f"{key} must be a positive number of seconds, got {value}")
        if not 0 <= self.margin < 1:
            raise InvalidArgument(f"margin must be in [0, 1), got {self.margin}")


@dataclass(frozen=True)
class PendingPrefill:
    """A serving request waiting for its prefill."""

    request_id: str
    arrival: float
    prompt_tokens: int


@dataclass(frozen=True)
class DecodeBatch:
    """The serving requests decoding: how many, and when the oldest got its latest token."""

    size: int = 0
    oldest_last_token: float = math.inf


@dataclass(frozen=True)
class ServingWork:
    prefills: Sequence[PendingPrefill] = ()
    decode: DecodeBatch = DecodeBatch()

    @property
    def idle(self) -> bool:
        return not self.prefills and self.decode.size == 0


@dataclass(frozen=True)
class Verdict:
    admitted: bool
    reason: str  # "admitted" | "no_slack" | "no_headroom"
    slack_s: float


def decode_first(now: float, batch: int, decode_due: float, next_prefill_tokens: int | None,
                 profile: LatencyProfile, tpot_s: float) -> bool:
    """Serving's own order: the next queued prefill first (vLLM's default: it is what TTFT
    waits on), unless the decode batch's next step would then miss its deadline — and the
    prefill would fit after that step. A prefill longer than B_TPOT can never fit between two
    decode steps; it runs now rather than wait for ever (a monolithic prefill stalls decode)."""
    if batch == 0:
        return False
    if next_prefill_tokens is None:
        return True
    prefill_then_decode = profile.prefill_s(next_prefill_tokens) + profile.decode_s(batch + 1)
    return now + prefill_then_decode > decode_due and prefill_then_decode <= tpot_s


class DualSloAdmission:
    def __init__(self, slo: SloConfig, profile: LatencyProfile,
                 policy: AdmissionPolicy = AdmissionPolicy.DUAL,
                 slack_mode: SlackMode = SlackMode.QUEUE_AWARE) -> None:
        self.slo = slo
        self.profile = profile
        self.policy = AdmissionPolicy(policy)
        self.slack_mode = SlackMode(slack_mode)

    @property
    def checks_compute(self) -> bool:
        return self.policy in (AdmissionPolicy.DUAL, AdmissionPolicy.TTFT_ONLY,
                               AdmissionPolicy.TPOT_ONLY)

    def slack(self, now: float, work: ServingWork, start_delay: float = 0.0) -> float:
        """S: how long serving can wait from ``now + start_delay`` and still meet every SLO it
        is checked for (math.inf with no serving work or no compute check)."""
        if not self.checks_compute or work.idle:
            return math.inf
        if self.slack_mode is SlackMode.PAPER:
            return self._paper_slack(now + start_delay, work)
        return self._queue_slack(now + start_delay, work)

    def admit(self, now: float, work: ServingWork, cost_s: float, free_pages_after: int,
              headroom_pages: int) -> Verdict:
        """Whether a rollout unit of predicted ``cost_s`` may run now, leaving
        ``free_pages_after`` pages free once its pages are granted."""
        if free_pages_after < headroom_pages:
            return Verdict(False, "no_headroom", self.slack(now, work))
        if not self.checks_compute or work.idle:
            return Verdict(True, "admitted", math.inf)
        if self.slack_mode is SlackMode.PAPER:
            slack = self._paper_slack(now, work)
            fits = cost_s <= slack + _EPS
        else:  # the deadlines with the unit run first; EDF order can change with the delay
            slack = self._queue_slack(now, work)
            fits = self._queue_slack(now + cost_s, work) >= -_EPS
        return Verdict(fits, "admitted" if fits else "no_slack", slack)

    # ---- Eq. 1 and 2 ---------------------------------------------------------------------------

    def _budgets(self) -> tuple[float, float]:
        """B_TTFT and B_TPOT less the margin: the deadlines admission plans against."""
        keep = 1.0 - self.slo.margin
        return self.slo.ttft_s * keep, self.slo.tpot_s * keep

    def _paper_slack(self, now: float, work: ServingWork) -> float:
        ttft, tpot = self._budgets()
        prf = min((p.arrival + ttft - now - self.profile.prefill_s(p.prompt_tokens)
                   for p in work.prefills), default=math.inf)
        dec = math.inf
        if work.decode.size:
            dec = (work.decode.oldest_last_token + tpot - now
                   - self.profile.decode_s(work.decode.size))
        if self.policy is AdmissionPolicy.TTFT_ONLY:
            return prf
        if self.policy is AdmissionPolicy.TPOT_ONLY:
            return dec
        return min(prf, dec)

    # ---- the known serving work, run forward --------------------------------------------------

    def _queue_slack(self, start: float, work: ServingWork) -> float:
        """The smallest margin by which a checked deadline is met when serving runs its known
        work in its own order (``decode_first``) from ``start`` (negative: one is missed)."""
        ttft = self.policy is not AdmissionPolicy.TPOT_ONLY
        tpot = self.policy is not AdmissionPolicy.TTFT_ONLY
        # The scheduler's order exactly (scheduler.serving_action): oldest first, then id; its
        # decode deadline is the real B_TPOT. The margins only shrink what counts as met.
        slo = self.slo
        keep_ttft, keep_tpot = slo.margin * slo.ttft_s, slo.margin * slo.tpot_s
        queue = sorted((p.arrival + slo.ttft_s, p.request_id, p.prompt_tokens)
                       for p in work.prefills)
        batch, due = work.decode.size, work.decode.oldest_last_token + slo.tpot_s
        t, worst, i = start, math.inf, 0
        for _ in range(_MAX_SIM_STEPS):
            if i == len(queue) and batch == 0:
                return worst
            head = queue[i][2] if i < len(queue) else None
            if decode_first(t, batch, due, head, self.profile, self.slo.tpot_s):
                t += self.profile.decode_s(batch)
                if tpot:
                    worst = min(worst, due - keep_tpot - t)
                if i == len(queue):
                    return worst  # the batch's later steps wait on nothing known now
                due = t + self.slo.tpot_s
            else:
                deadline, _, tokens = queue[i]
                i += 1
                t += self.profile.prefill_s(tokens)
                if ttft:
                    worst = min(worst, deadline - keep_ttft - t)
                batch += 1  # its first token is out: it decodes from now on
                due = min(due, t + self.slo.tpot_s)
        return -math.inf  # decode steps that take no time: nothing can be promised
