"""Inter-group scheduling: WEAVE Algorithm 1 on hand-built cases (§4.2)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from rlharvest.services.placement_scheduler.inter_group import (
    Decision, InterGroupScheduler, Objective, Strategy)
from rlharvest.services.placement_scheduler.model import (
    H20, H800, Job, JobProfile, Placement, PlacementError, Pool, PoolSpec)
from rlharvest.services.placement_scheduler.round_robin import (
    Member, co_execution_periods, members_of, t_cycle, t_load)

ROLL = PoolSpec(Pool.ROLLOUT, "H20", 8, 1.85, 1000.0)
TRAIN = PoolSpec(Pool.TRAIN, "H800", 8, 5.28, 1000.0)


def job(job_id: str, t_roll: float, t_train: float, slo: float = 2.0, mem: float = 100.0,
        nodes: int = 1) -> Job:
    return Job(job_id, t_roll, t_train, slo, nodes, nodes, mem, mem)


@pytest.fixture
def scheduler() -> InterGroupScheduler:
    return InterGroupScheduler(ROLL, TRAIN)


def test_first_job_gets_an_isolated_group_at_full_cost(scheduler) -> None:
    decision = scheduler.submit(job("A", 100, 100))
    assert decision.strategy is Strategy.ISOLATED
    assert decision.marginal_cost_per_hour == pytest.approx(8 * 1.85 + 8 * 5.28)
    assert scheduler.cost_per_hour() == pytest.approx(decision.marginal_cost_per_hour)


def test_complementary_job_is_packed_into_the_bubble_for_free(scheduler) -> None:
    scheduler.submit(job("A", 100, 100))
    decision = scheduler.submit(job("B", 100, 100))
    assert decision.strategy is Strategy.DIRECT_PACKING and decision.marginal_cost_per_hour == 0
    assert decision.periods == {"A": 200.0, "B": 200.0}
    assert len(scheduler.groups) == 1


def test_saturated_group_is_pruned(scheduler) -> None:
    scheduler.submit(job("A", 100, 100))
    scheduler.submit(job("B", 100, 100))  # T_load = 200 = T_cycle: saturated
    assert scheduler.groups["group-1"].saturated
    assert scheduler.submit(job("C", 10, 10, slo=100.0)).strategy is Strategy.ISOLATED


def test_rollout_heavy_arrival_scales_the_rollout_pool_instead_of_a_new_group(scheduler) -> None:
    scheduler.submit(job("A", 300, 100))
    decision = scheduler.submit(job("B", 250, 50, slo=1.5))  # would overload the shared node
    assert decision.strategy is Strategy.ROLLOUT_SCALING
    assert decision.new_rollout_nodes == 1 and decision.rollout_node_ids == ()
    assert decision.marginal_cost_per_hour == pytest.approx(8 * 1.85)
    group = scheduler.group_of("B")
    assert len(group.rollout_nodes) == 2 and len(group.train_nodes) == 1


def test_placement_breaking_memory_residency_is_rejected(scheduler) -> None:
    scheduler.submit(job("A", 100, 100, mem=600))
    decision = scheduler.submit(job("B", 100, 100, mem=600))  # 1200 GB > 1000 GB per node
    assert decision.strategy is Strategy.ISOLATED


def test_placement_breaking_an_existing_members_slo_is_rejected(scheduler) -> None:
    scheduler.submit(job("A", 100, 100, slo=1.0))
    # B alone fits A's bubbles, but its long solo time would stretch A's cycle past A's SLO.
    decision = scheduler.submit(job("B", 50, 200, slo=2.0))
    assert decision.strategy is Strategy.ISOLATED


def test_placement_breaking_the_new_jobs_own_slo_is_rejected(scheduler) -> None:
    scheduler.submit(job("A", 300, 300, slo=2.0))
    decision = scheduler.submit(job("B", 50, 50, slo=1.5))  # would iterate every 600 s, not 150
    assert decision.strategy is Strategy.ISOLATED


def test_minimum_marginal_cost_wins_over_an_earlier_costlier_option(scheduler) -> None:
    scheduler.submit(job("A", 300, 100, slo=1.0))
    scheduler.submit(job("X", 100, 100, slo=1.5))  # A's 400 s cycle is too slow for X: group-2
    arrival = job("B", 150, 100, slo=1.6)
    # group-1 (scanned first) takes B only by adding a rollout node; group-2 takes it for free.
    decision = scheduler.schedule(arrival)
    assert decision.strategy is Strategy.DIRECT_PACKING and decision.group_id == "group-2"
    alone = InterGroupScheduler(ROLL, TRAIN)
    alone.submit(job("A", 300, 100, slo=1.0))
    assert alone.schedule(arrival).strategy is Strategy.ROLLOUT_SCALING


def test_job_failure_keeps_the_group_running_and_resubmission_is_a_new_arrival(scheduler) -> None:
    scheduler.submit(job("A", 100, 100))
    scheduler.submit(job("B", 100, 100))
    cost = scheduler.cost_per_hour()
    assert scheduler.leave("B") == []  # A keeps the group's nodes
    assert scheduler.cost_per_hour() == cost and list(scheduler.group_of("A").jobs) == ["A"]
    again = scheduler.submit(job("B", 100, 100))
    assert again.strategy is Strategy.DIRECT_PACKING and again.group_id == "group-1"
    assert sorted(scheduler.leave("A") + scheduler.leave("B")) == ["rollout-1", "train-1"]
    assert scheduler.cost_per_hour() == 0


def test_drift_past_saturation_asks_for_resubmission_of_that_job_only(scheduler) -> None:
    scheduler.submit(job("A", 100, 100))
    scheduler.submit(job("B", 80, 80, slo=1.5))
    assert scheduler.observe_drift("B", 90, 90) is False
    assert scheduler.observe_drift("B", 160, 40) is True  # roll node now carries 260 s > 200 s
    scheduler.leave("B")
    assert list(scheduler.group_of("A").jobs) == ["A"]  # A is never moved
    again = scheduler.submit(job("B", 160, 40, slo=1.2))  # budget 240 s < 260 s on A's node
    assert "rollout-1" not in again.rollout_node_ids
    assert again.periods["A"] <= 400 and again.periods["B"] <= 240


def test_stale_decision_is_refused(scheduler) -> None:
    scheduler.submit(job("A", 100, 100))
    decision = scheduler.schedule(job("B", 50, 50))
    scheduler.submit(job("C", 40, 40, slo=5.0))  # joins group-1 first
    with pytest.raises(PlacementError, match="stale"):
        scheduler.admit(decision)


def test_state_survives_a_restart_through_a_plain_dict(scheduler) -> None:
    for name, r, t in (("A", 300, 100), ("B", 250, 50), ("C", 100, 100)):
        scheduler.submit(job(name, r, t, slo=1.5))
    restored = InterGroupScheduler(ROLL, TRAIN)
    restored.restore(scheduler.to_dict())
    assert restored.to_dict() == scheduler.to_dict()
    probe = job("D", 60, 60)
    assert restored.schedule(probe).group_id == scheduler.schedule(probe).group_id


@pytest.mark.parametrize("kwargs, message", [
    (dict(t_roll=-1.0), "t_roll must be a finite number >= 0"),
    (dict(t_train=float("nan")), "t_train must be a finite number >= 0"),
    (dict(slo=0.9), "slo must be >= 1"),
    (dict(rollout_nodes=0), "rollout_nodes must be an integer >= 1"),
    (dict(t_roll=0.0, t_train=0.0), "zero-length phases"),
])
def test_bad_submissions_get_precise_errors(kwargs, message) -> None:
    fields = dict(job_id="bad", t_roll=10.0, t_train=10.0, slo=1.2) | kwargs
    with pytest.raises(PlacementError, match=message):
        Job(**fields)


def test_job_larger_than_any_pool_or_node_is_refused() -> None:
    small = InterGroupScheduler(PoolSpec(Pool.ROLLOUT, "H20", 8, 1.85, 1000.0, max_nodes=2), TRAIN)
    with pytest.raises(PlacementError, match="needs 3 rollout nodes but the H20 pool has only 2"):
        small.schedule(job("big", 10, 10, nodes=3))
    with pytest.raises(PlacementError, match="can never be resident"):
        small.schedule(job("fat", 10, 10, mem=5000))


def test_placement_on_unknown_nodes_is_refused(scheduler) -> None:
    scheduler.submit(job("A", 100, 100))
    group = scheduler.group_of("A")
    with pytest.raises(PlacementError, match=r"nodes \['rollout-9'\] are not in group"):
        group.add(job("B", 10, 10), Placement("B", ("rollout-9",), ("train-1",)))


def test_profile_estimate_assumes_every_response_hits_the_token_limit() -> None:
    profile = JobProfile(batch_size=256, prompt_tokens=512, max_response_tokens=8192,
                         decode_s_per_token=0.02, prefill_s=4.0, train_tokens_per_s=50_000.0,
                         turns=2, env_s_per_turn=3.0, sync_s=10.0)
    submitted = Job.from_profile("p", profile, slo=1.5)
    assert submitted.t_roll == pytest.approx(2 * (4.0 + 8192 * 0.02 + 3.0))
    assert submitted.t_train == pytest.approx(256 * (512 + 2 * 8192) / 50_000 + 10.0)
    longer = JobProfile(**{**profile.__dict__, "max_response_tokens": 16384})
    assert Job.from_profile("q", longer).t_solo > submitted.t_solo
    with pytest.raises(PlacementError, match="train_tokens_per_s must be > 0"):
        JobProfile(**{**profile.__dict__, "train_tokens_per_s": 0.0})


def test_table1_costs_make_training_nodes_the_expensive_ones() -> None:
    assert H800.node_cost_per_hour / H20.node_cost_per_hour == pytest.approx(5.28 / 1.85)


def test_a_decision_breaking_residency_is_refused_and_leaves_no_nodes_behind(scheduler) -> None:
    scheduler.submit(job("A", 100, 100, mem=600))
    arrival = job("B", 100, 100, mem=600)
    version = scheduler.groups["group-1"].version
    for shared, fresh in ((("rollout-1",), 0), ((), 1)):  # 1200 GB > 1000 GB on both nodes sets
        forced = Decision(arrival, Strategy.DIRECT_PACKING, "group-1", version, shared, fresh, 0,
                          0.0)
        with pytest.raises(PlacementError, match="host memory"):
            scheduler.admit(forced)
    assert scheduler.nodes_in_use(Pool.ROLLOUT) == 1 and len(scheduler.groups) == 1


def test_slo_rejection_that_only_the_round_robin_simulation_sees(scheduler) -> None:
    # A on rollout-1; B cannot share it within its 312.5 s budget, so it scales onto rollout-2.
    scheduler.submit(job("A", 200, 100, slo=1.25))
    assert scheduler.submit(job("B", 200, 50, slo=1.25)).strategy is Strategy.ROLLOUT_SCALING
    gang = Job("C", 100, 100, 2.0, rollout_nodes=2, train_nodes=1)
    group = scheduler.groups["group-1"]
    members = [*members_of(group), Member("C", 100, 100, ("rollout-1", "rollout-2"))]
    # Packing C across both nodes passes every bound (T_cycle = T_load = 300 s <= 312.5 s) ...
    assert max(t_cycle(members), t_load(members)) == 300
    # ... but C's gang rollout must wait for its turn on both nodes at once, which idles one
    # while the other finishes: the simulated meta-iteration is 950/3 s, past B's budget.
    assert co_execution_periods(members)["B"] == pytest.approx(950 / 3)
    decision = scheduler.schedule(gang)
    assert decision.strategy is Strategy.ROLLOUT_SCALING and decision.group_id == "group-1"
    assert all(period <= 312.5 for period in decision.periods.values())


def test_rollout_memory_forces_rollout_scaling_while_training_memory_fits(scheduler) -> None:
    # Rollout working sets of 600 GB: two cannot share a 1000 GB rollout node, while their
    # 100 GB training working sets share the training node easily. Timing alone would pack.
    scheduler.submit(Job("A", 100, 100, 2.0, 1, 1, rollout_mem_gb=600, train_mem_gb=100))
    decision = scheduler.submit(Job("B", 100, 40, 2.0, 1, 1, rollout_mem_gb=600,
                                    train_mem_gb=100))
    assert decision.strategy is Strategy.ROLLOUT_SCALING and decision.group_id == "group-1"
    group = scheduler.group_of("B")
    assert group.placements["B"].rollout_node_ids == ("rollout-2",)
    assert group.roll_mem_gb == {"rollout-1": 600, "rollout-2": 600}
    # A third heavy job fits next to neither and scales again; a light one packs onto a node.
    heavy = scheduler.schedule(Job("C", 50, 30, 3.0, 1, 1, 600, 100))
    assert heavy.strategy is Strategy.ROLLOUT_SCALING and heavy.rollout_node_ids == ()
    light = scheduler.schedule(Job("D", 50, 30, 3.0, 1, 1, 400, 100))
    assert light.strategy is Strategy.DIRECT_PACKING and light.group_id == "group-1"


@pytest.mark.parametrize("pool, extra_gb, strategy", [
    ("rollout", 0.0, Strategy.DIRECT_PACKING),  # 500 + 500 = 1000 GB: exactly full is fine
    ("rollout", 1.0, Strategy.ROLLOUT_SCALING),
    ("train", 0.0, Strategy.DIRECT_PACKING),
    ("train", 1.0, Strategy.ISOLATED),  # training nodes are not scaled: a new group
])
def test_memory_residency_accepts_an_exact_fit(scheduler, pool, extra_gb, strategy) -> None:
    # §4.2: the pinned working sets "must not exceed" a node's host memory (model.fits_in_memory
    # says why we accept equality where Algorithm 1 line 8 writes >=).
    mem = {"rollout_mem_gb": 100.0, "train_mem_gb": 100.0}
    scheduler.submit(Job("A", 100, 100, 2.0, 1, 1, **{**mem, f"{pool}_mem_gb": 500.0}))
    arrival = Job("B", 100, 100, 2.0, 1, 1, **{**mem, f"{pool}_mem_gb": 500.0 + extra_gb})
    assert scheduler.submit(arrival).strategy is strategy


def test_a_group_saturated_on_a_rollout_node_still_takes_rollout_scaling(scheduler) -> None:
    scheduler.submit(job("A", 10, 2))
    scheduler.submit(job("B", 10, 2))  # packed on A's rollout node: its load 20 > T_cycle 12
    group = scheduler.groups["group-1"]
    assert group.saturated and group.train_load_s < group.t_cycle
    # Packing C on the full node breaks SLOs; a rollout node of its own does not, and costs one
    # rollout node instead of a new group's rollout and training nodes.
    decision = scheduler.submit(job("C", 10, 2, slo=3.0))
    assert decision.strategy is Strategy.ROLLOUT_SCALING and decision.group_id == "group-1"
    assert decision.marginal_cost_per_hour == pytest.approx(8 * 1.85)


def test_drift_in_a_group_admitted_overloaded_evicts_only_when_an_slo_breaks(scheduler) -> None:
    scheduler.submit(job("A", 10, 2))
    scheduler.submit(job("B", 10, 2))  # admitted with T_load 20 > T_cycle 12, within SLOs
    group = scheduler.groups["group-1"]
    assert group.t_load > group.t_cycle
    assert scheduler.observe_drift("A", 10.5, 2) is False  # still overloaded, every SLO holds
    assert scheduler.observe_drift("B", 30, 2) is True  # A's iteration now breaks its SLO


# --- data-parallel scaling (§4.2 fn 3) and the training pool's shrink ---------------------------
def dp_job(job_id: str, t_train: float, train_nodes: int, train_mem: float = 600.0,
           slo: float = 2.0, sharded: bool = True) -> Job:
    return Job(job_id, 100.0, t_train, slo, rollout_nodes=1, train_nodes=train_nodes,
               rollout_mem_gb=100.0, train_mem_gb=train_mem, train_state_sharded=sharded)


def test_a_member_of_a_larger_training_pool_trains_and_stores_at_the_pools_dp_degree(
        scheduler) -> None:
    scheduler.submit(dp_job("A", 100, train_nodes=2))  # a 2-node training pool
    decision = scheduler.submit(dp_job("B", 160, train_nodes=1))
    # At DP 2 B's 600 GB of sharded state is 300 GB a node (900 <= 1000) and it trains 80 s,
    # not 160: it packs. Unscaled it would need 1200 GB a node and a group of its own.
    assert decision.strategy is Strategy.DIRECT_PACKING
    group = scheduler.group_of("B")
    assert group.train_mem_gb == pytest.approx(900) and group.train_load_s == pytest.approx(180)
    assert group.running(group.jobs["B"]).t_train == pytest.approx(80)
    assert group.jobs["B"].t_train == 160  # the submitted estimate is kept
    assert decision.periods == {"A": pytest.approx(200), "B": pytest.approx(200)}


def test_replicated_training_state_does_not_shrink_with_the_dp_degree(scheduler) -> None:
    scheduler.submit(dp_job("A", 100, train_nodes=2))
    decision = scheduler.submit(dp_job("B", 160, train_nodes=1, sharded=False))
    assert decision.strategy is Strategy.ISOLATED  # 600 GB on every node: 1200 > 1000


def test_the_training_pool_shrinks_when_the_member_that_needed_it_leaves(scheduler) -> None:
    scheduler.submit(dp_job("A", 100, train_nodes=2))
    scheduler.submit(dp_job("B", 160, train_nodes=1))
    released = scheduler.leave("A")
    group = scheduler.group_of("B")
    assert released == ["train-2"] and list(group.train_nodes) == ["train-1"]
    assert scheduler.nodes_in_use(Pool.TRAIN) == 1
    assert group.train_load_s == pytest.approx(160) and group.train_mem_gb == pytest.approx(600)
    assert group.placements["B"].train_node_ids == ("train-1",)
    assert scheduler.cost_per_hour() == pytest.approx(8 * 1.85 + 8 * 5.28)


def test_the_training_pool_keeps_nodes_whose_loss_would_break_an_slo(scheduler) -> None:
    scheduler.submit(dp_job("A", 60, train_nodes=2, train_mem=100))
    scheduler.submit(dp_job("B", 120, train_nodes=1, train_mem=100, slo=3.0))
    assert scheduler.submit(dp_job("C", 100, train_nodes=1, train_mem=100, slo=1.05)).strategy \
        is Strategy.ROLLOUT_SCALING
    group = scheduler.group_of("C")
    assert len(group.train_nodes) == 2
    # At DP 1 B and C would train 120 + 100 s a meta-iteration: over C's 1.05 x 200 s budget.
    assert scheduler.leave("A") == []
    assert len(group.train_nodes) == 2 and scheduler.nodes_in_use(Pool.TRAIN) == 2
    assert group.running(group.jobs["C"]).t_train == pytest.approx(50)
    assert scheduler.shrink_train_pool(group.group_id) == []  # asked again: still kept
    assert scheduler.leave("B") == ["rollout-1", "train-2"]  # C alone fits one node at last
    assert len(group.train_nodes) == 1


def test_a_drift_report_is_read_at_the_groups_dp_degree(scheduler) -> None:
    scheduler.submit(dp_job("A", 100, train_nodes=2))
    scheduler.submit(dp_job("B", 160, train_nodes=1))
    assert not scheduler.observe_drift("B", 100, 80)  # B trains 80 s at DP 2: on its estimate
    assert scheduler.group_of("B").jobs["B"].t_train == pytest.approx(160)


def test_at_dp_refuses_a_pool_smaller_than_the_jobs_minimum() -> None:
    with pytest.raises(PlacementError, match="needs 2 training nodes"):
        dp_job("A", 100, train_nodes=2).at_dp(1)


# --- the cost-per-work objective ---------------------------------------------------------------
def test_cost_per_work_gives_a_job_its_own_group_where_free_packing_slows_the_cluster() -> None:
    """A loose SLO lets Algorithm 1 pack a train-heavy job for Δ = 0 behind a train-heavy
    partner: both then iterate every 760 s instead of 400, and the group gains 5% of work for
    its second job. Where the cluster already pays more per unit of work than a one-node group
    does (here a two-node job), a group of its own lowers the cluster's $ per unit of work."""
    marginal = InterGroupScheduler(ROLL, TRAIN)
    per_work = InterGroupScheduler(ROLL, TRAIN, objective=Objective.COST_PER_WORK)
    for scheduler in (marginal, per_work):
        scheduler.submit(Job("X", 100, 100, 1.0, 2, 2, 100.0, 100.0))  # $2c per unit of work
        assert scheduler.submit(job("A", 20, 380, slo=2.5)).strategy is Strategy.ISOLATED
    assert marginal.submit(job("B", 20, 380, slo=2.5)).strategy is Strategy.DIRECT_PACKING
    assert marginal.work_rate() == pytest.approx(1 + 800 / 760)
    assert per_work.submit(job("B", 20, 380, slo=2.5)).strategy is Strategy.ISOLATED
    assert per_work.work_rate() == pytest.approx(3.0)
    assert per_work.cost_per_hour() / per_work.work_rate() < \
        marginal.cost_per_hour() / marginal.work_rate()


