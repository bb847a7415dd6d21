"""A job's manager split into shards: a worker's shard is a stable rule of its id, a step splits
across the shards by capacity, queued requests move to a shard whose workers went idle, and a
shard gives up only requests that never reached one of its workers (Withdraw), so none runs
twice."""

from __future__ import annotations

from collections import Counter

import pytest
from pydantic import ValidationError

from rlharvest.common import keys
from rlharvest.common.pb import rollout_manager_pb2 as mpb
from rlharvest.services.rollout_manager.config import ManagerConfig
from rlharvest.services.rollout_manager.control_loop import ControlConfig, RolloutControl
from rlharvest.services.rollout_manager.shard_client import capacity, shard_load
from rlharvest.services.rollout_manager.sharding import (
    Move,
    ShardLoad,
    plan_moves,
    shard_of,
    split_by_capacity,
)
from rlharvest.services.rollout_manager.step import StepOutcome
from rlharvest.services.rollout_manager.commands import Abort
from rlharvest.services.rollout_manager.tracker import RequestState, TokenDelta
from tests.builders import Clock, step


# ---- ownership, election, config -----------------------------------------------------------------

def test_a_workers_shard_is_a_stable_rule_of_its_id_that_spreads_workers():
    assert shard_of("w7", 4) == shard_of("w7", 4)  # every manager of a shard computes the same
    assert all(shard_of(f"w{i}", 1) == 0 for i in range(10))
    spread = Counter(shard_of(f"worker-{i}", 4) for i in range(400))
    assert set(spread) == {0, 1, 2, 3} and min(spread.values()) > 60
    with pytest.raises(ValueError, match="at least 1"):
        shard_of("w", 0)


def test_one_shard_keeps_the_jobs_election_and_each_shard_has_its_own():
    assert keys.manager_election("job") == "rollout_manager.job"
    assert keys.manager_election("job", 0, 1) == "rollout_manager.job"
    names = {keys.manager_election("job", i, 2) for i in range(2)}
    assert len(names) == 2 and all(n.startswith("rollout_manager.job:") for n in names)


def test_a_shard_index_beyond_the_shards_or_a_job_wide_record_with_shards_is_refused():
    assert ManagerConfig(shards=2, shard_index=1).shards == 2
    with pytest.raises(ValidationError, match="shard_index 2 must be below shards 2"):
        ManagerConfig(shards=2, shard_index=2)
    with pytest.raises(ValidationError, match="with shards 1"):
        ManagerConfig(shards=2, tp_planner=True)


# ---- a step's split and the moves ------------------------------------------------------------

@pytest.mark.parametrize("count,capacities,shares", [
    (10, [4, 4], [5, 5]),
    (10, [8, 2], [8, 2]),
    (7, [1, 1, 1], [3, 2, 2]),
    (5, [0, 3], [0, 5]),  # a shard with no healthy worker gets none
    (4, [0, 0], [2, 2]),  # none reported yet: evenly
])
def test_a_step_splits_in_proportion_to_each_shards_capacity(count, capacities, shares):
    assert split_by_capacity(count, capacities) == shares


def test_queued_requests_move_to_the_idlest_shard_without_a_queue_of_its_own():
    loads = {0: ShardLoad(queued=12, idle_slots=0), 1: ShardLoad(0, 3), 2: ShardLoad(0, 8),
             3: ShardLoad(2, 5)}
    assert plan_moves(loads) == [Move(0, 2, 8), Move(3, 1, 2)]
    assert plan_moves({0: ShardLoad(4, 0), 1: ShardLoad(1, 4)}) == []  # 1 fills from its own
    assert plan_moves({0: ShardLoad(0, 4), 1: ShardLoad(0, 4)}) == []


def test_a_shards_load_and_capacity_come_from_its_healthy_workers_on_the_steps_version():
    status = mpb.ManagerStatus(waiting=3, workers=[
        mpb.WorkerStatus(worker_id="a", state="healthy", capacity=4, assigned=1),
        mpb.WorkerStatus(worker_id="b", state="healthy", capacity=4, assigned=6),
        mpb.WorkerStatus(worker_id="c", state="lost", capacity=4, assigned=0),
        mpb.WorkerStatus(worker_id="d", state="healthy", capacity=4, weight_version=1)])
    assert shard_load(status, 0) == ShardLoad(queued=3 + 2, idle_slots=3)  # b: 2 beyond slots
    assert capacity(status, 0) == 8 and capacity(status, 1) == 4
    assert shard_load(None, 0) == ShardLoad(0, 0) and capacity(None, 0) == 0


# ---- Withdraw in the core ------------------------------------------------------------------------

def make() -> RolloutControl:
    control = RolloutControl(ControlConfig(theta=1), Clock())
    control.worker_joined("w", 0, capacity=1, kind="gpu")
    return control


def test_only_requests_that_never_reached_a_worker_are_withdrawn_and_none_fails():
    control = make()
    s = control.add_step("s", step(4), 0)
    control.tick()  # r0 in the slot, r1 pending on w, r2 and r3 wait in the manager
    assert [r.request_id for r in control.tracker.waiting()] == ["r2", "r3"]
    out = control.withdraw(["r3", "r2", "r1", "r0", "unknown"], limit=0)
    assert out.taken == ["r3", "r2"] and out.tokens == [0, 0] and not out.ended
    assert not out.commands
    assert s.outstanding == {"r0", "r1"} and "r2" not in control.tracker
    assert control.tracker.counters.failed == 0 and not control.tracker.waiting()
    assert control.withdraw(["r1"]).taken == []  # on a worker: it stays


def test_withdrawing_a_steps_last_queued_requests_ends_it_and_the_limit_holds():
    control = make()
    control.add_step("first", step(2, prefix="a"), 0)
    control.tick()
    later = control.add_step("later", step(3, prefix="b"), 0)  # all wait: w is full
    assert control.withdraw(["b0", "b1", "b2"], limit=2).taken == ["b0", "b1"]
    out = control.withdraw(["b2"])
    assert out.taken == ["b2"] and out.ended == [later]
    assert later.outcome is StepOutcome.FINISHED


def test_a_released_request_or_one_a_worker_kept_is_not_withdrawn_without_running():
    control = make()
    control.add_step("s", step(3), 0)
    control.tick()
    control.tracker.release("r1")  # back in the manager with its tokens: it ran here
    assert control.tracker.get("r1").state is RequestState.WAITING
    control.pool.get("w").kept.add("r2")  # a worker runs it still, for this successor
    assert control.withdraw(["r1", "r2"]).taken == []
    assert control.withdraw(["r2"], running=True).taken == []


def test_running_requests_leave_with_their_token_counts_queued_ones_first_and_are_aborted():
    control = make()
    control.worker_joined("v", 0, capacity=1, kind="gpu")
    control.add_step("s", step(4), 0)
    control.tick()  # r0, r2 on v; r1, r3 on w
    control.step_deltas("v", [TokenDelta("r0", 0, (5, 6), (0.0, 0.0), 0, False, "")])
    control.step_deltas("w", [TokenDelta("r1", 0, (5,), (0.0,), 0, False, "")])
    assert control.tracker.get("r0").state is RequestState.EXECUTING
    out = control.withdraw(["r0", "r1", "r2", "r3"], limit=3, running=True)
    assert out.taken == ["r2", "r3", "r1"] and out.tokens == [0, 0, 1]  # queued, then fewest
    assert out.commands == [Abort("r2", "v"), Abort("r3", "w"), Abort("r1", "w")]
    assert control.tracker.counters.failed == 0
    assert [r.request_id for r in control.tracker.on_worker("v")] == ["r0"]
