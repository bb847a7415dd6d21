"""RLBoost Algorithm 2 (§4.2.1): SELECTINSTANCE, CONTINUOUSLB and the batching plateau B."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlharvest.common import delta_batch
from rlharvest.services.rollout_manager.balancer import (
    InstanceLoad,
    LazyIds,
    continuous_lb,
    dispatch_waiting,
    queue_on,
    rebalance,
    select_instance,
)
from rlharvest.services.rollout_manager.batching_profile import (
    ProfileSamples,
    StepStats,
    ThroughputProfile,
    decode_sample,
)
from rlharvest.services.rollout_manager.commands import Dispatch, Fail, Migrate, Release
from rlharvest.services.rollout_manager.control_loop import ControlConfig, RolloutControl
from rlharvest.services.rollout_manager.failure import FailureConfig
from rlharvest.services.rollout_manager.tracker import RequestState, TokenDelta
from tests.builders import Clock, step


def inst(wid: str, capacity: int = 4, queued: int = 0, running: int = 0,
         plateau: int | None = None) -> InstanceLoad:
    return InstanceLoad(wid, capacity, tuple(f"{wid}-q{i}" for i in range(queued)),
                        tuple(f"{wid}-r{i}" for i in range(running)), plateau)


# ---- SELECTINSTANCE ---------------------------------------------------------------------------

def test_jsq_picks_the_instance_with_the_fewest_pending_requests():
    loads = [inst("a", capacity=2, running=2, queued=3), inst("b", capacity=2, running=2,
                                                              queued=1),
             inst("c", capacity=2, running=2, queued=2)]
    assert [i.pending for i in loads] == [3, 1, 2]
    assert select_instance(loads, theta=10) == "b"


def test_jsq_ties_go_to_the_instance_with_the_most_free_slots():
    loads = [inst("a", capacity=8, running=6), inst("b", capacity=8, running=1),
             inst("c", capacity=8, running=3)]
    assert select_instance(loads, theta=1) == "b"


def test_delayed_dispatch_holds_the_request_when_every_instance_has_theta_pending():
    loads = [inst("a", capacity=1, running=1, queued=2), inst("b", capacity=1, running=1,
                                                              queued=3)]
    assert select_instance(loads, theta=2) is None
    assert select_instance(loads, theta=3) == "a"


def test_theta_below_one_is_refused():
    with pytest.raises(ValueError, match="theta=0"):
        select_instance([inst("a")], theta=0)


@settings(max_examples=80, deadline=None)
@given(caps=st.lists(st.integers(1, 6), min_size=1, max_size=5),
       busy=st.lists(st.integers(0, 9), min_size=5, max_size=5),
       theta=st.integers(1, 4), waiting=st.integers(0, 40))
def test_dispatch_never_exceeds_theta_pending_and_always_joins_a_shortest_queue(
        caps, busy, theta, waiting):
    loads = {f"w{i}": inst(f"w{i}", capacity=c, running=busy[i]) for i, c in enumerate(caps)}
    ids = [f"r{i}" for i in range(waiting)]
    dispatches = dispatch_waiting(ids, list(loads.values()), theta)
    assert [d.request_id for d in dispatches] == ids[:len(dispatches)]  # in order, then held
    for d in dispatches:
        chosen = loads[d.worker_id]
        assert chosen.pending < theta
        assert chosen.pending == min(i.pending for i in loads.values())
        loads[d.worker_id] = InstanceLoad(chosen.worker_id, chosen.capacity,
                                          (*chosen.queued, d.request_id), chosen.running)
    if len(dispatches) < waiting:
        assert all(i.pending >= theta for i in loads.values())


def test_a_request_goes_only_where_the_reported_kv_room_holds_it_else_it_waits():
    # A co-executor (room 1000 tokens) and a full dedicated worker: a request the room cannot
    # hold would only be refused there, so it waits (FIFO: the ones behind it too).
    full = inst("a", capacity=1, running=1, queued=1)
    coexec = replace(inst("s", capacity=4), room_tokens=1000)
    need = {"small": 600, "second": 600, "big": 1200}.__getitem__
    assert dispatch_waiting(["small", "second"], [full, coexec], 1, need_of=need) == [
        Dispatch("small", "s")]  # the first took 600 of the 1000
    assert dispatch_waiting(["big", "small"], [full, coexec], 1, need_of=need) == []
    # Without sizes (a plain caller), the room is not consulted.
    assert dispatch_waiting(["big"], [full, coexec], 1) == [Dispatch("big", "s")]


# ---- CONTINUOUSLB: pending requests ------------------------------------------------------------

def test_pending_requests_migrate_one_at_a_time_from_the_most_loaded_instance():
    loads = [inst("a", capacity=2, running=2, queued=3), inst("b", capacity=2, running=2,
                                                              queued=1),
             inst("c", capacity=4, running=1)]
    moves = continuous_lb(loads)
    assert moves == [Migrate("a-q2", "a", "c", "pending")]  # the newest request of a's queue


def test_pending_migration_continues_until_the_receiver_is_saturated():
    loads = [inst("a", capacity=2, running=2, queued=6), inst("c", capacity=4, running=1)]
    moves = rebalance(loads, max_moves=100)
    assert len(moves) == 3  # c had three free slots
    assert all(m.src == "a" and m.dst == "c" and m.cause == "pending" for m in moves)


def test_a_single_pending_request_does_not_bounce_between_full_instances():
    loads = [inst("a", capacity=2, running=2, queued=1), inst("b", capacity=2, running=2)]
    assert rebalance(loads, max_moves=10) == []


def test_rebalance_respects_its_move_budget():
    loads = [inst("a", capacity=1, running=1, queued=9), inst("b", capacity=9)]
    assert len(rebalance(loads, max_moves=4)) == 4


def test_a_worker_pending_only_unmanaged_requests_is_skipped_as_a_migration_source():
    # A kv_memory worker whose pending requests are all another manager's: nothing to move.
    foreign = InstanceLoad("a", capacity=4, unmanaged=6)
    assert foreign.pending == 2
    assert rebalance([foreign, inst("b", capacity=8, running=1)], max_moves=64) == []


def test_pending_migration_moves_only_our_requests_then_stops_before_the_unmanaged_ones():
    # Three pending on "a", one of them ours: it moves, and the two unmanaged ones stay.
    loads = [InstanceLoad("a", capacity=4, queued=("q1",), unmanaged=6),
             inst("b", capacity=8, running=1)]
    assert rebalance(loads, max_moves=64) == [Migrate("q1", "a", "b", "pending")]


def test_a_busier_overloaded_worker_of_only_unmanaged_requests_does_not_hide_ours():
    loads = [InstanceLoad("foreign", capacity=2, unmanaged=9), inst("a", capacity=2, running=2,
                                                                     queued=1),
             inst("c", capacity=4)]
    assert continuous_lb(loads) == [Migrate("a-q0", "a", "c", "pending")]


# ---- CONTINUOUSLB: executing requests down to the plateau -------------------------------------

def test_executing_requests_migrate_from_the_busiest_instance_down_to_the_plateau():
    loads = [inst("a", capacity=16, running=12, plateau=5), inst("b", capacity=16, running=3,
                                                                 plateau=5),
             inst("idle", capacity=16)]
    moves = continuous_lb(loads)
    assert len(moves) == 7  # 12 - B
    assert {m.src for m in moves} == {"a"} and {m.dst for m in moves} == {"idle"}
    assert all(m.cause == "executing" for m in moves)
    assert [m.request_id for m in moves] == [f"a-r{i}" for i in range(7)]  # in the given order


def test_executing_requests_stay_when_the_batch_is_below_the_plateau():
    loads = [inst("a", capacity=16, running=5, plateau=5), inst("idle", capacity=16)]
    assert continuous_lb(loads) == []


def test_no_executing_migration_before_a_profile_exists():
    loads = [inst("a", capacity=16, running=12, plateau=None), inst("idle", capacity=16)]
    assert continuous_lb(loads) == []


def test_executing_migration_is_capped_by_the_idle_instance_capacity():
    loads = [inst("a", capacity=32, running=30, plateau=2), inst("idle", capacity=4)]
    assert len(continuous_lb(loads)) == 4


def test_executing_migration_takes_from_the_busiest_worker_that_runs_requests_of_ours():
    loads = [InstanceLoad("foreign", capacity=16, unmanaged=14, plateau=5),
             inst("a", capacity=16, running=8, plateau=5), inst("idle", capacity=16)]
    moves = continuous_lb(loads)
    assert [m.request_id for m in moves] == ["a-r0", "a-r1", "a-r2"]  # 8 - B
    assert {m.src for m in moves} == {"a"}


def test_executing_migration_waits_while_anything_is_pending():
    loads = [inst("a", capacity=2, running=2, queued=1, plateau=1), inst("b", capacity=2,
                                                                         running=2),
             inst("idle", capacity=4)]
    assert [m.cause for m in continuous_lb(loads)] == ["pending"]


# ---- how a worker admits: fixed slots or KV memory ----------------------------------------------

def dispatched(commands) -> dict[str, str]:
    return {c.request_id: c.worker_id for c in commands if isinstance(c, Dispatch)}


@pytest.mark.parametrize("admission", ["slots", "kv_memory"])
def test_a_worker_reporting_a_queue_gets_no_new_request_only_when_it_admits_by_kv_memory(
        admission):
    control = RolloutControl(ControlConfig(theta=1), Clock())
    control.worker_joined("w", 0, capacity=64, kind="k", admission=admission)
    control.worker_load("w", pending=2, executing=5)  # its KV cache is full: two queue there
    control.add_step("s", step(2), 0)
    if admission == "slots":  # 64 slots, none used by the manager: the report is not read
        assert dispatched(control.tick()) == {"r0": "w", "r1": "w"}
    else:  # Θ = 1 pending already: held (delayed dispatch) until the queue drains
        assert dispatched(control.tick()) == {}
        control.worker_load("w", pending=0, executing=5)
        assert dispatched(control.tick()) == {"r0": "w", "r1": "w"}


def test_requests_sent_since_a_kv_memory_workers_report_count_as_queued_there():
    control = RolloutControl(ControlConfig(theta=2), Clock())
    control.worker_joined("kv", 0, capacity=64, kind="k", admission="kv_memory")
    control.worker_joined("slots", 0, capacity=1, kind="k")
    control.worker_load("kv", pending=1, executing=3)  # full at 3: what comes next queues
    control.add_step("s", step(5), 0)
    # kv has one pending and takes one more to reach Θ; slots takes one into its slot and then
    # pending ones while it has fewer than Θ. The fifth request waits.
    assert sorted(dispatched(control.tick()).values()) == ["kv", "slots", "slots", "slots"]
    assert [r.request_id for r in control.tracker.waiting()] == ["r4"]


@pytest.mark.parametrize("admission", ["slots", "kv_memory"])
def test_a_kv_memory_workers_reported_queue_migrates_to_an_idle_worker(admission):
    control = RolloutControl(ControlConfig(theta=100), Clock())
    control.worker_joined("busy", 0, capacity=16, kind="k", admission=admission)
    control.add_step("s", step(8), 0)
    control.tick()
    for i in range(8):
        control.step_deltas("busy", [TokenDelta(f"r{i}", 0, (5,), (0.0,), 0)])
    control.worker_load("busy", pending=3, executing=5)  # memory for five: three queue there
    control.worker_joined("idle", 0, capacity=16, kind="k")
    moves = [c for c in control.tick() if isinstance(c, Migrate)]
    if admission == "slots":  # eight of sixteen slots: nothing queues, and no P yet
        assert moves == []
    else:  # its three queued ones, one at a time as CONTINUOUSLB's pending case says
        assert len(moves) == 3
        assert all(m.src == "busy" and m.dst == "idle" and m.cause == "pending" for m in moves)


def test_a_tick_survives_a_kv_memory_worker_queueing_only_requests_of_other_managers():
    control = RolloutControl(ControlConfig(theta=100), Clock())
    control.worker_joined("shared", 0, capacity=16, kind="k", admission="kv_memory")
    control.worker_load("shared", pending=2, executing=4)  # none of them ours
    control.worker_joined("ours", 0, capacity=16, kind="k")
    control.add_step("s", step(1), 0)
    control.tick()  # r0 goes to "ours": "shared" already queues
    assert [c for c in control.tick() if isinstance(c, Migrate)] == []


def test_an_unknown_admission_is_refused_with_the_ones_the_manager_knows():
    control = RolloutControl(ControlConfig(), Clock())
    with pytest.raises(ValueError, match="admission 'paged'.*slots and kv_memory"):
        control.worker_joined("w", 0, capacity=4, kind="k", admission="paged")


# ---- the batching plateau B -------------------------------------------------------------------

def decode_throughput(batch: int, context: float) -> float:
    """Roofline decode step: reading the weights bounds small batches; past the knee the batch's
    KV reads (batch * context tokens) take longer and throughput stops growing."""
    return batch / max(0.02, 2e-6 * batch * context)


def captured_profile(context: float, epsilon: float = 0.1) -> ThroughputProfile:
    samples = ProfileSamples()
    for b in range(1, 65):
        samples.record(b, decode_throughput(b, context), context)
    profile = ThroughputProfile(epsilon=epsilon, min_samples=1)
    profile.freeze(samples)
    return profile


def test_there_is_no_plateau_before_a_step_has_been_captured():
    profile = ThroughputProfile()
    ProfileSamples().record(8, 100.0, 300.0)
    assert profile.plateau(300.0) is None


def test_plateau_is_the_smallest_batch_within_epsilon_of_the_best_throughput():
    samples = ProfileSamples()
    for batch, tput in {1: 10.0, 2: 19.0, 4: 30.0, 8: 37.0, 16: 40.0, 32: 41.0}.items():
        samples.record(batch, tput, 100.0)
    profile = ThroughputProfile(epsilon=0.1, min_samples=1)
    profile.freeze(samples)
    assert profile.plateau(100.0) == 8  # 37 >= 0.9 * 41, 30 is not


def test_plateau_is_calibrated_to_the_current_context_length():
    profile = captured_profile(context=500.0)
    at_500, at_1000, at_2000 = (profile.plateau(c) for c in (500.0, 1000.0, 2000.0))
    assert at_500 > at_1000 > at_2000
    # Against the plateau measured directly at 1000 tokens of context:
    direct = captured_profile(context=1000.0).plateau(1000.0)
    assert abs(at_1000 - direct) <= 1
    assert abs(at_2000 - at_500 / 4) <= 1


def test_batch_sizes_seen_too_rarely_do_not_shape_the_profile():
    samples = ProfileSamples()
    for _ in range(3):
        samples.record(4, 100.0, 200.0)
    samples.record(2, 1000.0, 200.0)  # one noisy sample
    profile = ThroughputProfile(epsilon=0.1, min_samples=3)
    profile.freeze(samples)
    assert profile.plateau(200.0) == 4


def test_a_step_without_enough_samples_keeps_the_previous_profile():
    profile = captured_profile(context=500.0)
    before = profile.plateau(500.0)
    assert not profile.freeze(ProfileSamples())
    assert profile.plateau(500.0) == before


@pytest.mark.parametrize("stats, sample", [
    (StepStats(8, 0.5, 8, 0), (8, 16.0)),
    (StepStats(8, 0.5, 16, 3), (8, 32.0)),  # a light prefill leaves a decode step a sample
    (StepStats(8, 0.5, 8, 9), None),  # more prefilled than decoded: the prefill's time
    (StepStats(0, 0.5, 0, 0), None),  # idle
    (StepStats(8, 0.0, 8, 0), None),  # unmeasured
])
def test_an_engine_step_is_a_decode_sample_unless_idle_unmeasured_or_prefill_heavy(stats, sample):
    assert decode_sample(stats) == sample


def test_epsilon_outside_zero_one_is_refused():
    with pytest.raises(ValueError, match="epsilon=1.0"):
        ThroughputProfile(epsilon=1.0)


# ---- the manager loop: on-policy under random events -------------------------------------------

def token_at(request_id: str, position: int, version: int) -> int:
    """What a worker holding ``version`` generates; wrong-version tokens would show."""
    return 3 + (hash(request_id) + 31 * position + 1009 * version) % 120


class FakeWorkers:
    """Workers as the manager sees them through commands and step outputs (not our code). Each
    names a request's rows by the handle of the add that brought it there, as a worker does."""

    def __init__(self, control: RolloutControl) -> None:
        self.control = control
        self.version: dict[str, int] = {}
        # worker -> request -> (next position, the handle of its dispatch there)
        self.position: dict[str, dict[str, tuple[int, int]]] = defaultdict(dict)
        self.late: dict[str, dict[str, tuple[int, int]]] = defaultdict(dict)  # one step due
        self.finished: list[str] = []

    def execute(self, commands) -> None:
        for c in commands:
            if isinstance(c, (Dispatch, Migrate)):
                dst = c.worker_id if isinstance(c, Dispatch) else c.dst
                r = self.control.tracker.get(c.request_id)
                assert self.version[dst] == r.weight_version, "dispatched to a wrong version"
                assert self.control.pool.get(dst).eligible_for(r.weight_version)
                if isinstance(c, Migrate):
                    self._abort(c.src, c.request_id)
                payload = self.control.tracker.resume_payload(c.request_id)
                self.position[dst][c.request_id] = (len(payload.generated_token_ids),
                                                    payload.handle)
            elif isinstance(c, Release):
                self._abort(c.worker_id, c.request_id)
            elif isinstance(c, Fail):
                raise AssertionError(f"request failed: {c.reason}")

    def _abort(self, worker: str, request_id: str) -> None:
        held = self.position[worker].pop(request_id, None)
        if held is not None:
            self.late[worker][request_id] = held

    def step(self, worker: str, tokens: int) -> None:
        rows = []
        late = self.late.pop(worker, {})
        late_rows: set[tuple[int, int]] = set()  # (handle, position) sent after a move
        for held in (self.position[worker], late):
            for rid, (pos, handle) in list(held.items()):
                r = self.control.tracker.get(rid)
                n = min(tokens, r.sampling.max_tokens - pos)
                ids = [token_at(rid, p, self.version[worker]) for p in range(pos, pos + n)]
                done = pos + n >= r.sampling.max_tokens
                rows.append((handle, pos, ids, [0.0] * n, "length" if done else ""))
                if held is late:
                    late_rows.add((handle, pos))
                else:
                    held[rid] = (pos + n, handle)
                    if done:
                        del held[rid]
        report = self.control.step_outputs(worker, delta_batch.build(rows, self.version[worker]))
        # A worker the request has left may still send its in-flight step: never appended.
        accepted = zip(report.accepted.requests.tolist(), report.accepted.positions.tolist())
        assert not late_rows & set(accepted), "stale tokens appended"
        self.finished += report.finished

    def kill(self, worker: str) -> None:
        self.position.pop(worker, None)
        self.late.pop(worker, None)


