"""A transfer agent whose etcd lease lapsed (etcd unreachable, or the agent stalled, past its
TTL) comes back: its member record and its holder records, by which workers find the agents
that hold a version, are put again on a new lease, not only at the next version."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from rlharvest.common import keys
from rlharvest.services.transfer_agent.client import holders, publish

from .test_transfer_agent import start_agent

pytestmark = pytest.mark.integration


async def test_an_agent_whose_lease_lapsed_puts_its_holder_records_back(stack, etcd_client):
    _, endpoint, _ = start_agent(stack, "lapsing")
    await publish(endpoint, "lapse-job", 1, {"w": torch.arange(8, dtype=torch.float32)})
    deadline = time.monotonic() + 10
    while "lapsing" not in await holders(etcd_client, "lapse-job"):
        assert time.monotonic() < deadline, "the holder record never appeared"
        await asyncio.sleep(0.1)
    member = await etcd_client.get(keys.member_key("transfer_agent", "lapsing").encode())
    assert member is not None and member.lease
    await etcd_client.revoke_lease(member.lease)  # as etcd does when no keepalive came in time
    assert "lapsing" not in await holders(etcd_client, "lapse-job")  # gone with the lease
    deadline = time.monotonic() + 10  # the agent's TTL is 2 s: it renews every ~0.7 s
    while (record := (await holders(etcd_client, "lapse-job")).get("lapsing")) is None:
        assert time.monotonic() < deadline, "the holder record was not put back"
        await asyncio.sleep(0.1)
    assert record["versions"] == [1] and record["latest"] == 1 and record["endpoint"] == endpoint
    again = await etcd_client.get(keys.member_key("transfer_agent", "lapsing").encode())
    assert again is not None and again.lease != member.lease  # the member is back, anew
