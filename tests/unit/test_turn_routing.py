"""Turn-wise routing of agentic trajectories (ROSE §4.3): a turn goes back to the worker that
holds its history while that worker is under its cap (the batching plateau, else its capacity),
is placed like any request otherwise; pinned and turnwise behave as their names say; entries end
with the last turn or their TTL; and the manager's core routes real turns this way."""

from __future__ import annotations

from dataclasses import replace

import grpc
import pytest

from rlharvest.services.rollout_manager.balancer import InstanceLoad, select_instance
from rlharvest.services.rollout_manager.control_loop import ControlConfig, RolloutControl
from rlharvest.services.rollout_manager.commands import Dispatch
from rlharvest.services.rollout_manager.tracker import TokenDelta
from rlharvest.services.rollout_manager.turn_routing import TurnRouter, TurnRouting
from tests.builders import Clock, request

A = InstanceLoad("a", capacity=4)
B = InstanceLoad("b", capacity=4)


def busy(instance: InstanceLoad, running: int, queued: int = 0) -> InstanceLoad:
    return replace(instance, running=tuple(f"x{i}" for i in range(running)),
                   queued=tuple(f"y{i}" for i in range(queued)))


def router(mode: TurnRouting = TurnRouting.AFFINITY, ttl_s: float = 60) -> tuple[TurnRouter, Clock]:
    clock = Clock()
    return TurnRouter(mode, ttl_s, clock), clock


def test_a_turn_returns_to_the_worker_of_its_last_turn_even_when_another_is_emptier():
    r, _ = router()
    assert r.select("t", [busy(A, 2), B], 2, select_instance) == "b"  # first turn: JSQ
    r.finished("t", "a", last_turn=False)  # (it ran on a after all: a migration)
    assert r.select("t", [busy(A, 2), B], 2, select_instance) == "a"
    assert (r.counts.first, r.counts.affinity, r.counts.moved) == (1, 1, 0)


def test_a_home_with_theta_turns_waiting_beyond_its_cap_sends_the_turn_elsewhere():
    r, _ = router()
    r.finished("t", "a", last_turn=False)
    assert r.select("t", [busy(A, 4, queued=1), B], 2, select_instance) == "a"  # may wait
    assert r.select("t", [busy(A, 4, queued=2), B], 2, select_instance) == "b"  # Θ waiting
    # App. A: past the plateau B throughput stops rising, so B is the cap.
    plateau = replace(busy(A, 4), plateau=2)
    assert r.select("t", [plateau, B], 2, select_instance) == "b"
    assert r.select("t", [B], 2, select_instance) == "b"  # home gone (lost, drained)
    assert r.counts.moved == 3 and r.counts.affinity == 1


def test_pinned_stays_on_its_worker_however_loaded_and_turnwise_ignores_history():
    pinned, _ = router(TurnRouting.PINNED)
    first = pinned.select("t", [A, B], 2, select_instance)
    pinned.dispatched("t", first)
    full = [busy(A, 4) if first == "a" else A, busy(B, 4) if first == "b" else B]
    assert pinned.select("t", full, 2, select_instance) == first
    turnwise, _ = router(TurnRouting.TURNWISE)
    turnwise.finished("t", "a", last_turn=False)
    assert turnwise.select("t", [busy(A, 2), B], 2, select_instance) == "b"
    assert len(turnwise) == 0


def test_pinned_static_binds_a_first_turn_at_once_to_the_least_assigned_worker_however_full():
    static, _ = router(TurnRouting.PINNED_STATIC)
    full = [busy(A, 4, queued=3), busy(B, 4, queued=5)]
    assert static.select("t", full, 2, select_instance) == "a"  # no hold: it queues there
    assert select_instance(full, 2) is None  # where pinned (and Algorithm 2) would wait
    static.dispatched("t", "a")
    assert static.select("t", [busy(A, 4, queued=9), B], 2, select_instance) == "a"
    assert static.select("t", [B], 2, select_instance) == "b"  # its worker is gone
    assert (static.counts.first, static.counts.affinity, static.counts.moved) == (1, 1, 1)


