"""The placement scheduler's decision state (control.py), pure and on an injected clock: SLO
attainment, reclaimed bubbles, full pools, jobs lost while no scheduler led, drift eviction,
and what a submission may say (WEAVE §4.2, §4.3, §5.3)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from rlharvest.common.pb import placement_scheduler_pb2 as pb
from rlharvest.services.placement_scheduler.client import JobSpec
from rlharvest.services.placement_scheduler.control import PlacementControl, Refusal, Submission
from rlharvest.services.placement_scheduler.model import H20, H800, JobProfile, PlacementError, Pool
from rlharvest.services.placement_scheduler.service import submitted_spec
from tests.builders import Clock

START = 1_000.0  # the control reads wall-clock time by default, which is never near 0
PROFILE = JobProfile(batch_size=64, prompt_tokens=256, max_response_tokens=1024,
                     decode_s_per_token=0.05, prefill_s=2.0, train_tokens_per_s=20_000.0,
                     turns=2, env_s_per_turn=1.0, sync_s=5.0)


def control(clock: Clock, rollout: int = 2, train: int = 1) -> PlacementControl:
    names = {Pool.ROLLOUT: [f"r{i}" for i in range(1, rollout + 1)],
             Pool.TRAIN: [f"t{i}" for i in range(1, train + 1)]}
    return PlacementControl(names, dataclasses.replace(H20, max_nodes=rollout),
                            dataclasses.replace(H800, max_nodes=train), clock=clock)


def spec(job_id: str, t_roll: float = 10.0, t_train: float = 10.0, slo: float = 2.0,
         nodes: int = 1) -> dict:
    return dict(job_id=job_id, t_roll=t_roll, t_train=t_train, slo=slo, rollout_nodes=nodes)


def run_phase(ctl: PlacementControl, clock: Clock, job_id: str, phase: Pool, iteration: int,
              seconds: float, wait_s: float = 0.0):
    clock.advance(wait_s)  # the job's client idles before asking for its permit
    assert ctl.acquire(job_id, phase, iteration) is not None, f"{job_id} {phase} #{iteration}"
    clock.advance(seconds)
    return ctl.release(job_id, phase, iteration)


def run_iteration(ctl: PlacementControl, clock: Clock, job_id: str, iteration: int,
                  wait_s: float = 0.0) -> None:
    run_phase(ctl, clock, job_id, Pool.ROLLOUT, iteration, 10.0, wait_s)
    run_phase(ctl, clock, job_id, Pool.TRAIN, iteration, 10.0)


def test_slo_attainment_counts_iterations_within_slo_times_solo() -> None:
    clock = Clock(START)
    ctl = control(clock)
    ctl.submit(spec("A", slo=1.5))  # solo iteration 20 s: an iteration may take up to 30 s
    run_iteration(ctl, clock, "A", 0)  # the first iteration only starts the measurement
    run_iteration(ctl, clock, "A", 1)  # 20 s: met
    run_iteration(ctl, clock, "A", 2, wait_s=25)  # 45 s: missed
    run_iteration(ctl, clock, "A", 3, wait_s=10)  # exactly 30 s: met
    record = ctl.record("A")
    assert (record.iterations_done, record.slo_met, record.slo_missed) == (4, 2, 1)
    assert ctl.stats.slo_attainment == pytest.approx(2 / 3)


def test_tail_migration_reclaims_bubble_node_seconds_until_the_tail_ends() -> None:
    clock = Clock(START)
    ctl = control(clock)
    ctl.submit(spec("A", nodes=2))
    assert ctl.submit(spec("B", nodes=2)).decision.strategy.value == "direct_packing"
    assert ctl.acquire("A", Pool.ROLLOUT, 0).node_ids == ("r1", "r2")
    clock.advance(5)
    migration = ctl.progress("A", 0, total=10, finished=9, unfinished_by_node={"r1": 1, "r2": 0})
    assert (migration.keep_node_ids, migration.freed_node_ids) == (("r1",), ("r2",))
    permit = ctl.acquire("B", Pool.ROLLOUT, 0)  # B starts on the freed node before A's tail ends
    assert (permit.node_ids, permit.pending_node_ids) == (("r2",), ("r1",))
    clock.advance(3)  # A's tail runs 3 more seconds on r1 while B uses r2
    assert ctl.release("A", Pool.ROLLOUT, 0).released
    assert ctl.stats.tail_migrations == 1
    assert ctl.stats.bubble_node_seconds == pytest.approx(3.0)  # 3 s × 1 freed node
    grown = ctl.acquire("B", Pool.ROLLOUT, 0)  # asked again: the same permit, now on both nodes
    assert set(grown.node_ids) == {"r1", "r2"} and grown.pending_node_ids == ()


def test_full_pools_refuse_with_resource_exhausted_until_a_job_leaves() -> None:
    clock = Clock(START)
    ctl = control(clock, rollout=1, train=1)
    ctl.submit(spec("A", slo=1.0))
    with pytest.raises(Refusal) as refused:  # B breaks A's SLO; no node left for a new group
        ctl.submit(spec("B", t_roll=15.0, t_train=15.0, slo=1.0))
    assert refused.value.kind == "exhausted"
    assert "wait for jobs to leave or grow the pools" in str(refused.value)
    with pytest.raises(Refusal) as too_big:  # never placeable: a different answer
        ctl.submit(spec("C", nodes=2))
    assert too_big.value.kind == "precondition"
    assert ctl.cancel("A") == ["r1", "t1"]
    assert ctl.submit(spec("B", t_roll=15.0, t_train=15.0, slo=1.0)).rollout_node_ids == ("r1",)


def test_jobs_whose_lease_expired_while_no_scheduler_led_leave_and_the_group_goes_on() -> None:
    clock = Clock(START)
    ctl = control(clock)
    ctl.submit(spec("A"), lease_id=7)
    ctl.submit(spec("B", t_roll=5.0, t_train=5.0, slo=4.0), lease_id=8)
    ctl.submit(spec("C", t_roll=1.0, t_train=1.0, slo=20.0))  # no lease: leaves only if cancelled
    assert len(ctl.scheduler.groups) == 1
    assert ctl.acquire("A", Pool.ROLLOUT, 0) is not None  # A dies holding its permit
    persisted = json.loads(json.dumps(ctl.records()))  # what etcd holds when the leader dies
    successor = control(clock)
    successor.restore(persisted)
    assert successor.fail_expired(alive_job_ids={"B"}) == ["A"]
    assert sorted(successor.jobs) == ["B", "C"]
    assert successor.stats.departures == {"failed": 1}
    assert successor.scheduler.group_of("B").group_id == ctl.jobs["B"].group_id
    assert successor.acquire("B", Pool.ROLLOUT, 0) is not None  # A's permit passed on
    with pytest.raises(Refusal) as gone:
        successor.acquire("A", Pool.ROLLOUT, 0)
    assert gone.value.kind == "not_found"


def test_drift_within_the_groups_slack_only_updates_the_estimate() -> None:
    clock = Clock(START)
    ctl = control(clock)
    ctl.submit(spec("A"))
    outcome = run_phase(ctl, clock, "A", Pool.ROLLOUT, 0, 13.0)  # 1.3 × the estimate
    assert outcome.released and not outcome.evicted and "estimate updated" in outcome.message
    assert ctl.scheduler.group_of("A").jobs["A"].t_roll == 13.0


def test_drift_breaking_a_members_slo_evicts_only_the_drifting_job() -> None:
    clock = Clock(START)
    ctl = control(clock, train=2)
    ctl.submit(spec("A"))
    ctl.submit(spec("B"))  # packed with A: both iterate every 20 s, A may take 40 s
    run_phase(ctl, clock, "A", Pool.ROLLOUT, 0, 10.0)
    outcome = run_phase(ctl, clock, "B", Pool.ROLLOUT, 0, 50.0)  # A would now iterate in 60 s
    assert outcome.released and outcome.evicted
    assert "re-profile and resubmit" in outcome.message
    assert list(ctl.jobs) == ["A"] and ctl.stats.departures == {"drift": 1}
    assert list(ctl.scheduler.group_of("A").jobs) == ["A"]
    run_phase(ctl, clock, "A", Pool.TRAIN, 0, 10.0)  # A goes on
    with pytest.raises(Refusal) as gone:
        ctl.acquire("B", Pool.TRAIN, 0)
    assert gone.value.kind == "not_found"
    again = ctl.submit(spec("B", t_roll=50.0))  # re-profiled and resubmitted: a new arrival,
    assert again.decision.strategy.value == "isolated"  # placed away from A this time


def test_a_profiled_job_is_planned_at_its_worst_case_durations() -> None:
    ctl = control(Clock(START))
    ctl.submit({"job_id": "P", "profile": dataclasses.asdict(PROFILE), "slo": 1.5})
    job = ctl.scheduler.group_of("P").jobs["P"]
    assert (job.t_roll, job.t_train) == (PROFILE.worst_case_rollout_s(),
                                         PROFILE.worst_case_train_s())
    assert job.slo == 1.5


@pytest.mark.parametrize("submission, words", [
    ({"job_id": "x", "slo": 0.0, "t_roll": 1.0, "t_train": 1.0}, "slo must be >= 1"),
    ({"job_id": "x", "rollout_nodes": 0, "t_roll": 1.0, "t_train": 1.0},
     "rollout_nodes must be an integer >= 1"),
    ({"job_id": "x", "train_nodes": -1, "t_roll": 1.0, "t_train": 1.0},
     "train_nodes must be an integer >= 1"),
    ({"job_id": "x", "t_roll": 1.0}, "gives no t_train"),
    ({"job_id": "x", "t_roll": 1.0, "profile": dataclasses.asdict(PROFILE)}, "not both"),
    ({"job_id": "x", "profile": {**dataclasses.asdict(PROFILE), "batch_size": 0}},
     "profile batch_size must be >= 1"),
])
def test_bad_submissions_are_refused_naming_the_field(submission, words) -> None:
    with pytest.raises(Refusal) as refused:
        control(Clock(START)).submit(submission)
    assert refused.value.kind == "invalid" and words in str(refused.value)


def test_unset_fields_take_defaults_but_an_explicit_zero_is_kept_for_validation() -> None:
    unset = submitted_spec(JobSpec("j", t_roll_s=1.0, t_train_s=2.0).to_proto())
    assert unset == {"job_id": "j", "t_roll": 1.0, "t_train": 2.0, "rollout_mem_gb": 0.0,
                     "train_mem_gb": 0.0}
    zeros = submitted_spec(pb.PlacementJobSpec(job_id="j", slo=0.0, rollout_nodes=0,
                                               train_nodes=0, t_roll_s=0.0))
    assert (zeros["slo"], zeros["rollout_nodes"], zeros["train_nodes"], zeros["t_roll"]) == \
        (0.0, 0, 0, 0.0)
    profiled = submitted_spec(JobSpec("p", profile=PROFILE, slo=1.5).to_proto())
    assert profiled["profile"] == dataclasses.asdict(PROFILE) and "t_roll" not in profiled
    single_turn = dataclasses.replace(PROFILE, turns=1)
    no_turns = pb.PlacementJobSpec(job_id="q", profile=pb.PlacementJobProfile(
        **{k: v for k, v in dataclasses.asdict(single_turn).items() if k != "turns"}))
    assert "turns" not in submitted_spec(no_turns)["profile"]  # JobProfile's default: 1 turn


def test_node_records_name_whose_turn_each_placed_node_is_and_its_holder() -> None:
    clock = Clock(START)
    ctl = control(clock, rollout=1, train=1)
    ctl.submit(spec("A", slo=4.0))
    ctl.submit(spec("B", slo=4.0))  # one group: both jobs share r1 and t1
    group = ctl.jobs["A"].group_id

    def nodes() -> dict:
        return {k: v for k, v in ctl.records().items() if k.startswith("nodes/")}

    assert nodes() == {"nodes/r1": {"pool": "rollout", "group": group, "turn": "A",
                                    "holder": None},
                       "nodes/t1": {"pool": "train", "group": group, "turn": "A",
                                    "holder": None}}
    assert ctl.acquire("A", Pool.ROLLOUT, 0) is not None
    assert nodes()["nodes/r1"]["holder"] == "A"
    ctl.release("A", Pool.ROLLOUT, 0)  # r1's turn passes to B: B's workers load its weights now
    assert nodes()["nodes/r1"] == {"pool": "rollout", "group": group, "turn": "B",
                                   "holder": None}
    assert nodes()["nodes/t1"]["turn"] == "A"
    restored = control(clock, rollout=1, train=1)  # derived records are read back as derived
    restored.restore(json.loads(json.dumps(ctl.records())))
    assert restored.records() == ctl.records()
    ctl.cancel("A")
    ctl.cancel("B")
    assert nodes() == {}  # a node no group holds has no record: its workers serve no job


def test_a_job_joining_while_its_partner_trains_rolls_out_alongside_that_training() -> None:
    clock = Clock(START)
    ctl = control(clock, rollout=1, train=1)
    ctl.submit(spec("A", slo=4.0))
    run_phase(ctl, clock, "A", Pool.ROLLOUT, 0, 10.0)
    assert ctl.acquire("A", Pool.TRAIN, 0) is not None  # A trains when B arrives
    ctl.submit(spec("B", slo=4.0))
    # r1 idles waiting for A, who is busy on t1: B's rollout takes it now. Queued behind A's
    # next rollout instead, the two would run one phase after the other for ever.
    assert ctl.acquire("B", Pool.ROLLOUT, 0) is not None
    ctl.release("A", Pool.TRAIN, 0)
    assert ctl.acquire("A", Pool.ROLLOUT, 1) is None  # B rolls out: A's turn comes next
    ctl.release("B", Pool.ROLLOUT, 0)
    assert ctl.acquire("A", Pool.ROLLOUT, 1) is not None  # the pipeline: A rolls out ...
    assert ctl.acquire("B", Pool.TRAIN, 0) is not None  # ... while B trains


def test_a_job_joining_while_its_partner_rolls_out_queues_behind_that_rollout() -> None:
    clock = Clock(START)
    ctl = control(clock, rollout=1, train=1)
    ctl.submit(spec("A", slo=4.0))
    assert ctl.acquire("A", Pool.ROLLOUT, 0) is not None
    ctl.submit(spec("B", slo=4.0))
    assert ctl.acquire("B", Pool.ROLLOUT, 0) is None
    ctl.release("A", Pool.ROLLOUT, 0)
    assert ctl.acquire("A", Pool.TRAIN, 0) is not None  # t1 stays A's: B has not rolled out
    assert ctl.acquire("B", Pool.ROLLOUT, 0) is not None


def test_a_one_node_arrival_going_first_skips_no_turn_of_two_node_jobs() -> None:
    from rlharvest.services.placement_scheduler.permits import PhaseQueues

    q = PhaseQueues()
    q.add_job("A", ["r1", "r3"], ["t1"])
    q.add_job("B", ["r1", "r3"], ["t1"])
    assert q.acquire("A", Pool.ROLLOUT, 0.0) is not None
    q.release("A", Pool.ROLLOUT, 1.0)
    assert q.acquire("A", Pool.TRAIN, 1.0) is not None
    assert q.acquire("B", Pool.ROLLOUT, 1.0) is not None
    q.release("B", Pool.ROLLOUT, 2.0)
    q.release("A", Pool.TRAIN, 2.0)
    assert q.acquire("B", Pool.TRAIN, 2.0) is not None
    assert q.acquire("A", Pool.ROLLOUT, 2.0) is not None
    q.release("A", Pool.ROLLOUT, 3.0)  # r1 and r3 wait for B, who trains
    q.add_job("C", ["r1"], ["t1"])  # r1 idles: C rolls out now, in front of B's turn
    assert q.acquire("C", Pool.ROLLOUT, 3.0) is not None
    q.release("C", Pool.ROLLOUT, 4.0)
    q.release("B", Pool.TRAIN, 4.0)
    assert q.acquire("B", Pool.ROLLOUT, 4.0) is not None  # r1's turn came back to B, not A
    restored = PhaseQueues.from_dict(q.to_dict())
    assert restored.nodes() == q.nodes()


def test_waiting_for_a_migrated_tails_nodes_is_not_counted_as_phase_time() -> None:
    clock = Clock(START)
    ctl = control(clock)
    ctl.submit(spec("A", nodes=2))
    ctl.submit(spec("B", nodes=2))  # t_roll 10 s; drift past 12.5 s is measured
    assert ctl.acquire("A", Pool.ROLLOUT, 0) is not None
    clock.advance(5)
    ctl.progress("A", 0, total=10, finished=9, unfinished_by_node={"r1": 1, "r2": 0})
    assert ctl.acquire("B", Pool.ROLLOUT, 0).pending_node_ids == ("r1",)
    clock.advance(8)  # A's tail holds r1 for 8 s more
    ctl.release("A", Pool.ROLLOUT, 0)
    assert ctl.acquire("B", Pool.ROLLOUT, 0).pending_node_ids == ()
    clock.advance(9)  # B's rollout on both nodes: 9 s, within its estimate
    outcome = ctl.release("B", Pool.ROLLOUT, 0)
    assert outcome.released and not outcome.evicted and not outcome.message, outcome
    assert ctl.scheduler.group_of("B").jobs["B"].t_roll == 10.0  # no drift was recorded


def test_a_rollout_made_whole_by_a_second_tail_shrink_is_timed_from_then() -> None:
    clock = Clock(START)
    ctl = control(clock, rollout=4)
    ctl.submit(spec("A", nodes=4))
    ctl.submit(spec("B", nodes=2))  # on r1, r2; t_roll 10 s, drift past 12.5 s is measured
    assert ctl.acquire("A", Pool.ROLLOUT, 0) is not None
    clock.advance(5)
    first = ctl.progress("A", 0, total=100, finished=90, requests_per_node=8,
                         unfinished_by_node={"r1": 5, "r2": 0, "r3": 5, "r4": 0})
    assert first is not None and first.keep_node_ids == ("r1", "r3")
    assert ctl.acquire("B", Pool.ROLLOUT, 0).pending_node_ids == ("r1",)
    clock.advance(5)  # B waits for r1 on A's tail
    second = ctl.progress("A", 0, total=100, finished=97, requests_per_node=8,
                          unfinished_by_node={"r1": 0, "r3": 3})
    assert second is not None and second.freed_node_ids == ("r1",)
    assert ctl.acquire("B", Pool.ROLLOUT, 0).pending_node_ids == ()  # whole now
    clock.advance(9)  # B's rollout on both nodes: 9 s, within its estimate (14 s from its grant)
    outcome = ctl.release("B", Pool.ROLLOUT, 0)
    assert outcome.released and not outcome.evicted and not outcome.message, outcome
    assert ctl.scheduler.group_of("B").jobs["B"].t_roll == 10.0  # no drift was recorded


def test_the_training_pool_shrinks_after_a_leave_only_between_training_phases() -> None:
    clock = Clock(START)
    ctl = control(clock, rollout=2, train=2)
    ctl.submit({**spec("A"), "train_nodes": 2})
    assert ctl.submit(spec("B")).train_node_ids == ("t1", "t2")  # DP matched to the pool
    run_phase(ctl, clock, "A", Pool.ROLLOUT, 0, 10.0)
    run_phase(ctl, clock, "B", Pool.ROLLOUT, 0, 10.0)
    assert ctl.acquire("B", Pool.TRAIN, 0) is None  # A trains first
    run_phase(ctl, clock, "A", Pool.TRAIN, 0, 5.0)
    assert ctl.acquire("B", Pool.TRAIN, 0).node_ids == ("t1", "t2")
    assert ctl.cancel("A") == []  # B is training on both nodes: the pool waits for it
    clock.advance(5.0)
    ctl.release("B", Pool.TRAIN, 0)
    assert ctl.scheduler.group_of("B").placements["B"].train_node_ids == ("t1",)
    assert ctl.scheduler.nodes_in_use(Pool.TRAIN) == 1
    run_phase(ctl, clock, "B", Pool.ROLLOUT, 1, 10.0)
    assert ctl.acquire("B", Pool.TRAIN, 1).node_ids == ("t1",)
    assert "t2" not in ctl.scheduler.taken  # free for the next group


@pytest.mark.parametrize("slots", [1, 4])
def test_a_single_node_rollouts_tail_frees_gpu_slots_for_the_next_job(slots) -> None:
    """WEAVE §4.3 at GPU granularity: with four slots per rollout node a one-node rollout
    that is tail-bound keeps the slot its open request is on, and the job packed on the same
    node starts its rollout on the other three at once (the fourth follows when the tail ends).
    At whole-node granularity the one node cannot shrink: no migration."""
    clock = Clock(START)
    ctl = PlacementControl({Pool.ROLLOUT: ["r1"], Pool.TRAIN: ["t1"]},
                           dataclasses.replace(H20, max_nodes=1),
                           dataclasses.replace(H800, max_nodes=1), rollout_slots=slots,
                           clock=clock)
    ctl.submit(spec("A"))
    ctl.submit(spec("B"))  # packed onto r1: it rolls out while A trains, and after A's rollout
    permit = ctl.acquire("A", Pool.ROLLOUT, 0)
    units = ctl.units(Pool.ROLLOUT, ["r1"])
    assert permit.node_ids == units == (("r1",) if slots == 1 else
                                        ("r1.gpu0", "r1.gpu1", "r1.gpu2", "r1.gpu3"))
    assert ctl.acquire("B", Pool.ROLLOUT, 0) is None  # A's turn on every slot
    open_on = {unit: int(unit == units[-1]) for unit in units}  # one request left, on one slot
    plan = ctl.progress("A", 0, total=8, finished=7, unfinished_by_node=open_on)
    if slots == 1:
        assert plan is None and ctl.acquire("B", Pool.ROLLOUT, 0) is None
        return
    assert plan.keep_node_ids == (units[-1],) and set(plan.freed_node_ids) == set(units[:-1])
    started = ctl.acquire("B", Pool.ROLLOUT, 0)
    assert set(started.node_ids) == set(units[:-1]) and started.pending_node_ids == (units[-1],)
    # B itself waits for A's tail slot: no migration of B's rollout until it holds every slot.
    assert ctl.progress("B", 0, 8, 7, {unit: int(unit == units[0]) for unit in units}) is None
    clock.advance(4.0)
    ctl.release("A", Pool.ROLLOUT, 0)  # the tail ends: its slot passes to B
    assert set(next(p for p in ctl.queues["group-1"].running() if p.job_id == "B").node_ids) \
        == set(units)
    assert ctl.stats.bubble_node_seconds == pytest.approx(4.0 * 3 / 4)  # 3 slots of 4, 4 s
    # Whole now, B's report must name every slot it holds, the one handed over included.
    with pytest.raises(Refusal, match="report every held node"):
        ctl.progress("B", 0, 8, 7, {unit: int(unit == units[0]) for unit in units[:-1]})
    assert ctl.progress("B", 0, 8, 7, {unit: int(unit == units[0]) for unit in units}) \
        .keep_node_ids == (units[0],)
    assert ctl.pool_usage()[Pool.ROLLOUT] == (1, 1, 1)
    records = json.loads(json.dumps(ctl.records()))  # through etcd's JSON
    assert "nodes/r1.gpu0" in records  # each slot's worker follows its own record
    again = PlacementControl({Pool.ROLLOUT: ["r1"], Pool.TRAIN: ["t1"]}, H20, H800,
                             rollout_slots=4, clock=clock)
    again.restore(records)
    assert again.queues["group-1"].holders() == ctl.queues["group-1"].holders()
    with pytest.raises(PlacementError, match="rollout-slots"):
        PlacementControl({Pool.ROLLOUT: ["r1"], Pool.TRAIN: ["t1"]}, H20, H800,
                         clock=clock).restore(records)


def test_a_training_phase_is_judged_for_drift_at_the_dp_degree_it_ran_at() -> None:
    """B trains at DP 2 (5 s of its 10 s estimate) while A, which needed both training nodes,
    leaves. The pool shrinks only after B's phase, which is judged against its DP-2 estimate:
    12 s is drift (2.4x), recorded as 24 s at B's own one node."""
    clock = Clock(START)
    ctl = control(clock, rollout=2, train=2)
    ctl.submit({**spec("A"), "train_nodes": 2})
    ctl.submit(spec("B", slo=5.0))
    run_phase(ctl, clock, "A", Pool.ROLLOUT, 0, 10.0)
    run_phase(ctl, clock, "B", Pool.ROLLOUT, 0, 10.0)
    run_phase(ctl, clock, "A", Pool.TRAIN, 0, 5.0)
    assert ctl.acquire("B", Pool.TRAIN, 0) is not None
    ctl.cancel("A")
    clock.advance(12.0)
    outcome = ctl.release("B", Pool.TRAIN, 0)
    assert "estimate of 5s" in outcome.message, outcome
    group = ctl.scheduler.group_of("B")
    assert group.jobs["B"].t_train == pytest.approx(24.0) and len(group.train_nodes) == 1


