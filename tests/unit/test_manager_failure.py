"""Worker loss, draining and starvation (RLBoost §4.2: preemption loses no generated token)."""

from __future__ import annotations

import grpc
import pytest

from rlharvest.services.rollout_manager.commands import (
    Abort,
    Dispatch,
    Fail,
    Forget,
    Migrate,
    Release,
)
from rlharvest.services.rollout_manager.control_loop import ControlConfig, RolloutControl
from rlharvest.services.rollout_manager.failure import FailureConfig
from rlharvest.sim.manager_policy import (
    Scenario,
    SimWorker,
    long_tail_lengths,
    simulate,
)
from rlharvest.services.rollout_manager.tracker import RequestState, TokenDelta
from rlharvest.services.rollout_manager.worker_pool import WorkerState
from tests.builders import Clock, request, step


def make(theta: int = 2, stall: float = 10.0, no_worker: float = 30.0):
    clock = Clock()
    control = RolloutControl(ControlConfig(theta=theta, failure=FailureConfig(
        stall_timeout_s=stall, no_worker_timeout_s=no_worker)), clock)
    return control, clock


def add(control: RolloutControl, n: int, version: int = 1, max_tokens: int = 50) -> list[str]:
    """A step of ``n`` requests r0.. on ``version``, announced whether or not a worker holds it."""
    return list(control.add_step("s", step(n, version=version, max_tokens=max_tokens), version,
                                 announced_version=version).request_ids)


def running_on_w(n: int = 1) -> tuple[RolloutControl, Clock]:
    """A step of ``n`` requests dispatched to worker "w", the one worker."""
    control, clock = make()
    control.worker_joined("w", 1, capacity=4, kind="k")
    add(control, n)
    control.tick()
    return control, clock


def emit(control: RolloutControl, worker: str, request_id: str, tokens: list[int],
         version: int = 1):
    pos = len(control.tracker.get(request_id).token_ids)
    return control.step_deltas(worker, [TokenDelta(request_id, pos, tuple(tokens),
                                                    (0.0,) * len(tokens), version)])


def placed(commands) -> dict[str, str]:
    return {c.request_id: (c.worker_id if isinstance(c, Dispatch) else c.dst)
            for c in commands if isinstance(c, (Dispatch, Migrate))}


# ---- loss -------------------------------------------------------------------------------------

def test_a_lost_worker_loses_no_token_and_its_requests_resume_from_their_last_token():
    control, clock = make()
    control.worker_joined("spot", 1, capacity=4, kind="k")
    add(control, 2)
    assert set(placed(control.tick()).values()) == {"spot"}
    emit(control, "spot", "r0", [10, 11, 12])
    released = control.worker_lost("spot", "stream broke: connection reset")
    assert sorted(released, key=str) == [Release("r0", "spot", "lost"),
                                         Release("r1", "spot", "lost")]
    control.worker_joined("dedicated", 1, capacity=4, kind="k")
    assert placed(control.tick()) == {"r0": "dedicated", "r1": "dedicated"}
    payload = control.tracker.resume_payload("r0")
    assert payload.generated_token_ids == (10, 11, 12) and payload.remaining_tokens == 47
    emit(control, "dedicated", "r0", [13])
    assert control.tracker.get("r0").token_ids == [10, 11, 12, 13]
    assert control.tracker.counters.tokens_regenerated == 0


def test_lost_twice_is_lost_once():
    control, _ = running_on_w()
    assert len(control.worker_lost("w", "stream broke")) == 1
    assert control.worker_lost("w", "lease vanished") == []
    assert control.pool.get("w").lost_reason == "stream broke"


def test_a_lost_worker_is_forgotten_once_it_stayed_lost_for_the_grace():
    control, clock = running_on_w()
    emit(control, "w", "r0", [5])
    control.worker_joined("v", 1, capacity=4, kind="k")
    clock.now = 10.0
    control.worker_lost("w", "lease expired")
    clock.now = 10.0 + FailureConfig().forget_lost_after_s - 1
    assert not [c for c in control.tick() if isinstance(c, Forget)]
    assert control.pool.get("w").state is WorkerState.LOST  # still shown as lost meanwhile
    clock.advance(1)
    assert [c for c in control.tick() if isinstance(c, Forget)] == [Forget("w")]
    assert "w" not in control.pool and [w.worker_id for w in control.pool.all()] == ["v"]
    assert "w" not in control.tracker._worker_index and "w" not in control.tracker._context
    assert not [c for c in control.tick() if isinstance(c, Forget)]  # forgotten once
    assert control.tracker.get("r0").token_ids == [5]  # its request lives on elsewhere