def test_the_last_turn_and_the_ttl_end_an_entry():
    r, clock = router(ttl_s=10)
    r.finished("t", "a", last_turn=False)
    r.finished("u", "a", last_turn=False)
    r.finished("t", "a", last_turn=True)
    assert r.home("t") is None and r.home("u") == "a"
    clock.advance(11)
    assert r.home("u") is None
    r.finished("v", "b", last_turn=False)
    clock.advance(11)
    assert r.expire() == 1 and len(r) == 0


def test_the_manager_routes_a_trajectorys_next_turn_to_the_worker_that_served_the_last():
    clock = Clock()
    control = RolloutControl(ControlConfig(theta=2), clock)
    control.worker_joined("a", 0, capacity=4, kind="gpu")
    control.worker_joined("b", 0, capacity=4, kind="gpu")

    def turn(rid: str, n: int, last: bool = False):
        return replace(request(rid), trajectory_id="traj", turn=n, last_turn=last)

    control.add_step("t0", [turn("t0", 0)], 0)
    home = next(c.worker_id for c in control.tick() if isinstance(c, Dispatch))
    control.step_deltas(home, [TokenDelta("t0", 0, (5,), (0.0,), 0, True, "stop")])
    control.deliver("t0")
    # Other requests load the home worker more than the other one: JSQ alone would now pick
    # the other worker.
    control.add_step("other", [request(f"o{i}") for i in range(3)], 0)
    for c in control.tick():
        assert isinstance(c, Dispatch)
    assert select_instance(control._loads(0), 2) != home
    control.add_step("t1", [turn("t1", 1, last=True)], 0)
    dispatched = [c for c in control.tick() if isinstance(c, Dispatch)]
    assert dispatched == [Dispatch("t1", home)]
    assert control.router.counts.affinity == 1
    control.step_deltas(home, [TokenDelta("t1", 0, (5,), (0.0,), 0, True, "stop")])
    control.deliver("t1")
    assert len(control.router) == 0  # the last turn ended the entry


def test_with_every_worker_full_a_turn_waits_and_room_at_home_goes_to_its_own_turns_first():
    r, _ = router()
    r.finished("t", "a", last_turn=False)
    r.finished("u", "b", last_turn=False)
    full = [busy(A, 4, queued=2), busy(B, 4, queued=2)]
    assert r.select("t", full, 2, select_instance) is None  # no queueing behind a stranger
    freed_b = [busy(A, 4, queued=2), busy(B, 4, queued=1)]
    # u's history is on b: it goes first, although t waited longer.
    assert r.order(["t", "u"], lambda rid: rid, freed_b, 2) == ["u", "t"]
    assert r.select("u", freed_b, 2, select_instance) == "b"


def test_the_simulated_cluster_keeps_histories_where_turns_run_and_beats_turnwise():
    from rlharvest.sim.agentic import AgenticWorkload, ClusterModel, compare

    cluster = ClusterModel(workers=4, slots=4)
    # Under capacity no home is ever full: affinity keeps every history as pinning does.
    under = compare(AgenticWorkload(trajectories=12, turn_range=(2, 5)), cluster)
    assert under["turnwise+affinity"] == under["pinned"]
    assert under["turnwise+affinity"].prefill_tokens < under["turnwise"].prefill_tokens
    assert under["turnwise+affinity"].makespan_s < under["turnwise"].makespan_s
    # Over capacity turns wait at home up to Θ and move only to a worker with a free slot: the
    # histories stay found as under pinning, and no trajectory finishes later than pinned.
    over = compare(AgenticWorkload(trajectories=24, turn_range=(2, 5)), cluster)
    assert over["turnwise+affinity"].turns == over["turnwise"].turns == over["pinned"].turns
    assert over["turnwise"].hit_rate < over["turnwise+affinity"].hit_rate
    assert over["turnwise+affinity"].makespan_s <= over["pinned"].makespan_s
    assert over["turnwise+affinity"].makespan_s < over["turnwise"].makespan_s


def test_a_first_turn_queues_like_any_request_when_no_worker_is_under_its_cap():
    # It has no history to lose: held in the manager, it would wait while the started
    # trajectories' later turns take every freed slot. A turn with a history still waits.
    r, _ = router()
    r.finished("t", "a", last_turn=False)
    full = [busy(A, 4), busy(B, 4, queued=1)]
    assert r.select("new", full, 2, select_instance) == "a"  # Algorithm 2: fewest pending
    assert r.counts.first == 1
    far = [busy(A, 4, queued=2), busy(B, 4)]
    assert r.select("t", far, 2, select_instance) is None  # home a is Θ beyond its cap