EVENTS = st.lists(st.tuples(
    st.sampled_from(["join", "kill", "drain", "version", "step", "tick", "wait"]),
    st.integers(0, 5), st.integers(1, 2)), max_size=60)


@settings(max_examples=60, deadline=None)
@given(events=EVENTS, n_requests=st.integers(1, 12), lengths=st.lists(
    st.integers(1, 12), min_size=12, max_size=12))
def test_every_request_finishes_once_on_its_version_with_contiguous_tokens(
        events, n_requests, lengths):
    clock = Clock()
    control = RolloutControl(ControlConfig(theta=1, failure=FailureConfig(
        stall_timeout_s=5.0, no_worker_timeout_s=1e9)), clock)
    workers = FakeWorkers(control)
    step_version = 1
    control.add_step("s", step(n_requests, prompts=((1, 2),), max_tokens=lengths[:n_requests],
                               version=step_version), step_version, announced_version=1)
    alive: set[str] = set()
    for kind, w, arg in events:
        wid = f"w{w}"
        if kind == "join" and wid not in alive:
            control.worker_joined(wid, arg, capacity=w % 3 + 1, kind="k")
            workers.version[wid] = arg
            alive.add(wid)
        elif kind == "kill" and wid in alive:
            workers.execute(control.worker_lost(wid, "stream broke"))
            workers.kill(wid)
            alive.discard(wid)
        elif kind == "drain" and wid in alive:
            workers.execute(control.worker_draining(wid, deadline=clock.now + arg))
        elif kind == "version" and wid in alive:
            workers.version[wid] = arg  # it loaded another version: its commands change too
            workers.execute(control.worker_version_changed(wid, arg))
        elif kind == "step" and wid in alive:
            workers.step(wid, arg)
        elif kind == "tick":
            workers.execute(control.tick())
        elif kind == "wait":
            clock.now += arg * 3.0
            workers.execute(control.tick())
            alive = {x for x in alive if control.pool.get(x).state.value != "lost"}
    # Bring up a healthy worker of the step's version and run to completion.
    control.worker_joined("final", step_version, capacity=4, kind="k")
    workers.version["final"] = step_version
    alive.add("final")
    for _ in range(200):
        if not control.tracker.unfinished():
            break
        workers.execute(control.tick())
        for wid in sorted(alive):
            if control.pool.get(wid).state.value != "lost":
                workers.step(wid, 2)
        clock.now += 0.1
    ids = [f"r{i}" for i in range(n_requests)]
    assert sorted(workers.finished) == sorted(ids)  # each finished exactly once
    for rid, length in zip(ids, lengths):
        r = control.tracker.get(rid)
        assert r.state is RequestState.FINISHED
        assert r.token_ids == [token_at(rid, p, step_version) for p in range(length)]
    assert control.tracker.counters.tokens_regenerated == 0


def test_lazy_ids_count_at_once_and_read_out_once_where_used():
    reads: list[str] = []

    def fill(worker_id: str) -> tuple[str, ...]:
        reads.append(worker_id)
        return ("r0", "r1")

    load = InstanceLoad("w", 4, queued=LazyIds(2, fill, "w"))
    assert (load.assigned, load.pending, load.free_slots, reads) == (2, 0, 2, [])
    assert (load.queued[-1], list(load.queued), "r0" in load.queued) == ("r1", ["r0", "r1"], True)
    assert reads == ["w"] and load.queued == ("r0", "r1")
    assert queue_on(load, "r2").queued == ("r0", "r1", "r2")
