"""The chaos soak's pure parts: a seeded fault plan, and the lineage a soak's trainer logs must
show (rlharvest/cli/chaos_plan.py)."""

from __future__ import annotations

import pytest

from rlharvest.cli.chaos_plan import KINDS, FaultPlan, applied_lineage, lineage_problems


def test_a_seed_gives_the_same_faults_and_another_seed_others():
    def faults(seed: int):
        plan = FaultPlan(seed)
        return [plan.next() for _ in range(20)]

    assert faults(3) == faults(3)
    assert faults(3) != faults(4)


def test_faults_come_within_their_interval_and_every_kind_once_per_round():
    plan = FaultPlan(7, every=(3.0, 7.0), etcd_down=(2.0, 5.0))
    faults = [plan.next() for _ in range(10 * len(KINDS))]
    assert all(3.0 <= f.after_s <= 7.0 and 0 <= f.pick < 1 for f in faults)
    for start in range(0, len(faults), len(KINDS)):
        assert sorted(f.kind for f in faults[start:start + len(KINDS)]) == sorted(KINDS)
    downs = [f.down_s for f in faults if f.kind == "etcd"]
    assert downs and all(2.0 <= d <= 5.0 for d in downs)
    assert all(f.down_s == 0 for f in faults if f.kind != "etcd")


def test_a_plan_of_unknown_kinds_or_bad_intervals_is_refused():
    with pytest.raises(ValueError, match="kinds"):
        FaultPlan(0, kinds=["worker", "cosmic ray"])
    with pytest.raises(ValueError, match="every"):
        FaultPlan(0, every=(0.0, 1.0))


def test_a_step_redone_after_a_restart_replaces_it_and_the_steps_after_it():
    messages = ["step 1 on version 0: reward 0.1", "published version 1",
                "step 2 on version 1: reward 0.2", "step 3 on version 2: reward 0.3",
                # killed after step 3, before its checkpoint: resumed from step 2's
                "resumed from checkpoint of step 2", "step 3 on version 4: reward 0.3"]
    lineage = applied_lineage(messages)
    assert lineage == [(1, 0), (2, 1), (3, 4)]
    assert lineage_problems(lineage) == []  # versions may skip what a dead trainer announced


def test_a_gap_a_repeat_or_a_version_going_back_is_a_problem():
    assert lineage_problems([(1, 0), (3, 2)])  # step 2 missing
    assert lineage_problems([(2, 1), (3, 2)])  # not from step 1
    assert lineage_problems([(1, 0), (2, 1), (3, 1)])  # one version trained twice


def test_a_step_trained_but_not_yet_checkpointed_is_the_one_to_kill_the_trainer_in():
    from rlharvest.cli.chaos_plan import unsaved_step

    saved = ["step 3 on version 2: reward 0.1", "published version 3",
             "checkpoint of step 3 (version 3) at /c/step-3"]
    assert unsaved_step(saved) is None
    assert unsaved_step([*saved, "step 4 on version 3: reward 0.2"]) == 4
    assert unsaved_step(["step 4 on version 3: reward 0.2"]) == 4  # the log read from a point
    assert unsaved_step([]) is None