def test_the_managers_routing_flag_reaches_its_core():
    from rlharvest.common.config import load_config
    from rlharvest.services.rollout_manager.config import ManagerConfig
    from rlharvest.services.rollout_manager.main import build_control

    for mode in TurnRouting:
        cfg = load_config(ManagerConfig, flags={"turn_routing": mode.value,
                                                "trajectory_ttl_s": "30", "refusal_hold_s": "0.5"})
        control = build_control(cfg)
        assert control.router.mode is mode and control.router.ttl_s == 30
        assert control.config.refusal_hold_s == 0.5


def test_a_lost_workers_turn_resumes_elsewhere_with_its_tokens_and_its_home_moves_there():
    clock = Clock()
    control = RolloutControl(ControlConfig(theta=2), clock)
    control.worker_joined("a", 0, capacity=4, kind="gpu")
    control.worker_joined("b", 0, capacity=4, kind="gpu")
    turn = replace(request("t0", max_tokens=4), trajectory_id="traj", turn=0)
    control.add_step("t0", [turn], 0)
    first = next(c.worker_id for c in control.tick() if isinstance(c, Dispatch))
    control.step_deltas(first, [TokenDelta("t0", 0, (5, 6), (0.0, 0.0), 0)])
    control.worker_lost(first, "SIGKILL")
    moved = [c for c in control.tick() if isinstance(c, Dispatch)]
    other = "b" if first == "a" else "a"
    assert moved == [Dispatch("t0", other)]
    assert control.tracker.get("t0").token_ids == [5, 6]  # resumed, not regenerated
    control.step_deltas(other, [TokenDelta("t0", 2, (7, 8), (0.0, 0.0), 0, True, "length")])
    control.deliver("t0")
    assert control.router.home("traj") == other  # the history's KV is where it finished


def test_a_turn_waiting_for_room_does_not_hold_the_plain_requests_behind_it():
    clock = Clock()
    control = RolloutControl(ControlConfig(theta=2), clock)
    for worker in ("a", "b"):
        control.worker_joined(worker, 0, capacity=1, kind="gpu")
    control.add_step("busy", [request(f"b{i}") for i in range(5)], 0)
    control.tick()  # a: 1 running + 2 queued (Θ beyond its cap), b: 1 + 1
    assert control.tracker.assigned_count("a") == 3
    control.router.finished("traj", "a", last_turn=False)  # the history is on a
    turn = replace(request("t1"), trajectory_id="traj", turn=1)
    control.add_step("turn", [turn], 0)
    control.add_step("plain", [request("p0")], 0)
    dispatched = [c for c in control.tick() if isinstance(c, Dispatch)]
    # The turn's home is Θ beyond its cap and b is at its cap: it waits for a slot. The plain
    # request may queue on b (Algorithm 2 allows Θ pending), so it goes, although it came after.
    assert dispatched == [Dispatch("p0", "b")]
    assert control.tracker.get("t1").worker_id is None


S = InstanceLoad("s", capacity=2, serving=True)  # a co-executor: its cap is what it admits now
S2 = InstanceLoad("s2", capacity=2, serving=True)


def test_a_turn_spills_onto_a_co_executor_only_when_every_dedicated_worker_is_at_its_cap():
    for mode in (TurnRouting.TURNWISE, TurnRouting.AFFINITY):
        r, _ = router(mode)
        # The co-executor is emptier, but a dedicated worker has a free slot (ROSE §4.3).
        assert r.select("t", [busy(A, 3), S], 2, select_instance) == "a"
        assert r.select("u", [busy(A, 4), S], 2, select_instance) == "s"
        assert r.select("v", [busy(A, 4), busy(S, 2), S2], 2, select_instance) == "s2"
    affinity, _ = router()
    affinity.finished("w", "a", last_turn=False)
    # With every cap reached, a turn with a history waits (here its home is Θ beyond its cap).
    assert affinity.select("w", [busy(A, 4, queued=2), busy(S, 2)], 2, select_instance) is None
    for mode in (TurnRouting.TURNWISE, TurnRouting.AFFINITY):
        r, _ = router(mode)
        # A turn placed like any request (turnwise; affinity's first turn): Algorithm 2 may queue
        # it on a dedicated worker (Θ pending), never beyond a co-executor's admission.
        assert r.select("x", [busy(A, 4), busy(S, 2)], 2, select_instance) == "a"