def test_workers_restarting_under_new_ids_leave_only_the_recently_lost_behind():
    control, clock = make()
    grace = FailureConfig().forget_lost_after_s
    for restart in range(20):  # a spot worker: a new hostname-pid each time
        control.worker_joined(f"spot-{restart}", 1, capacity=4, kind="spot")
        clock.advance(grace / 4)
        control.worker_lost(f"spot-{restart}", "preempted")
        control.tick()
    assert [w.worker_id for w in control.pool.all()] == [f"spot-{i}" for i in range(16, 20)]


def test_a_forgotten_worker_rejoining_under_its_id_is_a_new_worker():
    control, clock = make()
    control.worker_joined("w", 1, capacity=4, kind="k")
    control.worker_lost("w", "stream broke")
    clock.advance(FailureConfig().forget_lost_after_s)
    control.tick()
    control.worker_joined("w", 1, capacity=4, kind="k")
    assert control.pool.get("w").state is WorkerState.HEALTHY
    add(control, 1)
    assert placed(control.tick()) == {"r0": "w"}
    emit(control, "w", "r0", [5, 6])
    assert control.tracker.get("r0").token_ids == [5, 6]


def test_a_forgotten_workers_number_is_never_given_to_another_worker():
    control, clock = make()
    control.worker_joined("old", 1, capacity=4, kind="k")
    control.worker_joined("w", 1, capacity=4, kind="k")
    add(control, 1)
    emit(control, "old", "r0", [1])  # refused (r0 is on no worker), but "old" is number 0 now
    control.tracker.assign("r0", "w")  # "w" number 1
    control.worker_lost("old", "stream broke")
    clock.advance(FailureConfig().forget_lost_after_s)
    control.tick()
    control.worker_joined("new", 1, capacity=4, kind="k")
    # Rows naming r0's handle from the newcomer must not pass for w's.
    assert [d.reason for d in emit(control, "new", "r0", [9]).dropped] == ["stale"]
    # The ledger names workers by number: the newcomer's is not w's (nor the forgotten one's).
    numbers = {name: control.tracker._worker_number(name) for name in ("w", "new")}
    assert numbers["new"] not in (numbers["w"], 0), numbers
    assert control.tracker.get("r0").token_ids == []


def test_a_worker_still_holding_requests_is_not_forgotten_by_the_tracker():
    control, _ = running_on_w()
    with pytest.raises(ValueError, match="still holds 1 requests"):
        control.tracker.forget_worker("w")


def test_tokens_a_lost_worker_sends_after_the_loss_are_dropped():
    control, _ = running_on_w()
    emit(control, "w", "r0", [10])
    control.worker_lost("w", "lease vanished")
    report = control.step_deltas("w", [TokenDelta("r0", 1, (11,), (0.0,), 1)])
    assert [d.reason for d in report.dropped] == ["stale"]
    assert control.tracker.get("r0").token_ids == [10]


def test_a_busy_worker_without_progress_for_the_stall_timeout_is_lost():
    control, clock = make(stall=10.0)
    control.worker_joined("w", 1, capacity=4, kind="k")
    control.worker_joined("v", 1, capacity=4, kind="k")
    add(control, 2)
    on = {worker: rid for rid, worker in placed(control.tick()).items()}
    assert sorted(on) == ["v", "w"]
    clock.now = 8.0
    emit(control, "w", on["w"], [10])
    emit(control, "v", on["v"], [10])
    clock.now = 17.0
    control.tick()
    assert control.pool.get("w").state is WorkerState.HEALTHY  # progressed at 8.0
    emit(control, "v", on["v"], [11])
    clock.now = 18.5
    commands = control.tick()
    assert control.pool.get("w").state is WorkerState.LOST
    assert "no token for 10.5s" in control.pool.get("w").lost_reason
    assert placed(commands) == {on["w"]: "v"}  # re-dispatched at once to the healthy worker
    assert control.pool.get("v").state is WorkerState.HEALTHY