def test_cost_per_work_still_packs_into_a_real_bubble() -> None:
    scheduler = InterGroupScheduler(ROLL, TRAIN, objective=Objective.COST_PER_WORK)
    scheduler.submit(job("A", 100, 100))
    decision = scheduler.submit(job("B", 100, 100))  # fills A's bubble at full speed
    assert decision.strategy is Strategy.DIRECT_PACKING and scheduler.work_rate() == \
        pytest.approx(2.0)


# --- jobs that arrive together (beyond the paper: batch_order) --------------------------------

def _cost_in_order(jobs: list[Job]) -> tuple[float, list[str]]:
    """$/h after admitting ``jobs`` in this order into a fresh scheduler, and the jobs whose
    SLO the resulting groups break."""
    scheduler = InterGroupScheduler(ROLL, TRAIN)
    for j in jobs:
        scheduler.submit(j)
    broken = [job_id for g in scheduler.groups.values()
              for job_id, period in co_execution_periods(members_of(g)).items()
              if period > g.jobs[job_id].slo * g.jobs[job_id].t_solo + 1e-9]
    return scheduler.cost_per_hour(), broken


def test_a_static_batch_admitted_in_batch_order_is_cheaper_than_in_arrival_order() -> None:
    from rlharvest.sim import workloads

    pools = workloads.pools(5, H20, H800)
    for seed in (1, 3):  # batches where arrival order leaves Algorithm 1 well above optimum
        jobs = workloads.static_jobs(9, "balanced", seed)
        arrival = InterGroupScheduler(*pools)
        for j in jobs:
            arrival.submit(j)
        batched = InterGroupScheduler(*pools)
        for j in batched.batch_order(jobs):
            batched.submit(j)
        assert batched.cost_per_hour() < arrival.cost_per_hour() * 0.9, seed
        assert len(batched._job_group) == len(jobs)


