"""The rollout worker's admission policy, pure: which adds it takes, and what a weight swap
ends."""

from __future__ import annotations

import grpc
import pytest

from rlharvest.common.engine_types import EngineRequest, SamplingParams
from rlharvest.common.worker_core.admission import Wanted, WorkerView
from rlharvest.services.rollout_worker.admission import RolloutAdmission


def request(rid: str = "r") -> EngineRequest:
    return EngineRequest(rid, [1, 2, 3], SamplingParams(max_tokens=8))


def view(held: tuple[str, ...] = (), version: int = 2, draining: bool = False,
         job: str = "a", start: str = "f0") -> WorkerView:
    return WorkerView(weight_version=version, held=set(held), draining=draining, job=job,
                      start_weights=start)


def of_a(version: int, start: str = "") -> Wanted:
    return Wanted("a", version, start)


def test_an_add_for_the_held_version_with_room_is_taken():
    assert RolloutAdmission(2, 1).admit(request(), of_a(2), view()) is None


def test_an_add_for_another_weight_version_is_a_failed_precondition():
    refusal = RolloutAdmission(2, 1).admit(request(), of_a(5), view(version=2))
    assert refusal is not None and refusal.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "wants weight version 5" in str(refusal) and "holds 2" in str(refusal)


def test_an_add_of_another_job_at_the_same_version_is_a_failed_precondition():
    # Version 2 of job b is another policy than version 2 of job a.
    refusal = RolloutAdmission(2, 1).admit(request(), Wanted("b", 2), view(job="a"))
    assert refusal is not None and refusal.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "job 'b'" in str(refusal) and "job 'a'" in str(refusal)
    unloaded = RolloutAdmission(2, 1).admit(request(), Wanted("b", 2), view(job=""))
    assert unloaded is not None and "no job's weights yet" in str(unloaded)


def test_a_version_0_add_names_the_start_weights_it_needs():
    policy = RolloutAdmission(2, 1)
    assert policy.admit(request(), of_a(0, "f0"), view(version=0, start="f0")) is None
    refusal = policy.admit(request(), of_a(0, "f1"), view(version=0, start="f0"))
    assert refusal is not None and refusal.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "f1" in str(refusal) and "f0" in str(refusal)
    # A job that declared no start weights checks none; later versions are the trainer's.
    assert policy.admit(request(), of_a(0), view(version=0, start="f0")) is None
    assert policy.admit(request(), of_a(2, "f1"), view(version=2, start="f0")) is None


def test_capacity_is_running_plus_pending():
    policy = RolloutAdmission(max_running=2, max_pending=1)
    assert policy.admit(request("c"), of_a(2), view(held=("a", "b"))) is None  # 3rd: queued
    refusal = policy.admit(request("d"), of_a(2), view(held=("a", "b", "c")))
    assert refusal is not None and refusal.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "running plus pending" in str(refusal)


def test_a_duplicate_id_already_exists_even_when_full():
    refusal = RolloutAdmission(1, 0).admit(request("a"), of_a(2), view(held=("a",)))
    assert refusal is not None and refusal.code == grpc.StatusCode.ALREADY_EXISTS


def test_an_empty_id_is_an_invalid_argument():
    refusal = RolloutAdmission(2, 1).admit(request(""), of_a(2), view())
    assert refusal is not None and refusal.code == grpc.StatusCode.INVALID_ARGUMENT


def test_a_draining_worker_refuses_everything_as_unavailable():
    # Before any other check: the manager retries elsewhere whatever else is wrong.
    refusal = RolloutAdmission(2, 1).admit(request(""), of_a(9), view(draining=True))
    assert refusal is not None and refusal.code == grpc.StatusCode.UNAVAILABLE
    assert "draining" in str(refusal)


def test_a_weight_swap_ends_every_held_request():
    # Running ones hold KV of the old weights; queued ones were admitted for the old version.
    held = {"running": 2, "queued": 2, "starting": 3}
    assert sorted(RolloutAdmission(2, 1).on_weight_swap(3, held)) == sorted(held)
    assert list(RolloutAdmission(2, 1).on_weight_swap(3, {})) == []


def test_a_policy_needs_a_running_slot():
    with pytest.raises(ValueError, match="max_running"):
        RolloutAdmission(0, 4)
