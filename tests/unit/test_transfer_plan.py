"""The agent packs each planned pull once, however many requests ask for it at the same time,
and one asker going away does not take the pack from the others."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from rlharvest.common.pb import transfer_agent_pb2 as pb
from rlharvest.services.transfer_agent.config import AgentConfig
from rlharvest.services.transfer_agent.service import AgentService

JOB = "job-plan"


class Context:
    """A PlanPull caller's servicer context; the agent serves no HTTP data path here."""


@pytest.fixture
async def service():
    agent = AgentService(AgentConfig(agent_id="plan-test"))
    await agent.hold(JOB, 1, {"w": torch.arange(1000, dtype=torch.float32)}, "test")
    yield agent
    agent.close()


async def test_a_plan_whose_pack_a_cancelled_request_started_still_reaches_the_others(service):
    packing, release, packs = threading.Event(), threading.Event(), []
    pack = service._pack

    def held_pack(store, key):  # on the store thread: holds the pack until both requests wait
        packs.append(key)
        packing.set()
        release.wait(10)
        return pack(store, key)

    service._pack = held_pack
    request = pb.PullRequest(job=JOB, version=1)
    first = asyncio.create_task(service.PlanPull(request, Context()))
    await asyncio.to_thread(packing.wait, 10)
    second = asyncio.create_task(service.PlanPull(request, Context()))  # another worker
    await asyncio.sleep(0.05)
    first.cancel()  # its client went away
    await asyncio.sleep(0.05)
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await first  # the cancellation reaches the request that was cancelled
    plan = await asyncio.wait_for(second, 10)
    assert plan.version == 1 and plan.dense_bytes == 4000
    third = await service.PlanPull(request, Context())  # the pack went to the cache too
    assert third.plan_id == plan.plan_id and len(packs) == 1