def test_batch_order_tries_orders_on_copies_and_leaves_the_scheduler_as_it_was(scheduler) -> None:
    scheduler.submit(job("A", 100, 100))
    before = scheduler.to_dict()
    order = scheduler.batch_order([job("B", 10, 10, slo=1.2), job("C", 100, 90)])
    assert scheduler.to_dict() == before
    assert [j.job_id for j in order] == ["C", "B"]  # the larger first: it packs into A's bubble


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(10, 300), st.integers(10, 300),
                          st.sampled_from([1.0, 1.2, 1.5, 2.0])), min_size=2, max_size=6))
def test_batch_order_never_costs_more_than_arrival_order_and_breaks_no_slo(drawn) -> None:
    jobs = [job(f"J{i}", r, t, slo) for i, (r, t, slo) in enumerate(drawn)]
    ordered = InterGroupScheduler(ROLL, TRAIN).batch_order(jobs)
    assert sorted(j.job_id for j in ordered) == sorted(j.job_id for j in jobs)
    cost, broken = _cost_in_order(ordered)
    assert cost <= _cost_in_order(jobs)[0] + 1e-9
    assert broken == []


# --- consolidation at departures (beyond the paper) -------------------------------------------

def _two_thinned_groups() -> InterGroupScheduler:
    """A|B in one group, C|D in another (each pair saturates its group); B and D leave."""
    scheduler = InterGroupScheduler(ROLL, TRAIN)
    for name in "ABCD":
        scheduler.submit(job(name, 100, 100))
    assert len(scheduler.groups) == 2
    scheduler.leave("B")
    scheduler.leave("D")
    return scheduler


