"""The manager's client streams a step and, when its manager dies mid-step, resumes the rest at
the successor it finds in etcd; without a successor (or for a short round) the step fails as a
broken stream, which the trainer retries whole."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from rlharvest.common.pb import rollout_manager_pb2 as mpb
from rlharvest.services.rollout_manager import client
from rlharvest.services.rollout_manager.client import (
    ManagerAt, RolloutStreamError, StepStream)


def _request(*ids: str, step_id: str = "step-1") -> mpb.SubmitStepRequest:
    return mpb.SubmitStepRequest(step_id=step_id, seed_window_s=2.0,
                                 requests=[mpb.RolloutRequest(request_id=i) for i in ids])


class Reader:
    def __init__(self, left: mpb.SubmitStepRequest) -> None:
        self.events: list[tuple[str, list[str]]] = []
        self.left = left
        self.successors: list[ManagerAt] = []

    def take(self, event: mpb.StepEvent, request_ids: list[str]) -> None:
        self.events.append((event.completions[0].request_id, request_ids))

    def resume(self, of: mpb.SubmitStepRequest | None = None) -> mpb.SubmitStepRequest:
        return self.left

    def failed_over(self, successor: ManagerAt) -> None:
        self.successors.append(successor)


def _streams(monkeypatch: pytest.MonkeyPatch, breaks_at: set[str]) -> list[str]:
    """Each stream yields one completion per request, and breaks on the first endpoint of
    ``breaks_at`` after its first event."""
    dialed: list[str] = []

    async def stream(endpoint: str, request: mpb.SubmitStepRequest,
                     max_message_bytes: int) -> AsyncIterator[mpb.StepEvent]:
        dialed.append(endpoint)
        for r in request.requests:
            yield mpb.StepEvent(completions=[mpb.Completion(request_id=r.request_id)])
            if endpoint in breaks_at:
                raise RolloutStreamError(f"{endpoint} died")

    monkeypatch.setattr(client, "stream_step", stream)
    return dialed


async def test_a_step_whose_manager_dies_resumes_at_its_successor(monkeypatch):
    dialed = _streams(monkeypatch, breaks_at={"m1:1"})

    async def successor(etcd, job, gone, broke, wait_s, clock):
        assert gone == ManagerAt("m1:1", "a")
        return ManagerAt("m2:1", "b")

    monkeypatch.setattr(client, "find_successor", successor)
    left = _request("r2", step_id="step-1")
    reader = Reader(left)
    stream = StepStream(None, "job", ManagerAt("m1:1", "a"), max_message_bytes=1,
                        resume_wait_s=1.0)
    await stream.run(_request("r1", "r2"), reader)
    assert dialed == ["m1:1", "m2:1"] and stream.manager == ManagerAt("m2:1", "b")
    assert reader.events == [("r1", ["r1", "r2"]), ("r2", ["r2"])]
    assert reader.successors == [ManagerAt("m2:1", "b")]
    assert left.seed_window_s == 0.0  # the seeding window is over at the successor


async def test_a_short_round_or_a_finished_step_does_not_fail_over(monkeypatch):
    _streams(monkeypatch, breaks_at={"m1:1"})
    stream = StepStream(None, "job", ManagerAt("m1:1", "a"), max_message_bytes=1,
                        resume_wait_s=1.0)
    with pytest.raises(RolloutStreamError):
        await stream.run(_request("r1", "r2"), Reader(_request("r2")), may_fail_over=False)
    reader = Reader(_request())  # every request's end had streamed: nothing to resume
    await stream.run(_request("r1", "r2"), reader)
    assert reader.successors == [] and stream.manager.endpoint == "m1:1"


async def test_a_configured_manager_has_no_successor():
    broke = RolloutStreamError("gone")
    with pytest.raises(RolloutStreamError) as raised:
        await client.find_successor(None, "job", ManagerAt("m1:1"), broke, wait_s=1.0)
    assert raised.value is broke
