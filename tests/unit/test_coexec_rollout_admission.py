"""A co-executor takes a rollout request only if the rollout worker would and its KV fits in
what B_roll leaves."""

from __future__ import annotations

import grpc

from rlharvest.common.engine_types import EngineRequest, SamplingParams
from rlharvest.common.worker_core.admission import Wanted, WorkerView
from rlharvest.services.coexecutor.rollout_admission import CoexecRolloutAdmission
from rlharvest.services.rollout_worker.admission import RolloutAdmission


def admission(room: int) -> CoexecRolloutAdmission:
    return CoexecRolloutAdmission(RolloutAdmission(4, 4), lambda: room, tokens_per_page=8)


def request(prompt: int, resumed: int = 0) -> EngineRequest:
    return EngineRequest("r", [1] * prompt, SamplingParams(), generated_token_ids=[2] * resumed)


VIEW = WorkerView(weight_version=3, held=(), draining=False, job="j")


def test_a_request_whose_kv_fits_the_budget_is_taken_and_one_that_does_not_goes_elsewhere():
    assert admission(room=2).admit(request(15), Wanted("j", 3), VIEW) is None  # 16 tokens: 2 pages
    # 17 tokens: 3 pages
    refused = admission(room=2).admit(request(10, resumed=6), Wanted("j", 3), VIEW)
    assert refused is not None and refused.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "needs 3 KV pages, the rollout budget leaves 2" in str(refused)


def test_the_rollout_workers_own_checks_come_first():
    stale = admission(room=0).admit(request(1), Wanted("j", 2), VIEW)
    assert stale is not None and stale.code is grpc.StatusCode.FAILED_PRECONDITION


def test_a_coexecutor_lent_to_no_job_sends_every_request_elsewhere():
    lent = [False]
    gate = CoexecRolloutAdmission(RolloutAdmission(4, 4), lambda: 100, tokens_per_page=8,
                                  lent=lambda: lent[0])
    refused = gate.admit(request(4), Wanted("j", 3), VIEW)
    assert refused is not None and refused.code is grpc.StatusCode.UNAVAILABLE  # retry elsewhere
    assert "lent to no job" in str(refused)
    lent[0] = True
    assert gate.admit(request(4), Wanted("j", 3), VIEW) is None