def test_a_group_thinned_by_departures_is_repacked_into_another_when_cheaper() -> None:
    scheduler = _two_thinned_groups()
    before = scheduler.cost_per_hour()
    home = scheduler.group_of("A").group_id
    moved = scheduler.consolidate(scheduler.group_of("C").group_id)
    assert list(moved) == ["C"] and scheduler.group_of("C").group_id == home
    assert moved["C"].train_node_ids == tuple(scheduler.groups[home].train_nodes)
    assert len(scheduler.groups) == 1 and scheduler.cost_per_hour() < before
    periods = co_execution_periods(members_of(scheduler.groups[home]))
    assert all(periods[j] <= 2.0 * 200 for j in "AC")


def test_consolidation_moves_nothing_when_repacking_is_no_cheaper(scheduler) -> None:
    scheduler.submit(job("A", 100, 100))
    scheduler.submit(job("B", 100, 100))
    scheduler.submit(job("C", 100, 100))  # alone: A|B's group is saturated
    before = scheduler.to_dict()
    assert scheduler.consolidate(scheduler.group_of("C").group_id) == {}
    assert scheduler.to_dict() == before


def _drawn_jobs(max_size: int) -> st.SearchStrategy[list[tuple[int, int, float]]]:
    """(t_roll, t_train, slo) of 3 to ``max_size`` jobs."""
    return st.lists(st.tuples(st.integers(10, 300), st.integers(10, 300),
                              st.sampled_from([1.2, 1.5, 2.0])), min_size=3, max_size=max_size)