def test_an_idle_worker_never_stalls_and_its_stall_clock_starts_when_it_gets_work():
    control, clock = make(stall=10.0)
    control.worker_joined("w", 1, capacity=4, kind="k")
    clock.now = 100.0
    control.tick()
    assert control.pool.get("w").state is WorkerState.HEALTHY
    add(control, 1)
    control.tick()  # dispatched at 100
    clock.now = 109.0
    control.tick()
    assert control.pool.get("w").state is WorkerState.HEALTHY
    clock.now = 110.0
    control.tick()
    assert control.pool.get("w").state is WorkerState.LOST


# ---- drain ------------------------------------------------------------------------------------

def test_a_draining_worker_moves_its_requests_to_workers_with_room_and_takes_no_new_work():
    control, clock = make(theta=1)
    control.worker_joined("spot", 1, capacity=4, kind="k")
    add(control, 3)
    control.tick()
    emit(control, "spot", "r0", [10, 11])
    control.worker_joined("a", 1, capacity=1, kind="k")
    control.worker_joined("b", 1, capacity=1, kind="k")
    commands = control.worker_draining("spot", deadline=clock.now + 30.0)
    # a and b each take one into a free slot and one more pending (Θ=1): room for all three.
    assert all(isinstance(c, Migrate) and c.cause == "drain" for c in commands)
    assert {c.src for c in commands} == {"spot"} and len(commands) == 3
    assert control.tracker.on_worker("spot") == []
    assert control.tracker.resume_payload("r0").generated_token_ids == (10, 11)
    control.add_step("more", [request("late", version=1)], 1)
    assert "spot" not in placed(control.tick()).values()


def test_a_draining_worker_keeps_decoding_what_finds_no_room_until_its_deadline():
    control, clock = make(theta=1, stall=100.0)
    control.worker_joined("spot", 1, capacity=4, kind="k")
    add(control, 4)
    control.tick()
    control.worker_joined("small", 1, capacity=1, kind="k")
    moved = control.worker_draining("spot", deadline=10.0)
    assert len(moved) == 2  # one slot + Θ=1 pending on "small"
    assert len(control.tracker.on_worker("spot")) == 2
    kept = control.tracker.on_worker("spot")[0].request_id
    emit(control, "spot", kept, [10])  # still a valid assignee: its tokens count
    assert control.tracker.get(kept).token_ids == [10]
    clock.now = 10.0
    commands = control.tick()
    assert control.pool.get("spot").state is WorkerState.LOST
    assert control.pool.get("spot").lost_reason == "drain deadline passed"
    assert {c.request_id for c in commands if isinstance(c, Release)} == {
        r for r in ("r0", "r1", "r2", "r3") if r not in {m.request_id for m in moved}}


def test_requests_leave_a_worker_that_loads_another_version_even_without_room():
    control, _ = make(theta=1)
    control.worker_joined("w", 1, capacity=4, kind="k")
    add(control, 2)
    control.tick()
    emit(control, "w", "r0", [10])
    commands = control.worker_version_changed("w", 2)
    assert sorted(commands, key=str) == [Release("r0", "w", "version"),
                                         Release("r1", "w", "version")]
    assert control.tick() == []  # nothing is dispatched to w: it holds version 2 now
    assert control.tracker.get("r0").state is RequestState.WAITING


# ---- refusals ---------------------------------------------------------------------------------

@pytest.mark.parametrize("code", [grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAVAILABLE,
                                  grpc.StatusCode.ALREADY_EXISTS,
                                  grpc.StatusCode.RESOURCE_EXHAUSTED])
def test_a_refusal_about_the_worker_sends_the_request_elsewhere_without_an_abort(code):
    control, _ = running_on_w()
    emit(control, "w", "r0", [10])
    commands = control.command_refused("w", "r0", code.value[0], "full")
    assert commands == [Release("r0", "w", "refused", abort=False)]  # w never took it
    assert control.tracker.get("r0").state is RequestState.WAITING
    control.worker_joined("v", 1, capacity=4, kind="k")
    assert placed(control.tick()) == {"r0": "v"}
    assert control.tracker.resume_payload("r0").generated_token_ids == (10,)


def test_a_refusal_about_the_request_itself_fails_it_with_the_workers_message():
    control, _ = running_on_w()
    [fail] = control.command_refused("w", "r0", grpc.StatusCode.INVALID_ARGUMENT.value[0],
                                     "prompt of 9000 tokens exceeds the context of 4096")
    assert isinstance(fail, Fail) and fail.reason == (
        "worker w refused the request: prompt of 9000 tokens exceeds the context of 4096")
    assert control.tracker.get("r0").state is RequestState.FAILED