def test_a_turn_whose_history_is_on_a_co_executor_moves_back_to_a_free_dedicated_slot():
    r, _ = router()
    r.finished("t", "s", last_turn=False)
    # §4.3: turns "migrate back to rollout GPUs once capacity becomes available".
    assert r.select("t", [busy(A, 3), S], 2, select_instance) == "a"
    assert r.counts.moved == 1
    # With every dedicated worker at its cap, its co-executor takes it while it admits.
    assert r.select("t", [busy(A, 4), busy(S, 1), S2], 2, select_instance) == "s"
    assert r.counts.affinity == 1
    # A co-executor at its cap (a serving burst) does not queue it: another one, else wait.
    assert r.select("t", [busy(A, 4), busy(S, 2), S2], 2, select_instance) == "s2"
    assert r.select("t", [busy(A, 4), busy(S, 2)], 2, select_instance) is None
    # A dedicated home keeps its turns while fewer than Θ wait there, co-executor or not.
    r.finished("u", "a", last_turn=False)
    assert r.select("u", [busy(A, 4, queued=1), S], 2, select_instance) == "a"
    pinned, _ = router(TurnRouting.PINNED)
    pinned.dispatched("t", "s")
    assert pinned.select("t", [A, busy(S, 2)], 2, select_instance) == "s"  # pinned stays


def test_the_manager_marks_a_co_executor_as_serving_in_algorithm_2s_view():
    control = RolloutControl(ControlConfig(theta=2), Clock())
    control.worker_joined("a", 0, capacity=4, kind="gpu")
    control.worker_joined("s", 0, capacity=4, kind="serving")
    assert {i.worker_id: i.serving for i in control._loads(0)} == {"a": False, "s": True}


def test_a_co_executor_takes_only_the_turns_its_reported_kv_room_holds():
    # Its rollout KV budget leaves room for 500 tokens: a 600-token history would be refused.
    roomy = replace(S, room_tokens=500)
    full = busy(A, 4, queued=2)  # Θ beyond its cap: not even a first turn queues there
    r, _ = router()
    assert r.select("big", [full, roomy], 2, select_instance, need_tokens=600) is None
    assert r.select("small", [full, roomy], 2, select_instance, need_tokens=400) == "s"
    # Two in one tick: the first takes the room the second would need.
    placed = r.dispatch(["t1", "t2"], lambda rid: rid, [full, roomy], 2, select_instance,
                        need_of=lambda rid: 300)
    assert placed == [Dispatch("t1", "s")]
    # A first turn held for its size does not hold a smaller one behind it.
    r, _ = router()
    sizes = {"big": 600, "small": 400}
    assert r.dispatch(["big", "small"], lambda rid: rid, [full, roomy], 2, select_instance,
                      need_of=sizes.__getitem__) == [Dispatch("small", "s")]
    # A turn at home on a co-executor without room waits, as for a full home; pinned too.
    for mode in (TurnRouting.AFFINITY, TurnRouting.PINNED):
        r, _ = router(mode)
        r.finished("h", "s", last_turn=False)
        r.dispatched("h", "s")
        assert r.select("h", [full, roomy], 2, select_instance, need_tokens=600) is None
        assert r.select("h", [full, roomy], 2, select_instance, need_tokens=400) == "s"


def test_the_manager_reads_a_co_executors_kv_room_from_its_load_report():
    control = RolloutControl(ControlConfig(theta=2), Clock())
    control.worker_joined("s", 0, capacity=4, kind="serving")
    control.worker_joined("a", 0, capacity=4, kind="gpu")
    control.worker_load("s", 0, 0, kv_capacity_tokens=2048, kv_used_tokens=512)
    control.worker_load("a", 0, 0, kv_capacity_tokens=4096, kv_used_tokens=0)
    loads = {i.worker_id: i for i in control._loads(0)}
    assert loads["s"].room_tokens == 1536 and loads["a"].room_tokens is None
    control.worker_lost("a", "gone")
    # A turn sent since the report counts against the room until the next report, which
    # counts its pages in the co-executor's use (it takes them at the add).
    turn = replace(request("t", prompt=(1,) * 99), trajectory_id="traj", turn=0)
    control.add_step("turns", [turn], 0)
    assert dispatched(control) == [Dispatch("t", "s")]
    assert {i.worker_id: i for i in control._loads(0)}["s"].room_tokens == 1536 - 100
    control.worker_load("s", 1, 0, kv_capacity_tokens=2048, kv_used_tokens=512 + 112)
    assert {i.worker_id: i for i in control._loads(0)}["s"].room_tokens == 2048 - 624


