"""The manager's side of RollPacker's stream-trainer scaling: what it feeds the decision
(stream_accounting.py), the lending of workers to training on the core, and StreamScaler's
per-step life (stream_scaler.py)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import pytest

from rlharvest.common import keys
from rlharvest.services.rollout_manager.commands import Dispatch, Migrate, Release
from rlharvest.services.rollout_manager.control_loop import ControlConfig, RolloutControl
from rlharvest.services.rollout_manager.step import Step
from rlharvest.services.rollout_manager.stream_accounting import (
    candidates,
    kv_view,
    parse_scale_record,
    scale_record,
    scaling_history,
    step_max_tokens,
)
from rlharvest.services.rollout_manager.stream_scaler import ScalePublisher, StreamScaler
from rlharvest.services.rollout_manager.stream_scaling import (
    RemainingRequest,
    ScaleDown,
    StreamScaling,
    WorkerKV,
)
from rlharvest.services.rollout_manager.tracker import (
    RequestTracker,
    StepLimits,
    TokenDelta,
    TrackedRequest,
)
from rlharvest.services.rollout_manager.worker_pool import WorkerPool, WorkerState, WorkerView
from tests.builders import Clock, request, step

# ---- stream_accounting: the decision's inputs ---------------------------------------------------


def tracked(rid: str, prompt: int, output: int, worker: str | None,
            done: bool = False) -> TrackedRequest:
    r = request(rid, prompt=(1,) * prompt, max_tokens=100)
    tracker = RequestTracker(StepLimits(), lambda: 0.0)
    tracker.add_step([replace(r, resume_token_ids=(7,) * output,
                              resume_logprobs=(0.0,) * output)])
    t = tracker.get(rid)
    t.worker_id = worker
    if done:
        t.state = t.state.FINISHED
    return t


def view_of(wid: str, kind: str = "dedicated", kv: int = 1000) -> WorkerView:
    return WorkerView(wid, 0, 4, kind, 0.0, 0.0, kv_capacity_tokens=kv)


def test_the_step_max_tokens_is_the_largest_of_its_requests():
    assert step_max_tokens([4, 150, 4]) == 150


def test_without_a_previous_step_every_request_is_predicted_at_max_tokens():
    assert scaling_history([], 150) == [150]
    assert scaling_history([0, 0], 150) == [150]  # empty responses say nothing of lengths
    assert scaling_history([4, 0, 9], 150) == [4, 9]


def test_candidates_are_the_jobs_own_workers_with_a_known_kv_capacity():
    # Serving co-executors are the serving fleet's; seed workers are lent by their own window.
    workers = [view_of("w0"), view_of("co", kind="serving"), view_of("new", kv=0),
               view_of("spot", kind="spot", kv=64), view_of("seed", kind="seed", kv=32)]
    assert candidates(workers) == {"w0": 1000, "spot": 64}


def test_the_view_puts_each_remaining_request_on_its_candidate_or_waiting_once():
    remaining = [tracked("a", 5, 3, "w0"), tracked("b", 4, 0, "w1"), tracked("c", 2, 2, None),
                 tracked("d", 6, 1, "co"),  # on a worker that is no candidate: waiting
                 tracked("e", 6, 9, "w0", done=True)]  # finished, completion not delivered
    view = kv_view(10, remaining, {"w1": 500, "w0": 1000, "idle": 300}, {"w1": 200, "idle": 400})
    assert view.completed == 6  # 10 - a, b, c, d
    assert view.workers == (
        WorkerKV("idle", 1, ()),  # other steps hold more than its capacity: at least 1 token
        WorkerKV("w0", 1000, (RemainingRequest(5, 3),)),
        WorkerKV("w1", 300, (RemainingRequest(4, 0),)))
    assert view.waiting == (RemainingRequest(2, 2), RemainingRequest(6, 1))
    # It is what the decision accepts: every remaining request exactly once.
    StreamScaling(10, [5], 100).observe(view.completed, view.workers, view.waiting)


def test_a_view_with_more_remaining_than_the_step_has_is_refused():
    with pytest.raises(ValueError, match="3 requests remain of a step of 2"):
        kv_view(2, [tracked(x, 1, 0, None) for x in "abc"], {})


def test_the_record_says_what_was_lent_and_parses_back():
    decision = ScaleDown(25, ("w0", "w2"), ("w1", "w3"), 900, 2048, 1843)
    raw = scale_record(decision, job="j", manager_id="m", step_id="s7", state="lent",
                       completed=4, total=16, quantile=0.9, headroom=0.1, decided_unix=5.0,
                       returned_unix=None, updated_unix=5.0)
    record = parse_scale_record(raw)
    assert record == {
        "job": "j", "manager": "m", "step_id": "s7", "state": "lent", "milestone_percent": 25,
        "completed": 4, "total": 16, "drained": ["w0", "w2"], "kept": ["w1", "w3"],
        "projected_peak_tokens": 900, "capacity_tokens": 2048, "usable_tokens": 1843,
        "quantile": 0.9, "headroom": 0.1, "decided_unix": 5.0, "returned_unix": None,
        "updated_unix": 5.0}
    assert parse_scale_record(None) is None
    for bad in (b"{", b"[]", json.dumps({"state": "lent"}).encode()):
        with pytest.raises(ValueError):
            parse_scale_record(bad)


def test_the_key_is_per_job():
    assert keys.stream_scale_key("j1") == "/rlharvest/v1/jobs/j1/stream_scale"
    with pytest.raises(ValueError):
        keys.stream_scale_key("a/b")


# ---- StreamScaling.due: when the manager gathers the state ------------------------------------

def test_due_is_true_exactly_where_observe_would_evaluate():
    s = StreamScaling(20, [5], 10)
    tight = [WorkerKV("a", 1, ()), WorkerKV("b", 1, ())]  # no projection fits: never decides
    for completed in range(21):
        before = len(s.evaluations)
        due = s.due(completed)
        remaining = [RemainingRequest(1, 0)] * (20 - completed)
        s.observe(completed, tight, remaining)
        assert due == (len(s.evaluations) > before), completed
    assert [e.completed for e in s.evaluations] == [4, 5, 6, 7, 8, 9, 10]
    assert s.settled(11) and not s.settled(10)


# ---- the pool and the core: a worker lent to training ----------------------------------------

def test_a_lent_worker_takes_no_work_until_it_returns_and_a_drain_notice_wins():
    pool = WorkerPool(Clock())
    pool.join("w", 0, 4, "dedicated")
    assert pool.lend_to_training("w") and pool.get("w").state is WorkerState.TRAINING
    assert pool.eligible(0) == [] and pool.lent_to_training() == ["w"]
    assert not pool.lend_to_training("w")  # lent already
    assert pool.return_from_training("w") and pool.eligible(0) == [pool.get("w")]
    assert not pool.return_from_training("w") and not pool.return_from_training("gone")
    pool.lend_to_training("w")
    pool.mark_draining("w", 10.0)  # SIGTERM while lent: it drains and never comes back
    assert pool.get("w").state is WorkerState.DRAINING
    assert not pool.return_from_training("w")


def test_a_lent_spot_worker_keeps_its_place_under_the_instance_cap():
    clock = Clock()
    pool = WorkerPool(clock)
    for i in range(2):
        pool.join(f"spot{i}", 0, 4, "spot")
        clock.advance(1)
    pool.set_instance_cap(1)
    assert pool.standby() == {"spot1"}
    pool.lend_to_training("spot0")
    assert pool.standby() == {"spot1"}  # lending spot0 does not wake spot1


def test_the_kv_capacity_comes_from_the_load_reports():
    control = RolloutControl(ControlConfig(), Clock())
    control.worker_joined("w", 0, capacity=4, kind="dedicated")
    control.worker_load("w", 0, 0, 2048)
    control.worker_load("w", 1, 2)  # a report without it keeps the last one
    assert control.pool.get("w").kv_capacity_tokens == 2048


# ---- StreamScaler on the core -----------------------------------------------------------------

class Published:
    def __init__(self) -> None:
        self.records: list[dict] = []

    def publish(self, record: bytes) -> None:
        self.records.append(json.loads(record))


def make(workers: int = 2, kv: int = 10_000, theta: int = 8, headroom: float = 0.0):
    clock = Clock(100.0)
    control = RolloutControl(ControlConfig(theta=theta), clock)
    for i in range(workers):
        control.worker_joined(f"w{i}", 0, capacity=4, kind="dedicated")
        control.worker_load(f"w{i}", 0, 0, kv)
    published = Published()
    scaler = StreamScaler(control, published, job="j", manager_id="m",  # type: ignore[arg-type]
                          headroom=headroom, clock=clock)
    return control, scaler, published


def start(control: RolloutControl, scaler: StreamScaler, n: int, max_tokens,
          prefix: str = "r") -> Step:
    s = control.add_step("s", step(n, max_tokens=max_tokens, prefix=prefix), 0)
    scaler.step_started(s)
    control.tick()
    return s


def emit(control: RolloutControl, rid: str, count: int) -> None:
    req = control.tracker.get(rid)
    assert req.worker_id is not None
    control.step_deltas(req.worker_id, [TokenDelta(rid, len(req.token_ids), (5,) * count,
                                                    (0.0,) * count, 0)])


def finish(control: RolloutControl, scaler: StreamScaler, s: Step, rid: str) -> Step | None:
    """Run ``rid`` to its max_tokens and deliver it, as the service does."""
    req = control.tracker.get(rid)
    while req.worker_id is None:  # released by a lending: waits for room
        control.tick()
    emit(control, rid, req.sampling.max_tokens - len(req.token_ids))
    ended = control.deliver(rid)
    if ended is None:
        scaler.progressed(s)
    return ended


def test_at_a_milestone_the_least_loaded_half_is_lent_and_holds_nothing():
    control, scaler, published = make(workers=4)
    s = start(control, scaler, 20, max_tokens=[2] * 4 + [30] * 16)
    for rid in ("r4", "r5", "r6", "r7"):  # some progress, so that the loads differ
        emit(control, rid, 3)
    for rid in ("r0", "r1", "r2"):
        finish(control, scaler, s, rid)
    assert scaler.run_due() == []  # 15%: no milestone yet
    emit(control, "r3", 2)
    assert control.deliver("r3") is None
    assert scaler.progressed(s)  # 4 of 20: the 20% milestone
    tokens_before = {r.request_id: list(r.token_ids) for r in control.tracker.all()}
    commands = scaler.run_due()
    [decision] = scaler.decisions
    assert decision.milestone_percent == 20 and len(decision.drain) == 2
    for wid in decision.drain:
        assert control.pool.get(wid).state is WorkerState.TRAINING
        assert control.tracker.assigned_count(wid) == 0  # nothing left on it
    assert commands and all(isinstance(c, (Migrate, Release)) and c.cause == "scale_down"
                            for c in commands)
    assert all(c.dst in decision.keep for c in commands if isinstance(c, Migrate))
    # Token-level migration: every request keeps its tokens, nothing is regenerated.
    assert {r.request_id: list(r.token_ids) for r in control.tracker.all()} == tokens_before
    assert control.tracker.counters.tokens_regenerated == 0
    # The lent workers take nothing, from any step, while the step runs.
    later = control.add_step("other", step(8, prefix="o"), 0)
    placed = control.tick()
    assert not any(isinstance(c, Dispatch) and c.worker_id in decision.drain for c in placed)
    assert published.records[-1]["state"] == "lent"
    assert published.records[-1]["drained"] == list(decision.drain)
    assert published.records[-1]["kept"] == list(decision.keep)
    assert published.records[-1]["completed"] == 4 and published.records[-1]["total"] == 20
    # The step ends: the lent workers are rollout workers again.
    control.abandon_step(later)
    ended = None
    for rid in [r for r in s.request_ids if r in s.outstanding]:
        ended = finish(control, scaler, s, rid)
    assert ended is s
    assert sorted(scaler.step_ended(s, [2] * 4 + [30] * 16)) == sorted(decision.drain)
    assert all(control.pool.get(w).state is WorkerState.HEALTHY for w in decision.drain)
    assert published.records[-1]["state"] == "returned"
    assert published.records[-1]["returned_unix"] == 100.0
    assert scaler.history == [2] * 4 + [30] * 16
    assert scaler.step_ended(s, None) == []  # again (the stream's end): nothing more
    # The next step runs on every worker again.
    nxt = start(control, scaler, 8, max_tokens=4, prefix="n")
    assert {control.tracker.get(r).worker_id for r in nxt.request_ids} >= set(decision.drain)


def test_the_first_step_predicts_max_tokens_and_the_next_one_its_history():
    def run(scaler: StreamScaler, control: RolloutControl, prefix: str) -> Step:
        s = start(control, scaler, 10, max_tokens=[2, 2] + [200] * 8, prefix=prefix)
        for rid in (f"{prefix}0", f"{prefix}1"):
            finish(control, scaler, s, rid)
        scaler.run_due()  # 20%
        return s

    # 2 workers of 1000 KV tokens: 8 remaining requests at 200 tokens do not fit on one.
    control, scaler, _ = make(workers=2, kv=1000)
    first = run(scaler, control, "a")
    assert scaler.decisions == []
    control.abandon_step(first)
    scaler.step_ended(first, None)
    assert scaler.history == []  # an abandoned step is no history
    scaler.step_ended(first, [2, 2, 3, 2, 4, 2, 2, 3, 2, 2])  # as if it had finished so
    run(scaler, control, "b")  # remaining ones predicted at 4 tokens: they fit
    assert [d.milestone_percent for d in scaler.decisions] == [20]


def test_a_step_that_was_not_started_is_never_scaled():
    control, scaler, _ = make()
    s = control.add_step("g", step(1), 0)  # a single Generate: the service does not start it
    control.tick()
    finish(control, scaler, s, "r0")
    assert not scaler.progressed(s) and scaler.run_due() == []


def test_a_step_on_one_worker_never_scales():
    control, scaler, _ = make(workers=1)
    s = start(control, scaler, 10, max_tokens=2)
    for rid in ("r0", "r1", "r2", "r3", "r4"):
        finish(control, scaler, s, rid)
        assert scaler.run_due() == []
    assert scaler.decisions == []


# ---- the etcd side: never blocks, survives an outage --------------------------------------------

class FlakyEtcd:
    def __init__(self) -> None:
        self.down = True
        self.values: dict[bytes, bytes] = {}

    async def put(self, key: bytes, value: bytes) -> None:
        if self.down:
            raise ConnectionError("etcd unavailable")
        self.values[key] = value


async def test_the_publisher_retries_with_the_newest_record_after_an_outage():
    etcd = FlakyEtcd()
    publisher = ScalePublisher(etcd, job="j", retry_s=0.01)
    task = asyncio.get_running_loop().create_task(publisher.run())
    publisher.publish(b'{"state": "lent"}')  # returns at once: the caller never waits
    await asyncio.sleep(0.05)
    assert etcd.values == {} and publisher.written == 0
    publisher.publish(b'{"state": "returned"}')
    etcd.down = False
    for _ in range(100):
        if publisher.written:
            break
        await asyncio.sleep(0.01)
    assert etcd.values == {keys.stream_scale_key("j").encode(): b'{"state": "returned"}'}
    assert publisher.written == 1
    task.cancel()