def test_a_refused_abort_never_fails_the_request_now_tracked_under_that_id():
    # A client retried its step with the same ids: the abort of the abandoned attempt reaches
    # the worker after it finished that request, and its NOT_FOUND lands on the retry's request.
    control, _ = make()
    control.worker_joined("w", 1, capacity=4, kind="k")
    add(control, 1)
    assert placed(control.tick()) == {"r0": "w"}
    code = grpc.StatusCode.NOT_FOUND.value[0]
    assert control.command_refused("w", "r0", code, "no request 'r0' of this session") == []
    request = control.tracker.get("r0")
    assert request.state is RequestState.PENDING and request.worker_id == "w"


def test_a_refusal_about_an_assignment_the_request_left_is_ignored():
    control, _ = running_on_w()
    control.worker_draining("w", deadline=100.0)
    control.worker_joined("v", 1, capacity=4, kind="k")
    assert placed(control.tick()) == {"r0": "v"}  # moved off the draining worker
    code = grpc.StatusCode.UNAVAILABLE.value[0]
    assert control.command_refused("w", "r0", code, "draining") == []
    assert control.command_refused("w", "unknown", code, "draining") == []
    assert control.tracker.get("r0").worker_id == "v"


def test_a_refusal_of_an_earlier_dispatch_to_the_same_worker_leaves_the_current_one_running():
    # r0 went to w, moved to v and came back to w before w's refusal of the first add arrived:
    # the refusal names the first dispatch's handle and leaves the second alone.
    control, _ = running_on_w()
    first = control.tracker.resume_payload("r0").handle
    control.tracker.move("r0", "v")
    control.tracker.move("r0", "w")
    code = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert control.command_refused("w", "r0", code, "no pages", first) == []
    assert control.tracker.get("r0").worker_id == "w"
    current = control.tracker.resume_payload("r0").handle
    assert control.command_refused("w", "r0", code, "no pages", current) == [
        Release("r0", "w", "refused", abort=False)]


def test_a_request_named_in_several_refused_rows_of_one_batch_is_released_once():
    control, _ = running_on_w()
    emit(control, "w", "r0", [5])
    # Two rows that both skip ahead of the one token the manager holds: "position" twice.
    report = control.step_deltas("w", [TokenDelta("r0", 3, (6,), (0.0,), 1),
                                       TokenDelta("r0", 4, (7,), (0.0,), 1)])
    assert [d.reason for d in report.dropped] == ["position", "position"]
    assert control.tracker.get("r0").state is RequestState.WAITING
    assert control.tracker.get("r0").token_ids == [5]
    assert [c for c in control.tick() if isinstance(c, Release)] == [
        Release("r0", "w", "protocol")]


# ---- starvation -------------------------------------------------------------------------------

def test_requests_without_any_eligible_worker_fail_at_the_deadline_with_a_clear_reason():
    control, clock = make(no_worker=30.0)
    control.worker_joined("old", 0, capacity=4, kind="k")  # wrong version: not eligible
    add(control, 2, version=1)
    assert control.tick() == []
    clock.now = 29.0
    assert control.tick() == []
    clock.now = 30.0
    fails = control.tick()
    assert sorted(c.request_id for c in fails) == ["r0", "r1"]
    assert all(isinstance(c, Fail) and "weight version 1" in c.reason
               and "start rollout workers" in c.reason for c in fails)
    assert control.tracker.get("r0").state is RequestState.FAILED
    assert control.tracker.unfinished() == 0


def test_the_starvation_clock_resets_when_an_eligible_worker_appears():
    control, clock = make(no_worker=30.0)
    add(control, 1)
    control.tick()
    clock.now = 20.0
    control.worker_joined("w", 1, capacity=4, kind="k")
    control.tick()
    control.worker_lost("w", "stream broke")
    control.tick()  # from here on r0 waits with no eligible worker
    clock.now = 45.0
    assert control.tick() == []  # 25 s since it was last without a worker
    clock.now = 50.0
    assert [type(c) for c in control.tick()] == [Fail]