def test_a_submission_says_whether_its_training_state_is_sharded() -> None:
    replicated = JobSpec("j", t_roll_s=10, t_train_s=10, train_state_sharded=False)
    assert submitted_spec(replicated.to_proto())["train_state_sharded"] is False
    assert "train_state_sharded" not in submitted_spec(JobSpec("k", 10, 10).to_proto())


def test_jobs_submitted_together_are_admitted_in_batch_order_and_answered_in_their_own() -> None:
    from rlharvest.sim import workloads

    rollout, train = workloads.pools(5, H20, H800)
    names = {pool: [f"{pool.value}-{i}" for i in range(1, 31)] for pool in Pool}

    def fresh() -> PlacementControl:
        return PlacementControl(names, dataclasses.replace(rollout, max_nodes=30),
                                dataclasses.replace(train, max_nodes=30), clock=Clock(START))

    jobs = [dataclasses.asdict(j) for j in workloads.static_jobs(9, "balanced", 3)]
    ctl = fresh()
    subs = [Submission(j, start_iteration=2) for j in jobs]
    outcomes = ctl.submit_batch(subs[:4] + [Submission(spec("bad id!")), Submission(jobs[0])]
                                + subs[4:])
    kinds = [o.kind if isinstance(o, Refusal) else "admitted" for o in outcomes]
    assert kinds == ["admitted"] * 4 + ["invalid", "exists"] + ["admitted"] * 5
    assert set(ctl.jobs) == {j["job_id"] for j in jobs}
    one_by_one = fresh()
    for j in jobs:
        one_by_one.submit(j)
    assert ctl.scheduler.cost_per_hour() < 0.8 * one_by_one.scheduler.cost_per_hour()
    first = jobs[0]["job_id"]  # every admitted job has its queues, from its start iteration
    assert ctl.acquire(first, Pool.ROLLOUT, 2) is not None or \
        ctl.queues[ctl.jobs[first].group_id].next_phase(first)[1] == 2


