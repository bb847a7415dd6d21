"""RollPacker's parallelism planner (rlharvest/services/rollout_manager/tp_planner.py, §4.2): the paper's
doubling/halving rule per round kind, its bounds, its published state, and the cost model."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rlharvest.services.rollout_manager.tp_planner import (
    CostModel, TpPlan, TpPlanner, TpProfile, best_tp, length_histogram, tp_sizes)

GPUS_PER_NODE = 8


def _profile(comm_s: float = 0.006, room_per_gpu: int = 44_000, weights: int = 28_000,
             sizes: tuple[int, ...] = (1, 2, 4, 8)) -> TpProfile:
    """A linear decode profile (weights read split over TP, a fixed all-reduce cost per doubling,
    per-sequence work) and KV room that grows faster than TP (weights split)."""
    def step_s(tp: int, b: int) -> float:
        return 0.002 + comm_s * math.log2(tp) + (0.008 + 0.0003 * b) / tp

    return TpProfile(
        decode_s={tp: {b: step_s(tp, b) for b in (1, 2, 4, 8, 16, 32, 64, 128, 256)}
                  for tp in sizes},
        kv_tokens={tp: room_per_gpu * tp - weights for tp in sizes},
        prefill_s_per_token={tp: 1e-5 / tp for tp in sizes})


def _model(**kwargs: object) -> CostModel:
    return CostModel(_profile(**kwargs), gpus=8, prompt_tokens=512)  # type: ignore[arg-type]


LIGHT = {512: 8, 1024: 4}  # a few short responses: no memory pressure anywhere
HEAVY = {4096: 400, 8192: 200, 16384: 40}  # far more KV than TP 1 holds


def _planner(initial_tp: int = 1, **kwargs: object) -> TpPlanner:
    return TpPlanner(GPUS_PER_NODE, initial_tp, **kwargs)  # type: ignore[arg-type]


def _feed(planner: TpPlanner, kind: str, counts: list[int]) -> None:
    for n in counts:
        planner.observe(kind, n)


# --- the rule ---------------------------------------------------------------------------------

@given(previous=st.integers(0, 10**6), extra=st.integers(1, 1000))
def test_preemptions_above_1_05x_the_previous_step_double_tp(previous: int, extra: int):
    planner = _planner(2)
    planner.observe("short", previous)
    decision = planner.observe("short", previous * 105 // 100 + extra)
    assert (decision.tp_before, decision.tp_after) == (2, 4) and planner.plan("short") == 4


@given(previous=st.integers(1, 10**5).map(lambda k: 20 * k))
def test_exactly_1_05x_the_previous_step_does_not_double(previous: int):
    planner = _planner(2)
    planner.observe("short", previous)
    assert not planner.observe("short", previous * 21 // 20).changed
    assert planner.plan("short") == 2


def test_any_preemption_after_a_step_without_any_is_a_rise():
    planner = _planner()
    _feed(planner, "short", [0, 1])
    assert planner.plan("short") == 2


def test_the_first_step_of_a_kind_only_sets_the_baseline():
    planner = _planner()
    assert not planner.observe("short", 10_000).changed
    assert planner.plan("short") == 1


def test_a_fall_or_a_steady_count_keeps_tp():
    planner = _planner(2)
    _feed(planner, "long", [100, 90, 90, 94])
    assert planner.plan("long") == 2


def test_four_consecutive_steps_without_preemptions_halve_tp():
    planner = _planner(4)
    _feed(planner, "short", [5, 0, 0, 0])
    assert planner.plan("short") == 4
    decision = planner.observe("short", 0)
    assert (decision.tp_before, decision.tp_after) == (4, 2)
    assert "4 steps without preemptions" in decision.reason


def test_three_steps_without_preemptions_do_not_halve():
    planner = _planner(4)
    _feed(planner, "short", [0, 0, 0])
    assert planner.plan("short") == 4


def test_a_preempted_step_restarts_the_count_of_calm_steps():
    planner = _planner(4)
    _feed(planner, "short", [0, 0, 0, 3, 0, 0, 0])  # 3 after 0 doubles; then only three calm
    assert planner.plan("short") == 8
    planner.observe("short", 0)
    assert planner.plan("short") == 4


def test_after_a_halving_four_more_calm_steps_are_needed_for_the_next():
    planner = _planner(8)
    _feed(planner, "short", [0] * 4)
    assert planner.plan("short") == 4
    _feed(planner, "short", [0] * 3)
    assert planner.plan("short") == 4
    planner.observe("short", 0)
    assert planner.plan("short") == 2


def test_round_kinds_keep_separate_baselines_and_calm_counts():
    planner = _planner(2)
    _feed(planner, "short", [100])
    _feed(planner, "long", [10])
    planner.observe("short", 104)  # a rise over long's 10, but not over short's 100
    assert (planner.plan("short"), planner.plan("long")) == (2, 2)
    planner.observe("long", 11)  # 11 > 1.05 x 10: long doubles, short does not
    assert (planner.plan("short"), planner.plan("long")) == (2, 4)
    _feed(planner, "short", [0, 0, 0])
    _feed(planner, "long", [0, 0, 0, 0])  # long's calm steps do not count for short
    assert (planner.plan("short"), planner.plan("long")) == (2, 2)
    planner.observe("short", 0)
    assert (planner.plan("short"), planner.plan("long")) == (1, 2)


@given(st.lists(st.tuples(st.sampled_from(["short", "long"]), st.integers(0, 50)), max_size=60),
       st.sampled_from([1, 2, 4, 8, 16]), st.data())
def test_tp_stays_a_power_of_two_within_1_and_gpus_per_node(
        steps: list[tuple[str, int]], gpus_per_node: int, data: st.DataObject):
    initial = data.draw(st.sampled_from(tp_sizes(gpus_per_node)))
    planner = TpPlanner(gpus_per_node, initial)
    for kind, count in steps:
        planner.observe(kind, count)
        for k in ("short", "long"):
            assert planner.plan(k) in tp_sizes(gpus_per_node)


def test_a_doubling_at_gpus_per_node_is_blocked_and_says_so():
    planner = _planner(GPUS_PER_NODE)
    decision = [planner.observe("short", n) for n in (1, 50)][-1]
    assert not decision.changed and "bound" in decision.reason
    assert planner.plan("short") == GPUS_PER_NODE


def test_a_halving_at_tp_1_is_blocked_and_says_so():
    planner = _planner(1)
    decision = [planner.observe("long", 0) for _ in range(4)][-1]
    assert not decision.changed and "bound" in decision.reason


# --- published plan and state -----------------------------------------------------------------

def test_the_published_plan_gives_each_kinds_tp_and_the_reason_of_the_last_change():
    planner = _planner()
    assert planner.published() == TpPlan(1, 1, "initial TP 1 (profiled best)")
    _feed(planner, "long", [10, 20])
    plan = planner.published()
    assert (plan.tp("short"), plan.tp("long")) == (1, 2)
    assert plan.reason.startswith("long: preemptions rose from 10 to 20") and "1 -> 2" in \
        plan.reason
    planner.observe("long", 20)  # no change: the reason stays the last change's
    assert planner.published().reason == plan.reason


def test_the_published_plan_round_trips_through_json():
    plan = TpPlan(2, 4, "short: x")
    assert TpPlan.from_json(json.loads(json.dumps(plan.to_json()))) == plan


@pytest.mark.parametrize("data", [{"short_tp": 3, "long_tp": 1, "reason": ""},
                                  {"short_tp": 1, "long_tp": 1},
                                  {"short_tp": True, "long_tp": 1, "reason": ""}])
def test_a_malformed_published_plan_is_refused(data: dict):
    with pytest.raises(ValueError, match="not a TP plan"):
        TpPlan.from_json(data)


@given(st.lists(st.tuples(st.sampled_from(["short", "long"]), st.integers(0, 30),
                          st.booleans()), max_size=30),
       st.lists(st.tuples(st.sampled_from(["short", "long"]), st.integers(0, 30)), max_size=15))
def test_state_round_trips_through_json_and_the_restored_planner_decides_the_same(
        past: list[tuple[str, int, bool]], future: list[tuple[str, int]]):
    original = _planner(2, model=_model())
    for kind, count, with_lengths in past:
        original.observe(kind, count, HEAVY if with_lengths else None)
    restored = _planner(1, model=_model())
    restored.load_state_dict(json.loads(json.dumps(original.state_dict())))
    assert restored.state_dict() == original.state_dict()
    assert restored.published() == original.published()
    for kind, count in future:
        assert original.observe(kind, count) == restored.observe(kind, count)


@pytest.mark.parametrize("mutate, match", [
    (lambda s: s.update(version=99), "version"),
    (lambda s: s["kinds"].pop("long"), "kinds"),
    (lambda s: s["kinds"]["short"].update(tp=16), "power of two in"),
    (lambda s: s["kinds"]["short"].update(tp=3), "power of two in"),
    (lambda s: s["kinds"]["short"].update(last_preemptions=-1), "last_preemptions"),
    (lambda s: s["kinds"]["short"].update(calm=4), "calm"),
    (lambda s: s["kinds"]["short"].update(lengths=[[0, 3]]), "histogram key"),
    (lambda s: s["kinds"]["short"].update(lengths={"5": 3}), "pairs"),
])
def test_state_that_does_not_fit_the_planner_is_refused(mutate, match: str):
    state = json.loads(json.dumps(_planner().state_dict()))
    mutate(state)
    planner = _planner()
    before = planner.state_dict()
    with pytest.raises(ValueError, match=match):
        planner.load_state_dict(state)
    assert planner.state_dict() == before  # nothing half-restored


# --- validation -------------------------------------------------------------------------------

@pytest.mark.parametrize("gpus_per_node", [0, 3, 6, 12, -8])
def test_gpus_per_node_must_be_a_power_of_two(gpus_per_node: int):
    with pytest.raises(ValueError, match="gpus_per_node must be a power of two"):
        TpPlanner(gpus_per_node)


@pytest.mark.parametrize("initial_tp", [0, 3, 16])
def test_the_initial_tp_must_be_a_power_of_two_within_the_node(initial_tp: int):
    with pytest.raises(ValueError, match="power of two in \\[1, 8\\]"):
        _planner(initial_tp)


@pytest.mark.parametrize("kwargs, match", [({"rise": 0.9}, "rise"), ({"rise": math.inf}, "rise"),
                                           ({"calm_steps": 0}, "calm_steps"),
                                           ({"veto_margin": -0.1}, "veto_margin")])
def test_bad_rule_parameters_are_refused(kwargs: dict, match: str):
    with pytest.raises(ValueError, match=match):
        _planner(**kwargs)


def test_an_unknown_round_kind_is_refused():
    planner = _planner()
    with pytest.raises(ValueError, match="unknown round kind 'medium'"):
        planner.observe("medium", 1)
    with pytest.raises(ValueError, match="unknown round kind"):
        planner.plan("Short")


@pytest.mark.parametrize("count", [-1, 1.5, True, "3"])
def test_a_preemption_count_must_be_a_non_negative_int(count: object):
    with pytest.raises(ValueError, match="preemptions must be an int >= 0"):
        _planner().observe("short", count)  # type: ignore[arg-type]


@pytest.mark.parametrize("histogram, match", [({0: 3}, "histogram key"), ({-5: 3}, "key"),
                                              ({100: -1}, "count"), ({100: math.nan}, "count")])
def test_a_malformed_length_histogram_is_refused(histogram: dict, match: str):
    with pytest.raises(ValueError, match=match):
        _planner().observe("short", 0, histogram)


def test_a_cost_model_that_cannot_judge_every_tp_the_planner_may_pick_is_refused():
    with pytest.raises(ValueError, match=r"cannot judge TP sizes \[8\]"):
        _planner(model=CostModel(_profile(sizes=(1, 2, 4)), gpus=8, prompt_tokens=0))
    with pytest.raises(ValueError, match=r"cannot judge TP sizes \[8\]"):
        _planner(model=CostModel(_profile(), gpus=4, prompt_tokens=0))


# --- the cost model ---------------------------------------------------------------------------

histograms = st.dictionaries(st.integers(1, 20_000), st.integers(0, 300), min_size=1).filter(
    lambda h: sum(h.values()) > 0)


@given(histograms, st.integers(1, 200_000), st.integers(0, 200_000))
def test_more_kv_room_never_predicts_more_preemptions_or_a_longer_rollout(
        histogram: dict[int, int], room: int, more: int):
    def model(kv: int) -> CostModel:
        p = _profile(sizes=(1,))
        return CostModel(TpProfile(p.decode_s, {1: kv}, p.prefill_s_per_token), 8, 512)

    small, big = model(room).predict(1, histogram), model(room + more).predict(1, histogram)
    assert big.preemptions <= small.preemptions
    assert big.makespan_s <= small.makespan_s * (1 + 1e-12)


def test_when_the_peak_fits_no_preemptions_are_predicted_and_the_time_is_pure_decode():
    prediction = _model().predict(1, {1000: 8})  # one 1000-token response per GPU
    assert prediction.preemptions == 0
    assert prediction.makespan_s == pytest.approx(1000 * _profile().step_s(1, 1))


def test_at_small_batch_without_memory_pressure_the_larger_tp_is_slower():
    model = _model()
    times = [model.predict(tp, LIGHT).makespan_s for tp in (1, 2, 4, 8)]
    assert times == sorted(times) and times[0] < times[1]
    assert all(model.predict(tp, LIGHT).preemptions == 0 for tp in (1, 2, 4, 8))


def test_under_memory_pressure_the_larger_tp_preempts_less_and_is_faster():
    model = _model()
    tp1, tp2 = model.predict(1, HEAVY), model.predict(2, HEAVY)
    assert tp1.preemptions > tp2.preemptions
    assert tp2.makespan_s < tp1.makespan_s


def test_a_long_tail_alone_favours_the_smaller_tp_and_a_crowd_the_larger():
    model = _model()
    tail = {8000: 1}
    assert model.predict(1, tail).makespan_s < model.predict(2, tail).makespan_s
    assert model.best_tp(HEAVY, 8) > model.best_tp(tail, 8) == 1


def test_a_response_that_cannot_fit_a_group_makes_that_tp_infeasible():
    model = _model()  # TP 1 holds 16k tokens, TP 2 60k
    assert model.predict(1, {20_000: 1}).makespan_s == math.inf
    assert model.predict(2, {20_000: 1}).makespan_s < math.inf
    assert model.best_tp({20_000: 1}, 8) == 2


def test_best_tp_picks_the_fastest_usable_size_and_breaks_ties_towards_the_smaller():
    assert best_tp(_profile(), LIGHT, gpus=8, prompt_tokens=512, max_tp=8) == 1
    assert best_tp(_profile(), HEAVY, gpus=8, prompt_tokens=512, max_tp=1) == 1
    flat = TpProfile({1: {1: 1.0}, 2: {1: 1.0}}, {1: 10**6, 2: 10**6}, {1: 0.0, 2: 0.0})
    assert best_tp(flat, LIGHT, gpus=2, prompt_tokens=0, max_tp=2) == 1
    with pytest.raises(ValueError, match="no profiled TP size"):
        best_tp(_profile(sizes=(4, 8)), LIGHT, gpus=8, prompt_tokens=0, max_tp=2)


def test_predicting_for_an_unprofiled_or_non_dividing_tp_or_an_empty_histogram_is_refused():
    with pytest.raises(ValueError, match="TP 16 is not usable"):
        _model().predict(16, LIGHT)
    with pytest.raises(ValueError, match="TP 8 is not usable"):
        CostModel(_profile(), gpus=4, prompt_tokens=0).predict(8, LIGHT)
    with pytest.raises(ValueError, match="empty"):
        _model().predict(1, {100: 0})


def test_step_time_interpolates_between_profiled_batches_clamps_below_and_extrapolates_above():
    profile = TpProfile({1: {2: 1.0, 4: 2.0}}, {1: 100}, {1: 0.0})
    assert profile.step_s(1, 3) == pytest.approx(1.5)
    assert profile.step_s(1, 0.5) == 1.0
    assert profile.step_s(1, 8) == pytest.approx(4.0)  # the last segment's slope, 0.5 per seq
    profile = TpProfile({1: {1: 1.0, 2: 1.5, 4: 2.0}}, {1: 100}, {1: 0.0})
    assert profile.step_s(1, 8) == pytest.approx(3.0)
    assert TpProfile({1: {4: 2.0}}, {1: 100}, {1: 0.0}).step_s(1, 64) == 2.0  # one point: flat


@pytest.mark.parametrize("kwargs, match", [
    ({"decode_s": {}, "kv_tokens": {}, "prefill_s_per_token": {}}, "same, non-empty"),
    ({"decode_s": {1: {1: 1.0}}, "kv_tokens": {2: 5}, "prefill_s_per_token": {1: 0.0}}, "same"),
    ({"decode_s": {3: {1: 1.0}}, "kv_tokens": {3: 5}, "prefill_s_per_token": {3: 0.0}},
     "power of two"),
    ({"decode_s": {1: {0: 1.0}}, "kv_tokens": {1: 5}, "prefill_s_per_token": {1: 0.0}},
     "batch sizes"),
    ({"decode_s": {1: {1: 0.0}}, "kv_tokens": {1: 5}, "prefill_s_per_token": {1: 0.0}},
     "seconds > 0"),
    ({"decode_s": {1: {1: 1.0}}, "kv_tokens": {1: 0}, "prefill_s_per_token": {1: 0.0}},
     "kv_tokens must be >= 1"),
])
def test_a_malformed_profile_is_refused(kwargs: dict, match: str):
    with pytest.raises(ValueError, match=match):
        TpProfile(**kwargs)


def test_length_histograms_key_each_bucket_by_its_upper_edge():
    assert length_histogram([0, 1, 256, 257, 1000], 256) == {256: 3, 512: 1, 1024: 1}
    with pytest.raises(ValueError, match="bucket_tokens"):
        length_histogram([1], 0)


# --- the cost model inside the planner ---------------------------------------------------------

def test_the_cost_model_vetoes_a_doubling_it_predicts_clearly_slower():
    planner = _planner(model=_model())
    planner.observe("short", 0, LIGHT)
    decision = planner.observe("short", 5, LIGHT)
    assert not decision.changed and "vetoed" in decision.reason
    assert planner.published().reason == "initial TP 1 (profiled best)"


def test_the_cost_model_lets_a_doubling_through_under_memory_pressure():
    planner = _planner(model=_model())
    _feed(planner, "short", [10])
    assert planner.observe("short", 20, HEAVY).tp_after == 2


def test_the_cost_model_vetoes_a_halving_it_predicts_slower():
    planner = _planner(2, model=_model())
    decisions = [planner.observe("long", 0, HEAVY) for _ in range(4)]
    assert "vetoed" in decisions[-1].reason and planner.plan("long") == 2
    _feed(planner, "long", [0, 0, 0])  # the calm count restarted after the veto
    assert planner.plan("long") == 2


def test_the_cost_model_allows_a_halving_it_predicts_faster():
    planner = _planner(2, model=_model())
    _feed(planner, "long", [0, 0, 0])
    assert planner.observe("long", 0, LIGHT).tp_after == 1


def test_without_a_histogram_of_the_kind_the_heuristic_decides_alone():
    planner = _planner(model=_model())
    planner.observe("long", 0, LIGHT)  # a histogram of the other kind does not count
    _feed(planner, "short", [0, 5])
    assert planner.plan("short") == 2


def test_an_empty_histogram_keeps_the_last_one():
    planner = _planner(model=_model())
    planner.observe("short", 0, LIGHT)
    planner.observe("short", 5, {})
    assert planner.plan("short") == 1  # still judged on LIGHT: vetoed


# --- the offline profile as the manager reads it (--tp-profile) ---------------------------------

def _profile_file(tmp_path, lengths=None, **changes: object):
    profile = _profile()
    data: dict[str, object] = {
        "gpus": 8, "prompt_tokens": 512, "decode_s": profile.decode_s,
        "kv_tokens": profile.kv_tokens, "prefill_s_per_token": profile.prefill_s_per_token,
        **({} if lengths is None else {"lengths": lengths}), **changes}
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(data))  # JSON turns the int keys into strings
    return str(path)


def test_the_managers_planner_starts_at_the_profiles_best_tp_and_its_model_vetoes(tmp_path):
    from rlharvest.services.rollout_manager.config import ManagerConfig

    best = _model().best_tp(HEAVY, GPUS_PER_NODE)
    assert best > 1  # the claim needs a workload whose best is not the default
    cfg = ManagerConfig(tp_planner=True, tp_profile=_profile_file(tmp_path, HEAVY))
    planner = cfg.tp_planner_of()
    assert planner.plan("short") == planner.plan("long") == best
    # The profile's model is in the live planner: a rise it predicts clearly slower is vetoed.
    planner.observe("short", 0, LIGHT)
    assert "vetoed" in planner.observe("short", 5, LIGHT).reason
    # An explicit --initial-tp wins over the profile's start; a profile without lengths keeps 1.
    explicit = ManagerConfig(tp_planner=True, initial_tp=1,
                             tp_profile=_profile_file(tmp_path, HEAVY))
    assert explicit.tp_planner_of().plan("long") == 1
    assert ManagerConfig(tp_profile=_profile_file(tmp_path)).tp_planner_of().plan("long") == 1


@pytest.mark.parametrize("change, message", [
    ({"gpus": None}, "malformed"),
    ({"kv_tokens": []}, "kv_tokens must be an object"),
    ({"decode_s": {"3": {"1": 0.1}}}, "same, non-empty TP sizes"),
    ({"speed": 1}, "unknown TP profile keys"),
    ({"lengths": {"10": -1}}, "histogram"),
])
def test_a_bad_profile_is_refused_at_startup_naming_what(tmp_path, change, message):
    from pydantic import ValidationError

    from rlharvest.services.rollout_manager.config import ManagerConfig

    with pytest.raises(ValidationError, match=message):
        ManagerConfig(tp_profile=_profile_file(tmp_path, **change))


def test_a_profile_file_that_is_no_object_or_missing_is_refused(tmp_path):
    from pydantic import ValidationError

    from rlharvest.services.rollout_manager.config import ManagerConfig

    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(ValidationError, match="a TP profile is a JSON object, got list"):
        ManagerConfig(tp_profile=str(tmp_path / "list.json"))
    with pytest.raises(ValidationError, match="tp_profile .*nowhere"):
        ManagerConfig(tp_profile=str(tmp_path / "nowhere.json"))