def test_with_bursting_serving_gpus_turn_wise_routing_escapes_the_bursts_that_pinning_waits_out():
    from rlharvest.sim.agentic import AgenticWorkload, ClusterModel, simulate

    # ROSE's Table 3 setting, scaled to 4 dedicated and 4 serving GPUs (the measured H100 step
    # costs): twice the slots' worth of trajectories spill onto serving GPUs, whose bursts
    # shrink what they admit, slow their rollout steps and abort what is beyond their cap.
    cluster = ClusterModel(workers=4, slots=16, serving=4, serving_slots=16, decode_s=0.024,
                           per_request_s=0.0, prefill_token_s=0.0000282)
    workload = AgenticWorkload(trajectories=256)
    pinned, turnwise, affinity = (simulate(mode, workload, cluster) for mode in (
        TurnRouting.PINNED, TurnRouting.TURNWISE, TurnRouting.AFFINITY))
    assert pinned.turns == turnwise.turns == affinity.turns  # every turn ran to its end
    assert pinned.aborted > 0  # bursts took slots back; the turns resumed with their tokens
    assert turnwise.makespan_s < pinned.makespan_s
    assert affinity.makespan_s < min(turnwise.makespan_s, pinned.makespan_s / 1.15)
    assert affinity.hit_rate > 2 * turnwise.hit_rate


def test_a_simulated_co_executor_takes_only_turns_its_kv_room_holds_and_gives_back_the_rest():
    from rlharvest.sim.agentic import AgenticWorkload, ClusterModel, simulate

    workload = AgenticWorkload(trajectories=48, turn_range=(2, 4))
    base = ClusterModel(workers=2, slots=8, serving=2, serving_slots=8, burst_slots=8,
                        serving_period_s=20.0)
    alone = simulate(TurnRouting.AFFINITY, workload, replace(base, serving=0))
    # Room for no turn (every prompt is 600 tokens): the co-executors never get one.
    none_fit = simulate(TurnRouting.AFFINITY, workload, replace(
        base, serving_kv_tokens=500, burst_kv_tokens=500))
    assert none_fit == alone
    # Room for a few turns outside bursts, for one in them: turns run there, and a burst (or
    # turns outgrowing the room) aborts what no longer fits; every turn still ends once.
    roomy, tight = (simulate(TurnRouting.AFFINITY, workload, replace(
        base, serving_kv_tokens=kv, burst_kv_tokens=burst)) for kv, burst in (
        (10**9, 10**9), (6000, 1200)))
    assert roomy.aborted == 0 and tight.aborted > 0
    assert roomy.turns == tight.turns == alone.turns
    assert roomy.makespan_s < alone.makespan_s  # the lent GPUs took turns
    # A pinned turn that outgrew its co-executor's room can go back only there: with homes
    # kept forever the run is stuck, and says so instead of spinning; with the manager's
    # entry lifetime it is placed again once its entry ends, and every turn ends.
    stuck = replace(base, serving_kv_tokens=6000, burst_kv_tokens=1200)
    with pytest.raises(RuntimeError, match="every worker idle"):
        simulate(TurnRouting.PINNED, AgenticWorkload(), stuck)
    ends = simulate(TurnRouting.PINNED, AgenticWorkload(), replace(stuck, trajectory_ttl_s=120))
    assert ends.turns == sum(len(turns) for turns in AgenticWorkload().draw().values())


def dispatched(control: RolloutControl) -> list[Dispatch]:
    return [c for c in control.tick() if isinstance(c, Dispatch)]


