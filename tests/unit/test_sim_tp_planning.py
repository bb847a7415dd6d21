"""The parallelism planner on a length ramp (rlharvest/sim/tp_planning.py): the shape of RollPacker's
Fig. 13a (§6.4) — as responses grow, TP fixed at 1 slows down faster (preemptions), the planner
raises TP as pressure rises and its rollout time stays below — and the plant it runs on."""

from __future__ import annotations

import pytest

from rlharvest.sim.tp_planning import Plant, Ramp, RampResult, main, run_rollout, simulate

MARGIN = 0.05  # a step may be this much slower than fixed TP 1 (the planner reacts a step late)


@pytest.fixture(scope="module", params=[0, 1, 2], ids=lambda seed: f"seed{seed}")
def ramp_result(request: pytest.FixtureRequest) -> RampResult:
    return simulate(ramp=Ramp(seed=request.param))


def test_the_ramp_is_the_papers_8k_to_32k_by_2k():
    assert Ramp().max_lengths() == list(range(8192, 32769, 2048))
    assert len(Ramp().max_lengths()) == 13


def test_fixed_tp_1_preempts_more_and_slows_down_faster_as_lengths_grow(ramp_result: RampResult):
    fixed = ramp_result.fixed
    assert fixed[0].preemptions == 0 < fixed[-1].preemptions
    growth = fixed[-1].rollout_s / fixed[0].rollout_s
    assert growth > fixed[-1].max_length / fixed[0].max_length  # faster than the lengths grow


def test_the_planner_raises_tp_at_least_once(ramp_result: RampResult):
    tps = [r.tp for r in ramp_result.adaptive]
    assert tps[0] == 1 and max(tps) > 1


def test_the_planners_tp_never_falls_while_lengths_grow(ramp_result: RampResult):
    tps = [r.tp for r in ramp_result.adaptive]
    assert tps == sorted(tps)


def test_the_planner_is_never_much_slower_than_fixed_tp_1(ramp_result: RampResult):
    for fixed, adaptive in zip(ramp_result.fixed, ramp_result.adaptive):
        assert adaptive.rollout_s <= fixed.rollout_s * (1 + MARGIN), adaptive.step


def test_the_planner_is_strictly_faster_in_total_and_at_the_long_end(ramp_result: RampResult):
    assert ramp_result.speedup > 1.0
    third = len(ramp_result.fixed) // 3
    long_fixed = sum(r.rollout_s for r in ramp_result.fixed[-third:])
    long_adaptive = sum(r.rollout_s for r in ramp_result.adaptive[-third:])
    assert long_adaptive < long_fixed
    assert all(r.tp > 1 for r in ramp_result.adaptive[-third:])


def test_the_planner_preempts_less_than_fixed_tp_1_once_it_has_raised_tp(
        ramp_result: RampResult):
    raised = [(f, a) for f, a in zip(ramp_result.fixed, ramp_result.adaptive) if a.tp > 1]
    assert sum(a.preemptions for _, a in raised) < sum(f.preemptions for f, _ in raised)


# --- the plant --------------------------------------------------------------------------------

def test_a_bigger_tp_group_holds_more_kv_per_gpu():
    plant = Plant()
    per_gpu = [plant.kv_tokens(tp) / tp for tp in (1, 2, 4, 8)]
    assert per_gpu == sorted(per_gpu) and per_gpu[0] < per_gpu[1]


def test_without_memory_pressure_a_rollout_is_its_longest_groups_prefill_and_decode():
    plant = Plant(gpus=1, gpus_per_node=1, chunk=100)
    time, preemptions = run_rollout([100, 200], 1, plant)
    prefill = 2 * plant.prompt_tokens * plant.prefill_s_per_token
    decode = 100 * plant.step_s(1, 2) + 100 * plant.step_s(1, 1)
    assert preemptions == 0 and time == pytest.approx(prefill + decode)


def test_a_full_kv_cache_preempts_and_a_roomier_one_does_not():
    lengths = [20_000] * 64
    tight = run_rollout(lengths, 1, Plant(gpus=1, gpus_per_node=1))
    roomy = run_rollout(lengths, 1, Plant(gpus=1, gpus_per_node=1, usable_gb=400.0))
    assert tight[1] > 0 == roomy[1] and tight[0] > roomy[0]


def test_a_response_that_cannot_fit_a_group_is_refused():
    with pytest.raises(ValueError, match="does not fit a TP 1 group"):
        run_rollout([10**6], 1, Plant(gpus=1, gpus_per_node=1))


def test_main_prints_the_table_and_the_total_ratio(capsys: pytest.CaptureFixture[str]):
    main()
    out = capsys.readouterr().out
    assert "fixed/planner" in out and len(out.splitlines()) == 1 + 13 + 2
