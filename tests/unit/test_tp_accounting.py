"""What the manager feeds RollPacker's TP planner (rlharvest/services/rollout_manager/tp_accounting.py):
preemption deltas from the workers' totals (across restarts), per-step windows, round kinds, and
the etcd record (tp_publisher.py): published without blocking, kept through an etcd outage,
resumed by a restarted manager."""

from __future__ import annotations

import asyncio
import json

import pytest

from rlharvest.common import keys
from rlharvest.services.rollout_manager.tp_accounting import (
    LENGTH_BUCKET_TOKENS,
    PreemptionTally,
    parse_plan_record,
    plan_record,
    round_kind,
    step_histogram,
)
from rlharvest.services.rollout_manager.tp_planner import TpPlan, TpPlanner
from rlharvest.services.rollout_manager.tp_publisher import TpPublisher

# --- preemption deltas ------------------------------------------------------------------------


def test_a_workers_first_total_is_its_baseline_then_increases_count():
    tally = PreemptionTally()
    assert tally.report("w0", 40) == 0  # e.g. a manager restarted next to a running worker
    assert tally.report("w0", 40) == 0
    assert tally.report("w0", 47) == 7
    assert tally.report("w1", 0) == 0
    assert tally.report("w1", 3) == 3
    assert tally.seen == 10


def test_a_total_that_went_down_is_a_restarted_worker_and_counts_its_new_total():
    tally = PreemptionTally()
    tally.report("w0", 0)
    tally.report("w0", 12)
    assert tally.report("w0", 5) == 5  # a new process: 5 since its start
    assert tally.report("w0", 5) == 0
    assert tally.report("w0", 0) == 0  # restarted again, nothing yet
    assert tally.report("w0", 2) == 2
    assert tally.seen == 12 + 5 + 2


def test_a_step_counts_the_sum_of_the_workers_increases_while_it_ran():
    tally = PreemptionTally()
    tally.report("w0", 100)
    tally.report("w1", 0)
    tally.report("w1", 4)  # before the step: not its own
    tally.open("a")
    tally.report("w0", 103)
    tally.report("w1", 2)  # w1 restarted during the step: its 2 count
    tally.open("b")  # overlapping steps both count what happened while both ran
    tally.report("w0", 110)
    assert tally.close("a") == 3 + 2 + 7
    tally.report("w1", 5)
    assert tally.close("b") == 7 + 3
    assert tally.close("a") is None  # closed once


def test_an_abandoned_step_is_dropped():
    tally = PreemptionTally()
    tally.open(1)
    tally.drop(1)
    tally.drop(1)
    assert tally.close(1) is None


def test_negative_totals_are_refused():
    with pytest.raises(ValueError, match="cannot be negative"):
        PreemptionTally().report("w0", -1)


def test_round_kinds_and_length_histograms():
    assert round_kind(True) == "short" and round_kind(False) == "long"
    assert step_histogram([]) is None
    assert step_histogram([1, 64, 65, 0]) == {LENGTH_BUCKET_TOKENS: 3, 2 * LENGTH_BUCKET_TOKENS: 1}


# --- the record --------------------------------------------------------------------------------


def test_the_record_is_a_plan_with_the_planner_state_a_new_planner_resumes():
    planner = TpPlanner(8, 1)
    planner.observe("long", 3)
    planner.observe("long", 9)  # a rise: long TP 1 -> 2
    raw = plan_record(planner, job="j", manager_id="m0", steps=2, last_step=None,
                      updated_unix=5.0)
    data = json.loads(raw)
    assert TpPlan.from_json(data) == TpPlan(1, 2, planner.published().reason)
    assert (data["job"], data["manager"], data["steps"], data["gpus_per_node"]) == ("j", "m0", 2, 8)
    record = parse_plan_record(raw)
    assert record is not None and record.steps == 2 and record.state is not None
    resumed = TpPlanner(8, 1)
    resumed.load_state_dict(record.state)
    assert resumed.published() == planner.published()
    assert resumed.observe("long", 9 * 2).tp_after == 4  # the baseline (9) came back too


def test_parsing_absent_and_malformed_records():
    assert parse_plan_record(None) is None
    for raw in (b"{", b"[1]", b'{"short_tp": 3, "long_tp": 1, "reason": ""}'):
        with pytest.raises(ValueError):
            parse_plan_record(raw)


# --- the publisher (a fake etcd) ----------------------------------------------------------------


class FakeEtcd:
    def __init__(self) -> None:
        self.data: dict[bytes, bytes] = {}
        self.down = False

    async def get(self, key: bytes):
        if self.down:
            raise ConnectionError("etcd down")
        value = self.data.get(key)
        return None if value is None else type("KV", (), {"value": value})()

    async def put(self, key: bytes, value: bytes) -> None:
        if self.down:
            raise ConnectionError("etcd down")
        self.data[key] = value


KEY = keys.tp_plan_key("j").encode()


def _publisher(etcd: FakeEtcd) -> TpPublisher:
    return TpPublisher(etcd, TpPlanner(8, 1), job="j", manager_id="m0", clock=lambda: 1.0)


async def test_a_finished_step_is_written_in_the_background_and_survives_an_outage():
    etcd = FakeEtcd()
    pub = _publisher(etcd)
    decision = pub.step_ended("s1", "long", 4, [10, 70])  # synchronous: never waits for etcd
    assert decision.tp_after == 1 and KEY not in etcd.data
    assert await pub.flush()
    first = json.loads(etcd.data[KEY])
    assert (first["long_tp"], first["steps"], first["last_step"]["preemptions"]) == (1, 1, 4)
    assert first["last_step"]["responses"] == 2 and first["last_step"]["kind"] == "long"

    etcd.down = True
    pub.step_ended("s2", "long", 9, [10])  # a rise: long TP 2
    assert not await pub.flush()  # logged; stays pending
    assert json.loads(etcd.data[KEY])["steps"] == 1
    etcd.down = False
    pub.step_ended("s3", "short", 0, [])  # the next step writes, with everything since
    runner = asyncio.create_task(pub.run())
    for _ in range(100):
        if json.loads(etcd.data[KEY])["steps"] == 3:
            break
        await asyncio.sleep(0.01)
    runner.cancel()
    last = json.loads(etcd.data[KEY])
    assert (last["short_tp"], last["long_tp"], last["steps"]) == (1, 2, 3)


async def test_a_restarted_manager_resumes_the_stored_planner():
    etcd = FakeEtcd()
    pub = _publisher(etcd)
    pub.step_ended("s1", "long", 1, [5])
    pub.step_ended("s2", "long", 8, [5])
    await pub.flush()
    again = _publisher(etcd)
    assert await again.load()
    assert again.planner.plan("long") == 2 and again.steps == 2


async def test_an_unusable_record_or_etcd_outage_starts_fresh():
    etcd = FakeEtcd()
    etcd.data[KEY] = b'{"short_tp": 1, "long_tp": 1, "reason": "x"}'  # no state
    assert not await _publisher(etcd).load()
    planner = TpPlanner(16, 16)
    etcd.data[KEY] = plan_record(planner, job="j", manager_id="m0", steps=1, last_step=None,
                                 updated_unix=0.0)  # TP 16 does not fit 8 GPUs per node
    pub = _publisher(etcd)
    assert not await pub.load() and pub.planner.plan("short") == 1
    etcd.down = True
    assert not await _publisher(etcd).load()
