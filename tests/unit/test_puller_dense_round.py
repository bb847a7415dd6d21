"""Which holders a worker's puller asks again in its dense round, after no holder's deltas
applied: those whose deltas did not verify (a dense pull needs no base) and those whose plan
changed under the pull (ABORTED: plan again), never one that is gone, does not hold the version,
refused, or whose bytes stayed damaged — it would answer a dense pull the same, after its time.
etcd and the agents are faked: the claim is about what the puller asks of whom."""

from __future__ import annotations

import json
from types import SimpleNamespace

import grpc
import torch

from rlharvest.common import keys
from rlharvest.services.rollout_worker.puller import Puller
from rlharvest.services.transfer_agent.client import DeltaApplyError, PullError, PullResult

JOB = "job-dense"
V2 = {"w": torch.arange(8, dtype=torch.float32)}


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


# agent id -> (its delta pull's error, its dense pull's error or None: serves it)
HOLDERS: dict[str, tuple[Exception, Exception | None]] = {
    "b-gone": (rpc_error(grpc.StatusCode.UNAVAILABLE, "connection refused"), None),
    "c-lacks": (rpc_error(grpc.StatusCode.NOT_FOUND, "weight version 2 was evicted"), None),
    "d-broke": (PullError("the agent went away mid-pull", "UNAVAILABLE"), None),
    "e-damaged": (PullError("buckets [0] stayed damaged", "DATA_LOSS"), None),
    "f-replanned": (PullError("the pull's plan changed", "ABORTED"),
                    PullError("went away meanwhile", "UNAVAILABLE")),
    "g-grpc-replanned": (rpc_error(grpc.StatusCode.ABORTED, "plan the pull again"),
                         PullError("went away meanwhile", "UNAVAILABLE")),
    "h-diverged": (DeltaApplyError("deltas against another base", "DATA_LOSS"),
                   PullError("went away meanwhile", "UNAVAILABLE")),
    "z-diverged": (DeltaApplyError("deltas against another base", "DATA_LOSS"), None),
}


class Etcd:
    """get_prefix over the member and holder records of the agents above."""

    def __init__(self) -> None:
        self.records: dict[str, dict] = {}
        for agent in HOLDERS:
            self.records[keys.member_key("transfer_agent", agent)] = {
                "agent_id": agent, "endpoint": agent}
            self.records[keys.weights_holder_key(JOB, agent)] = {
                "endpoint": agent, "versions": [1, 2]}

    async def get_prefix(self, prefix: bytes):
        return [SimpleNamespace(key=key.encode(), value=json.dumps(value).encode())
                for key, value in sorted(self.records.items()) if key.startswith(prefix.decode())]


class Engine:
    def __init__(self) -> None:
        self.loads: list[int] = []

    async def load_weights_tensors(self, tensors, version: int, job: str) -> None:
        self.loads.append(version)


async def test_the_dense_round_asks_only_holders_whose_failure_a_dense_pull_can_avoid():
    engine = Engine()
    puller = Puller(Etcd(), engine, "worker-1", JOB)
    puller.paired = "b-gone"  # paired before it went: asked first
    puller.held, puller.held_version = {"w": torch.zeros(8)}, 1
    asked: list[tuple[str, bool]] = []

    async def pull_from(endpoint: str, version: int, dense: bool) -> PullResult:
        asked.append((endpoint, dense))
        delta_error, dense_error = HOLDERS[endpoint]
        error = dense_error if dense else delta_error
        if error is not None:
            raise error
        return PullResult(version, {n: t.clone() for n, t in V2.items()}, "", False, 32, 32, 0,
                          0.01)

    puller._pull_from = pull_from  # type: ignore[method-assign]
    assert await puller._pull(2)
    delta_round = [(agent, False) for agent in ["b-gone", *sorted(set(HOLDERS) - {"b-gone"})]]
    assert asked == delta_round + [("f-replanned", True), ("g-grpc-replanned", True),
                                   ("h-diverged", True), ("z-diverged", True)]
    assert engine.loads == [2] and puller.held_version == 2


async def test_with_no_holder_left_worth_a_dense_pull_the_puller_waits_for_the_next_try():
    puller = Puller(Etcd(), Engine(), "worker-1", JOB)
    puller.paired = "b-gone"
    puller.held, puller.held_version = {"w": torch.zeros(8)}, 1
    asked: list[tuple[str, bool]] = []
    failing = {"b-gone": HOLDERS["b-gone"][0],
               "h-diverged": DeltaApplyError("deltas against another base", "DATA_LOSS")}

    async def pull_from(endpoint: str, version: int, dense: bool) -> PullResult:
        asked.append((endpoint, dense))
        raise failing.get(endpoint, HOLDERS["c-lacks"][0]) if not dense else \
            PullError("went away meanwhile", "UNAVAILABLE")

    puller._pull_from = pull_from  # type: ignore[method-assign]
    assert not await puller._pull(2)  # the caller tries again soon
    assert [a for a, dense in asked if dense] == ["h-diverged"]
    assert puller.held_version == 1