@settings(max_examples=60, deadline=None)
@given(_drawn_jobs(8), st.lists(st.integers(0, 7), max_size=5))
def test_consolidating_after_every_departure_breaks_no_slo_and_never_raises_cost(
        drawn, leaving) -> None:
    scheduler = InterGroupScheduler(ROLL, TRAIN)
    for i, (r, t, slo) in enumerate(drawn):
        scheduler.submit(job(f"J{i}", r, t, slo))
    for index in dict.fromkeys(i for i in leaving if i < len(drawn)):
        group_id = scheduler.group_of(f"J{index}").group_id
        scheduler.leave(f"J{index}")
        if group_id in scheduler.groups:
            before = scheduler.cost_per_hour()
            scheduler.consolidate(group_id)
            assert scheduler.cost_per_hour() <= before + 1e-9
    for group in scheduler.groups.values():
        for job_id, period in co_execution_periods(members_of(group)).items():
            assert period <= group.jobs[job_id].slo * group.jobs[job_id].t_solo + 1e-6


@settings(max_examples=60, deadline=None)
@given(_drawn_jobs(9), st.lists(st.integers(0, 8), max_size=4))
def test_a_trial_that_is_undone_leaves_a_scheduler_that_behaves_as_if_never_tried(
        drawn, leaving) -> None:
    """batch_order and a declined consolidate try changes on the scheduler itself and put it
    back (copying only the groups they touch): afterwards it must decide exactly as an
    untouched copy does, serials, caches and node counts included."""
    import copy

    jobs = [job(f"J{i}", r, t, slo) for i, (r, t, slo) in enumerate(drawn)]
    tried = InterGroupScheduler(ROLL, TRAIN)
    for j in jobs[:-2]:
        tried.submit(j)
    for index in dict.fromkeys(i for i in leaving if i < len(jobs) - 2):
        tried.leave(f"J{index}")
    untouched = copy.deepcopy(tried)
    tried.batch_order(jobs[-2:])
    for group_id in list(tried.groups):
        if group_id not in tried.groups:  # dissolved by an earlier consolidation
            continue
        before = tried.cost_per_hour()
        if not tried.consolidate(group_id):
            assert tried.cost_per_hour() == before
            untouched_moves = copy.deepcopy(untouched).consolidate(group_id)
            assert not untouched_moves
        else:
            untouched.consolidate(group_id)
    assert tried.to_dict() == untouched.to_dict()
    for j in jobs[-2:]:  # the same arrivals decide the same
        assert tried.submit(j) == untouched.submit(j)
        assert tried.to_dict() == untouched.to_dict()
