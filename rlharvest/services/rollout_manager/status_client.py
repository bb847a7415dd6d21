"""Reading a rollout manager's status from outside: the one ``GetStatus`` call and the one
"wait until these workers have joined" loop that the CLI, the demo, the benchmarks and the tests
share (each used to carry its own copy)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Collection

import grpc

from rlharvest.common import rpc
from rlharvest.common.pb import rollout_manager_pb2 as mpb
from rlharvest.common.pb import rollout_manager_pb2_grpc


async def manager_status(endpoint: str, timeout: float = 5.0) -> mpb.ManagerStatus | None:
    """The manager's status, or None while it is not answering (starting, or gone)."""
    async with rpc.channel(endpoint, peer_role="manager") as chan:  # under TLS: a manager's
        try:
            return await rollout_manager_pb2_grpc.RolloutManagerStub(chan).GetStatus(
                mpb.GetStatusRequest(), timeout=timeout)
        except grpc.aio.AioRpcError:
            return None


def healthy_workers(status: mpb.ManagerStatus | None) -> list[str]:
    return [] if status is None else [w.worker_id for w in status.workers
                                      if w.state == "healthy"]


async def wait_workers(endpoint: str, count: int = 0, names: Collection[str] = (),
                       timeout: float = 60.0, poll_s: float = 0.2) -> mpb.ManagerStatus:
    """Until at least ``count`` workers, ``names`` among them, are healthy in the manager's
    status (a worker is healthy once registered on the manager's current version). Raises
    TimeoutError naming what was missing, so a stuck start-up says which member never came."""
    deadline = time.monotonic() + timeout
    while True:
        status = await manager_status(endpoint)
        healthy = healthy_workers(status)
        missing = sorted(set(names) - set(healthy))
        if status is not None and len(healthy) >= count and not missing:
            return status
        if time.monotonic() > deadline:
            raise TimeoutError(f"the manager at {endpoint} did not see its workers within "
                               f"{timeout:.0f}s: healthy {healthy}, wanted {count or ''} "
                               f"{missing or ''}".rstrip())
        await asyncio.sleep(poll_s)