def one_request_on(worker: str, kind: str) -> tuple[RolloutControl, Clock]:
    """A manager with one worker, holding 0.25 s after a refusal, and r0 dispatched to it."""
    clock = Clock()
    control = RolloutControl(ControlConfig(theta=2, refusal_hold_s=0.25), clock)
    control.worker_joined(worker, 0, capacity=4, kind=kind)
    control.add_step("x", [request("r0", max_tokens=8)], 0)
    assert dispatched(control) == [Dispatch("r0", worker)]
    return control, clock


def test_a_worker_that_refused_a_request_for_memory_gets_none_until_its_hold_ends():
    control, clock = one_request_on("s", "serving")
    # Its serving burst took the KV budget back: it refuses the add for memory.
    control.command_refused("s", "r0", grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], "no pages")
    for _ in range(3):  # before: sent back to it every tick, refused every tick
        clock.advance(0.05)
        assert not dispatched(control)
    control.worker_joined("a", 0, capacity=4, kind="gpu")
    clock.advance(0.05)
    assert dispatched(control) == [Dispatch("r0", "a")]
    assert {i.worker_id: i.refusing for i in control._loads(0)} == {"a": False, "s": True}
    clock.advance(0.1)  # the hold is over: it takes requests again (it is the emptier)
    control.add_step("y", [request("r1")], 0)
    assert dispatched(control) == [Dispatch("r1", "s")]


def test_a_refusing_worker_holds_its_pinned_turns_and_binds_no_new_ones():
    refusing = replace(S, refusing=True)
    pinned, _ = router(TurnRouting.PINNED)
    pinned.dispatched("t", "s")
    assert pinned.select("t", [A, refusing], 2, select_instance) is None  # waits for it
    assert pinned.select("t", [A, S], 2, select_instance) == "s"
    static, _ = router(TurnRouting.PINNED_STATIC)
    assert static.select("u", [busy(A, 4, queued=3), refusing], 2, select_instance) == "a"
    assert static.select("u", [refusing], 2, select_instance) is None
    affinity, _ = router()
    affinity.finished("v", "a", last_turn=False)
    assert affinity.select("v", [replace(A, refusing=True), S], 2, select_instance) == "s"


def test_a_co_executor_that_gives_a_request_up_for_memory_is_held_like_a_refusal():
    control, clock = one_request_on("s", "serving")
    # It streams two tokens, then aborts the request to give its pages to serving.
    control.step_deltas("s", [TokenDelta("r0", 0, (5, 6), (0.0, 0.0), 0, True, "abort")])
    assert control.tracker.get("r0").token_ids == [5, 6]  # kept, to resume elsewhere
    clock.advance(0.1)
    assert not dispatched(control)
    clock.advance(0.2)
    assert dispatched(control) == [Dispatch("r0", "s")]


def test_a_worker_that_still_holds_a_migrated_request_is_not_sent_it_every_tick():
    control, clock = one_request_on("a", "gpu")
    control.tracker.release("r0")  # migrated away (its abort on a is queued behind a step)...
    assert dispatched(control) == [Dispatch("r0", "a")]
    # ... and sent straight back: a still holds it until its abort runs.
    control.command_refused("a", "r0", grpc.StatusCode.ALREADY_EXISTS.value[0], "already running")
    assert control.tracker.get("r0").worker_id is None
    for _ in range(4):  # before: dispatched to a and refused again every tick
        clock.advance(0.05)
        assert not dispatched(control)
    clock.advance(0.1)
    assert dispatched(control) == [Dispatch("r0", "a")]


def test_a_held_first_turn_holds_the_other_first_turns_but_not_a_turn_going_home():
    r, _ = router(TurnRouting.TURNWISE)
    calls: list[int] = []

    def counting(instances, theta):
        calls.append(len(instances))
        return select_instance(instances, theta)

    full = [busy(A, 4, queued=2), busy(B, 4, queued=2)]  # Θ pending on both: nothing fits
    assert r.dispatch([f"t{i}" for i in range(100)], lambda rid: rid, full, 2, counting) == []
    assert len(calls) == 1  # tried once, not once per waiting turn
    pinned, _ = router(TurnRouting.PINNED)
    pinned.dispatched("home", "a")
    # FIFO order: the pinned turn comes after two first turns that are held.
    placed = pinned.dispatch(["t0", "t1", "home"], lambda rid: rid, full, 2, counting)
    assert placed == [Dispatch("home", "a")]  # the held first turns did not hold it