def test_a_group_thinned_by_a_departure_is_repacked_once_no_member_holds_a_permit() -> None:
    clock = Clock(START)
    names = {Pool.ROLLOUT: ["r1", "r2"], Pool.TRAIN: ["t1", "t2"]}
    ctl = PlacementControl(names, dataclasses.replace(H20, max_nodes=2),
                           dataclasses.replace(H800, max_nodes=2), clock=clock, consolidate=True)
    for job_id in "ABCD":  # A|B fill one group, C|D the other
        ctl.submit(spec(job_id))
    assert ctl.jobs["A"].group_id != ctl.jobs["C"].group_id
    run_phase(ctl, clock, "A", Pool.ROLLOUT, 0, 5.0)
    ctl.cancel("B")  # A alone: nothing cheaper (C|D is full), A stays
    assert ctl.stats.consolidation_moves == 0
    assert ctl.acquire("C", Pool.ROLLOUT, 0) is not None
    ctl.cancel("D")  # C alone, but C rolls out now: it moves only once its permit is back
    assert ctl.stats.consolidation_moves == 0 and ctl.jobs["C"].group_id != ctl.jobs["A"].group_id
    clock.advance(5.0)
    ctl.release("C", Pool.ROLLOUT, 0)
    assert ctl.stats.consolidation_moves == 1
    assert ctl.jobs["C"].group_id == ctl.jobs["A"].group_id
    assert len(ctl.scheduler.groups) == 1 and len(ctl.queues) == 1
    # C goes on where it stood (its training of iteration 0), on the group's nodes.
    assert ctl.queues[ctl.jobs["C"].group_id].next_phase("C")[:2] == (Pool.TRAIN, 0)
    run_phase(ctl, clock, "A", Pool.TRAIN, 0, 5.0)
    permit = ctl.acquire("C", Pool.TRAIN, 0)
    assert permit is not None and set(permit.node_ids) <= set(ctl.scheduler.taken)
    clock.advance(5.0)
    ctl.release("C", Pool.TRAIN, 0)
    for job_id, phase in (("A", Pool.ROLLOUT), ("C", Pool.ROLLOUT), ("A", Pool.TRAIN),
                          ("C", Pool.TRAIN)):  # the two take turns from now on
        run_phase(ctl, clock, job_id, phase, 1, 5.0)
    restored = PlacementControl(names, dataclasses.replace(H20, max_nodes=2),
                                dataclasses.replace(H800, max_nodes=2), clock=Clock(START),
                                consolidate=True)  # the moved state persists and restores
    restored.restore(json.loads(json.dumps(ctl.records())))
    assert restored.jobs["C"].group_id == ctl.jobs["C"].group_id
    assert restored.stats.consolidation_moves == 1


def test_without_consolidate_a_thinned_group_keeps_its_nodes() -> None:
    clock = Clock(START)
    ctl = control(clock, rollout=2, train=2)
    for job_id in "ABCD":
        ctl.submit(spec(job_id))
    ctl.cancel("B")
    ctl.cancel("D")
    assert len(ctl.scheduler.groups) == 2 and ctl.stats.consolidation_moves == 0