def test_waiting_behind_theta_is_delayed_dispatch_not_starvation():
    control, clock = make(theta=1, no_worker=5.0)
    control.worker_joined("w", 1, capacity=1, kind="k")
    add(control, 5)
    control.tick()
    clock.now = 1000.0
    control.pool.note_progress("w")
    assert not [c for c in control.tick() if isinstance(c, Fail)]
    assert len(control.tracker.waiting()) == 3


def test_stall_and_no_worker_timeouts_must_be_positive():
    with pytest.raises(ValueError, match="stall_timeout_s=0"):
        FailureConfig(stall_timeout_s=0)


# ---- preemption end to end (RLBoost §6.4.3) ---------------------------------------------------

def test_preempting_a_third_of_the_workers_mid_step_regenerates_nothing_with_migration():
    workers = tuple(SimWorker(f"w{i}", speed=1.0, capacity=8) for i in range(3))
    lengths = long_tail_lengths(24, seed=7, median=40, max_tokens=200)
    base = Scenario(workers, lengths, prompt_len=8)
    preempted = {mode: simulate(Scenario(workers, lengths, prompt_len=8, preempt_at_s=1.0,
                                         preempt=("w0",), recovery=mode), "rlboost")
                 for mode in ("migrate", "recompute")}
    clean = simulate(base, "rlboost")
    migrate, recompute = preempted["migrate"], preempted["recompute"]
    assert migrate.finished == recompute.finished == clean.finished == 24
    assert migrate.contiguous and recompute.contiguous
    assert migrate.tokens_regenerated == 0 < recompute.tokens_regenerated
    assert migrate.tokens_generated == clean.tokens_generated == sum(lengths)
    assert migrate.makespan_s < recompute.makespan_s


# ---- no worker for a version ------------------------------------------------------------------

def test_waiting_requests_fail_at_their_own_deadline_or_the_managers():
    control, clock = make(no_worker=30.0)
    control.add_step("s", [request("own", version=1, no_worker_timeout_s=2.0),
                           request("default", version=1)], 1, announced_version=1)
    assert control.tick() == []
    clock.now = 1.9
    assert control.tick() == []
    clock.now = 2.0
    [fail] = control.tick()
    assert isinstance(fail, Fail) and fail.request_id == "own"
    assert "no-worker deadline 2s" in fail.reason
    assert control.tracker.get("own").state is RequestState.FAILED
    clock.now = 29.9
    assert control.tick() == []
    clock.now = 30.0
    assert [c.request_id for c in control.tick()] == ["default"]


def test_a_request_that_arrives_late_waits_its_full_deadline():
    control, clock = make(no_worker=10.0)
    add(control, 1)  # version 1 starts starving at t=0
    control.tick()
    clock.now = 8.0
    control.add_step("later", [request("late", version=1)], 1, announced_version=1)
    clock.now = 10.0
    assert [c.request_id for c in control.tick()] == ["r0"]
    clock.now = 17.9
    assert control.tick() == []
    clock.now = 18.0
    assert [c.request_id for c in control.tick()] == ["late"]


def test_a_worker_joining_in_time_stops_the_deadline():
    control, clock = make(no_worker=10.0)
    add(control, 1)
    control.tick()
    clock.now = 9.0
    control.worker_joined("w", 1, capacity=4, kind="k")
    assert placed(control.tick()) == {"r0": "w"}
    clock.now = 50.0
    assert not any(isinstance(c, Fail) for c in control.tick())


# ---- requests a worker kept from a broken session (a dead manager's) -------------------------

def test_a_request_a_worker_kept_goes_back_to_it_before_algorithm_2():
    """A successor learns from a worker's new session which requests it still runs, before the
    trainer resubmits them: they go back to that worker (it adopts them with every token)
    though another is idle; the rest go by Algorithm 2 on the loads that left."""
    control, _ = make(theta=2)
    control.worker_joined("keeper", 1, capacity=2, kind="k")
    control.worker_joined("idle", 1, capacity=4, kind="k")
    assert control.worker_keeps("keeper", ["r0", "r1"]) == []  # unknown yet: remembered
    add(control, 3)
    commands = control.tick()
    assert [c for c in commands if isinstance(c, Dispatch)] == [
        Dispatch("r0", "keeper"), Dispatch("r1", "keeper"), Dispatch("r2", "idle")]
    assert not [c for c in commands if isinstance(c, Migrate)]
    assert control.pool.get("keeper").kept == set()


