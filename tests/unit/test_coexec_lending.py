"""A co-executor serves a job's rollouts exactly while that job's claim stands (ROSE §5), and
the lending lapses when etcd cannot be read for lapse_s."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rlharvest.common.lending_record import Claim
from rlharvest.services.coexecutor.lent_rollout import LentRollout
from rlharvest.services.coexecutor.lending import LendingChange, LendingState

from ..builders import FlakyEtcd, stub_membership

A = Claim("job-a", "manager-a")
B = Claim("job-b", "manager-b")


def test_a_claim_activates_and_its_end_deactivates():
    state = LendingState(lapse_s=5)
    assert state.observe(None, 0) == []
    [on] = state.observe(A, 1)
    assert on.job == "job-a" and "manager-a" in on.reason and state.job == "job-a"
    assert state.observe(A, 2) == []  # the same claim read again changes nothing
    [off] = state.observe(None, 3)
    assert off.job is None and state.job is None


def test_a_claim_for_another_job_ends_the_first_lending_before_the_second_starts():
    state = LendingState(lapse_s=5)
    state.observe(A, 0)
    changes = state.observe(B, 1)
    assert [c.job for c in changes] == [None, "job-b"]


def test_unreadable_etcd_lapses_the_lending_after_lapse_s_not_before():
    state = LendingState(lapse_s=5)
    state.observe(A, 10)
    assert state.unreachable(12) == [] and state.unreachable(14.9) == []
    [lapsed] = state.unreachable(15)
    assert lapsed == LendingChange(None, lapsed.reason) and "lapses" in lapsed.reason
    assert state.unreachable(20) == []  # lapsed once
    assert [c.job for c in state.observe(A, 21)] == ["job-a"]  # back: lent again


def test_a_successful_read_restarts_the_lapse_clock():
    state = LendingState(lapse_s=5)
    state.observe(A, 0)
    state.observe(A, 4)
    assert state.unreachable(8) == []


def test_unreadable_etcd_changes_nothing_when_not_lent():
    state = LendingState(lapse_s=1)
    assert state.unreachable(100) == [] and state.job is None


def test_a_non_positive_lapse_is_refused():
    for bad in (0, -1):
        with pytest.raises(ValueError, match="lapse_s"):
            LendingState(lapse_s=bad)


async def test_a_member_record_write_lost_to_etcd_is_written_at_the_next_settle():
    etcd = FlakyEtcd()
    membership = stub_membership(etcd, "/members/coexecutor/c0",
                                 {"job": "", "serving_kv_recent": 0.0, "weight_version": 0})
    share = [0.5]
    holding_j1 = SimpleNamespace(commands=SimpleNamespace(job="j1"))  # j1's weights loaded
    lent = LentRollout(service=holding_j1, membership=lambda: membership,  # type: ignore[arg-type]
                       puller=lambda job: None, recent_share=lambda: share[0], job="j1")
    try:
        etcd.down = True
        await lent.settle()  # lost: logged, tried again later
        assert etcd.records == []
        etcd.down = False
        await lent.settle()
        assert etcd.records[-1]["job"] == "j1" and etcd.records[-1]["serving_kv_recent"] == 0.5
        await membership.update(weight_version=3)  # any other write keeps the fields' values
        assert etcd.records[-1] == {"job": "j1", "serving_kv_recent": 0.5, "weight_version": 3}
        await lent.settle()  # nothing changed since: nothing written
        assert len(etcd.records) == 2
    finally:
        membership._keepalive.cancel()
