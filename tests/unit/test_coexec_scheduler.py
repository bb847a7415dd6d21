"""The co-executor's tick (ROSE §4.1 temporal sharing), driven by the simulator with exact
profiles: rollout harvests the slack and never makes serving miss an SLO it meets alone."""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

from rlharvest.services.coexecutor.admission import (
    AdmissionPolicy,
    DecodeBatch,
    DualSloAdmission,
    PendingPrefill,
    ServingWork,
    SloConfig,
)
from rlharvest.services.coexecutor.latency_profile import LatencyProfile
from rlharvest.services.coexecutor.scheduler import ActionKind, CoexecScheduler, RolloutUnit
from rlharvest.sim.coexec import simulate
from rlharvest.sim.serving_trace import TraceRequest

PROFILE = LatencyProfile.linear(prefill_base_s=0.002, prefill_per_token_s=2e-4,
                                decode_base_s=0.008, decode_per_seq_s=5e-4)
NEVER_DONE = 10**6  # serving outputs outlast the run: the batch only grows


def admission(ttft: float, tpot: float, policy=AdmissionPolicy.DUAL) -> DualSloAdmission:
    return DualSloAdmission(SloConfig(ttft, tpot), PROFILE, policy)


@settings(max_examples=150, deadline=None)
@given(prompts=st.lists(st.integers(1, 600), min_size=1, max_size=8),
       ttft=st.floats(0.1, 2.0), tpot=st.floats(0.02, 0.2), unit=st.floats(0.001, 0.08))
def test_with_every_request_known_rollout_causes_no_serving_slo_miss(prompts, ttft, tpot, unit):
    """All serving requests arrive at once; whatever serving alone meets, it meets with rollout
    harvesting (exact profiles, queue-aware dual-SLO admission)."""
    requests = [TraceRequest(0.0, n, NEVER_DONE) for n in prompts]
    until = ttft + 4 * tpot
    alone = simulate(requests, admission(ttft, tpot), rollout_cost_s=None, until_s=until)
    shared = simulate(requests, admission(ttft, tpot), rollout_cost_s=unit, until_s=until)
    assert set(shared.ttft_misses(ttft)) <= set(alone.ttft_misses(ttft))
    assert set(shared.gap_misses(tpot)) <= set(alone.gap_misses(tpot))


def test_rollout_fills_the_slack_between_serving_steps_and_all_of_an_idle_device():
    requests = [TraceRequest(0.0, 100, 40), TraceRequest(1.0, 100, 40)]  # s0, s1
    shared = simulate(requests, admission(0.2, 0.05), rollout_cost_s=0.01, until_s=4.0)
    assert shared.ttft_misses(0.2) == [] and shared.gap_misses(0.05) == []
    assert all(r.done for r in shared.served.values())
    # Rollout runs whenever serving does not: the device is never idle.
    assert abs(shared.rollout_busy_s + shared.serving_busy_s - shared.end_s) < 1e-6
    assert shared.rollout_busy_s > 0.8 * shared.end_s
    # and TPOT gaps were stretched toward the budget, not kept at one decode step.
    assert max(max(r.gaps_s) for r in shared.served.values()) > 3 * PROFILE.decode_s(1)


def test_without_compute_admission_rollout_and_serving_take_turns_and_tpot_suffers():
    requests = [TraceRequest(0.0, 50, 200) for _ in range(4)]  # s0 .. s3
    dual = simulate(requests, admission(0.3, 0.03), rollout_cost_s=0.04, until_s=2.0)
    always = simulate(requests, admission(0.3, 0.03, AdmissionPolicy.ALWAYS),
                      rollout_cost_s=0.04, until_s=2.0)
    # A 40 ms unit never fits between 30 ms TPOT deadlines: dual runs rollout only before the
    # first tokens (TTFT slack) and after the last; taking turns stretches every gap past it.
    assert dual.gap_misses(0.03) == [] and dual.ttft_misses(0.3) == []
    missed = set(always.gap_misses(0.03)) | set(always.ttft_misses(0.3))
    assert missed == {"s0", "s1", "s2", "s3"} and always.rollout_steps > dual.rollout_steps


def test_a_tick_runs_rollout_only_if_admitted_and_otherwise_serving_or_nothing():
    scheduler = CoexecScheduler(admission(0.5, 0.1), headroom_pages=10)
    work = ServingWork((PendingPrefill("p", 0.0, 100),), DecodeBatch(2, 0.0))
    units = [RolloutUnit("prefill_chunk", 0.5, pages=1), RolloutUnit("decode", 0.01, pages=1)]
    act = scheduler.next_action(0.0, work, units, free_pages=20)
    assert act.kind is ActionKind.ROLLOUT and act.unit is units[1]  # the first that fits
    assert scheduler.next_action(0.0, work, units, free_pages=10).kind is \
        ActionKind.SERVING_PREFILL  # the unit's page would eat into the headroom
    late = scheduler.next_action(0.085, work, units, free_pages=20)
    assert late.kind is ActionKind.SERVING_DECODE and late.verdict is not None
    assert not late.verdict.admitted
    assert scheduler.next_action(0.0, ServingWork(), [], 20).kind is ActionKind.IDLE
