"""Dual-SLO admission (ROSE Eq. 1-2): rollout runs only in serving's slack and headroom; the
paper's per-request slack can let a unit push the last queued prefill past its TTFT, the
queue-aware slack cannot."""

from __future__ import annotations

import math

import pytest

from rlharvest.common.errors import InvalidArgument
from rlharvest.services.coexecutor.admission import (
    AdmissionPolicy,
    DecodeBatch,
    DualSloAdmission,
    PendingPrefill,
    ServingWork,
    SlackMode,
    SloConfig,
)
from rlharvest.services.coexecutor.latency_profile import LatencyProfile

# Prefill: 100 ms for any prompt of 100 tokens (1 ms per token); decode: 10 ms + 1 ms per request.
PROFILE = LatencyProfile.linear(prefill_base_s=0.0, prefill_per_token_s=1e-3,
                                decode_base_s=0.010, decode_per_seq_s=1e-3)
SLO = SloConfig(ttft_s=0.5, tpot_s=0.15)
TWO_PREFILLS = ServingWork((PendingPrefill("a", 0.0, 100), PendingPrefill("b", 0.0, 100)))


def admission(policy=AdmissionPolicy.DUAL, mode=SlackMode.QUEUE_AWARE, slo=SLO):
    return DualSloAdmission(slo, PROFILE, policy, mode)


def test_the_papers_eq1_admits_a_unit_that_makes_the_second_prefill_miss_its_ttft():
    paper = admission(mode=SlackMode.PAPER).admit(0.0, TWO_PREFILLS, 0.35, 100, 0)
    assert paper.admitted and paper.slack_s == pytest.approx(0.4)  # 0.5 - 0.1 for each alone
    # ... but the prefills run one after the other: 0.35 + 0.1 + 0.1 = 0.55 > 0.5.
    queue = admission().admit(0.0, TWO_PREFILLS, 0.35, 100, 0)
    assert not queue.admitted and queue.reason == "no_slack"
    # Run from now, serving's tightest margin is the decode step after both prefills (0.038 s);
    # a longer delay still fits: that step's deadline moves with the prefills.
    assert queue.slack_s == pytest.approx(0.038)
    assert admission().admit(0.0, TWO_PREFILLS, 0.3, 100, 0).admitted  # ends exactly at 0.5


def test_decode_steps_due_while_prefills_run_are_counted_against_the_slack():
    # Four requests decoding (last token at t=0: next due by 0.15) and one 100-token prefill.
    work = ServingWork((PendingPrefill("p", 0.0, 100),), DecodeBatch(4, 0.0))
    a = admission()
    # From t = 0 serving runs the prefill (0.1 s), then the decode of 5 (15 ms) by 0.15: margin
    # 0.035. Delayed past that, the decode goes first (14 ms by 0.15), then the prefill: a unit
    # of up to 0.136 s fits.
    assert a.slack(0.0, work) == pytest.approx(0.035)
    assert a.admit(0.0, work, 0.136, 10, 0).admitted
    assert not a.admit(0.0, work, 0.137, 10, 0).admitted
    assert admission(AdmissionPolicy.TTFT_ONLY).admit(0.0, work, 0.3, 10, 0).admitted
    assert not admission(AdmissionPolicy.TPOT_ONLY).admit(0.0, work, 0.3, 10, 0).admitted


def test_no_serving_work_leaves_infinite_slack_but_the_headroom_still_binds():
    a = admission()
    idle = a.admit(5.0, ServingWork(), 10.0, free_pages_after=20, headroom_pages=20)
    assert idle.admitted and idle.slack_s == math.inf
    short = a.admit(5.0, ServingWork(), 0.001, free_pages_after=19, headroom_pages=20)
    assert not short.admitted and short.reason == "no_headroom"


@pytest.mark.parametrize("policy", [AdmissionPolicy.ALWAYS, AdmissionPolicy.STATIC_PARTITION])
def test_the_baselines_check_no_compute(policy):
    assert admission(policy).admit(0.0, TWO_PREFILLS, 99.0, 10, 0).admitted


def test_the_margin_is_a_share_of_each_budget_a_unit_must_leave():
    # 6% of B_TTFT = 30 ms: a 0.3 s unit ends the second prefill exactly at 0.5 s, too late now;
    # 0.25 s leaves 50 ms of TTFT and 29 ms of TPOT beyond 6% of 0.15 s.
    a = admission(slo=SloConfig(ttft_s=0.5, tpot_s=0.15, margin=0.06))
    assert not a.admit(0.0, TWO_PREFILLS, 0.3, 100, 0).admitted
    assert a.admit(0.0, TWO_PREFILLS, 0.25, 100, 0).admitted


@pytest.mark.parametrize(("key", "value"), [("ttft_s", 0.0), ("tpot_s", -1.0),
                                            ("ttft_s", float("nan")), ("margin", -0.1),
                                            ("margin", 1.0)])
def test_a_bad_slo_is_refused_by_name(key, value):
    kwargs = {"ttft_s": 0.5, "tpot_s": 0.15, key: value}
    with pytest.raises(InvalidArgument, match=key):
        SloConfig(**kwargs)