def test_the_balancer_moves_a_request_given_back_to_its_keeper_only_once_its_catch_up_is_in():
    """A request dispatched back to the worker that kept it carries, in its first rows, every
    token the worker made while no manager held it. Migrated before those rows come, they would
    be dropped as stale and the tokens generated again on the receiver: Algorithm 2's balancer
    leaves it where it is until then, and may move it after."""
    control, _ = make(theta=1)
    control.worker_joined("keeper", 1, capacity=1, kind="k")
    control.worker_joined("idle", 1, capacity=4, kind="k")
    control.worker_keeps("keeper", ["r0", "r1", "r2"])
    add(control, 3)
    assert placed(control.tick()) == {"r0": "keeper", "r1": "keeper", "r2": "keeper"}
    for _ in range(3):  # the keeper is over its capacity and "idle" is empty, yet nothing moves
        moved = [c for c in control.tick() if isinstance(c, Migrate)]
        assert moved == [], f"moved before their catch-up rows came: {moved}"
    for rid in ("r0", "r1", "r2"):
        emit(control, "keeper", rid, [10, 11])  # the catch-up: made while no manager held them
    moved = {c.request_id for c in control.tick() if isinstance(c, Migrate)}
    assert moved and moved <= {"r0", "r1", "r2"}
    assert control.tracker.counters.tokens_regenerated == 0


def test_kept_requests_placed_elsewhere_finished_or_unknown_are_handled_apart():
    """Kept ids the manager already placed on another worker are dropped on the keeper
    (Abort); a waiting one goes back; a waiting one of another version is dropped too."""
    control, _ = make()
    control.worker_joined("a", 1, capacity=4, kind="k")
    add(control, 2)
    assert placed(control.tick()) == {"r0": "a", "r1": "a"}
    control.worker_lost("a", "stream broke")  # both wait again, tokens kept
    control.worker_joined("b", 1, capacity=4, kind="k")
    assert placed(control.tick()) == {"r0": "b", "r1": "b"}
    control.worker_joined("a2", 1, capacity=4, kind="k")
    commands = control.worker_keeps("a2", ["r0", "gone"])
    assert commands == [Abort("r0", "a2")]  # runs on b now
    assert control.pool.get("a2").kept == {"gone"}


def test_a_lost_keeper_forgets_what_it_kept():
    control, _ = make()
    control.worker_joined("keeper", 1, capacity=4, kind="k")
    control.worker_joined("other", 1, capacity=4, kind="k")
    control.worker_keeps("keeper", ["r0"])
    control.worker_lost("keeper", "stream broke")
    add(control, 1)
    assert placed(control.tick()) == {"r0": "other"}


def test_a_kept_copy_on_a_worker_that_cannot_take_it_is_dropped_once_placed_elsewhere():
    """The keeper drains (or holds another version): Algorithm 2 places the request elsewhere,
    and the keeper is told to drop its copy instead of running it for nothing."""
    control, clock = make()
    control.worker_joined("keeper", 1, capacity=4, kind="k")
    control.worker_joined("other", 1, capacity=4, kind="k")
    control.worker_keeps("keeper", ["r0"])
    control.worker_draining("keeper", clock() + 30)
    add(control, 1)
    commands = control.tick()
    assert Dispatch("r0", "other") in commands and Abort("r0", "keeper") in commands
    assert control.pool.get("keeper").kept == set()


def test_a_kept_request_dispatched_back_before_the_keepers_news_is_not_aborted_there():
    control, _ = make()
    control.worker_joined("w", 1, capacity=4, kind="k")
    add(control, 1)
    assert placed(control.tick()) == {"r0": "w"}  # a tick before the kept event
    assert control.worker_keeps("w", ["r0"]) == []  # the worker adopted it on that add


def test_a_workers_kept_list_replaces_the_one_before():
    """Each list is whole: an id the worker dropped since is forgotten, not dispatched back."""
    control, _ = make()
    control.worker_joined("keeper", 1, capacity=4, kind="k")
    control.worker_joined("other", 1, capacity=4, kind="k")
    control.worker_keeps("keeper", ["r0", "r1"])
    control.worker_keeps("keeper", ["r1"])  # r0 expired on the worker meanwhile
    assert control.pool.get("keeper").kept == {"r1"}
    add(control, 2)
    where = placed(control.tick())
    assert where["r1"] == "keeper"
