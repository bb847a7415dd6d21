"""Harness (not a benchmark): compare manager configurations over the same workers, interleaved.

Each configuration is a rollout manager of a job of its own. A worker serves one job's weights at
a time (a version is a job's, and a manager takes only its job's workers), so the
workers are handed from job to job the way WEAVE's placed workers are: each runs with
``--placement-node`` and follows its node's turn, which this harness writes in etcd as the
placement scheduler would (``keys.placement_node_key``). A switch keeps each job's weights
resident (a warm load after the first), and happens before a step is timed, never during one.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence

from rlharvest.common import keys, registry
from rlharvest.services.rollout_manager import client as manager_client


def placed_flags(node: str, jobs: int) -> list[str]:
    """A worker's flags to follow ``node``'s turn among ``jobs`` configurations' jobs."""
    return ["--placement-node", node, "--placement-resident-jobs", str(jobs)]


async def give_turn(etcd_endpoint: str, nodes: Sequence[str], job: str, manager: str,
                    timeout: float = 120.0) -> None:
    """Every node's turn is ``job``'s; returns once its ``manager`` sees every worker healthy."""
    etcd = await registry.connect(etcd_endpoint)
    try:
        record = json.dumps({"turn": job}).encode()
        for node in nodes:
            await etcd.put(keys.placement_node_key(node).encode(), record)
    finally:
        await etcd.close()
    await manager_client.wait_workers(manager, len(nodes), timeout=timeout)


def turn(etcd_endpoint: str, nodes: Sequence[str], job: str, manager: str) -> None:
    asyncio.run(give_turn(etcd_endpoint, nodes, job, manager))
