"""A rollout worker's weight puller against real transfer agents (processes) and a real etcd:
deltas that fail verification at one holder come from the next, deltas that apply at no holder
come dense, and a version whose load failed is pulled and loaded again. The engine is a
recorder: the claims are about what the puller asks of the agents and hands to its engine."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass

import pytest
import torch
from prometheus_client import REGISTRY

from rlharvest.common import registry
from rlharvest.services.rollout_worker.puller import Puller
from rlharvest.services.transfer_agent.checksum import tensor_linear_sum
from rlharvest.services.transfer_agent.client import publish, pull

from .test_transfer_agent import scrape, start_agent, wait_for

pytestmark = pytest.mark.integration


class Engine:
    """What the puller loads into: each load's version and tensors (copied: the puller owns
    them); the first ``failures`` loads raise as an engine process restarting does."""

    def __init__(self, failures: int = 0) -> None:
        self.failures = failures
        self.loads: list[tuple[int, dict[str, torch.Tensor]]] = []

    async def load_weights_tensors(self, tensors: dict[str, torch.Tensor], version: int,
                                   job: str) -> None:
        if self.failures:
            self.failures -= 1
            raise ConnectionError("engine process restarting")
        self.loads.append((version, {name: t.clone() for name, t in tensors.items()}))


@dataclass(frozen=True)
class Agent:
    name: str
    endpoint: str
    metrics_port: int

    def delta_plans(self) -> float:
        return scrape(self.metrics_port).get('rlh_agent_pulls_total{kind=delta}', 0.0)


@pytest.fixture(scope="module")
def agents(module_stack) -> list[Agent]:
    """Two agents; the first sorts first by id, so a fresh worker pairs with it."""
    suffix = uuid.uuid4().hex[:6]
    started = []
    for name in (f"fo-a-{suffix}", f"fo-b-{suffix}"):
        _, endpoint, metrics_port = start_agent(module_stack, name)
        started.append(Agent(name, endpoint, metrics_port))
    return started


@pytest.fixture
async def etcd(etcd_endpoint):
    client = await registry.connect(etcd_endpoint)  # no wipe: the module's agents keep their keys
    yield client
    await client.close()


def version_1(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 64, generator=gen), "b": torch.randn(64, generator=gen)}


def changed(tensors: dict[str, torch.Tensor], every: int, by: float) -> dict[str, torch.Tensor]:
    """A sparse change of every tensor (ROSE: ~1% of the elements): still a delta's worth."""
    out = {name: t.clone() for name, t in tensors.items()}
    for t in out.values():
        t.view(-1)[::every] += by
    return out


def pulls(kind: str) -> float:
    return REGISTRY.get_sample_value("rlh_worker_pulls_total", {"kind": kind}) or 0.0


async def loaded(puller: Puller, engine: Engine, version: int) -> dict[str, torch.Tensor]:
    """Run the puller until the engine has loaded ``version``; its tensors."""
    task = asyncio.create_task(puller.run())
    try:
        await wait_for(lambda: task.done() or any(v == version for v, _ in engine.loads),
                       timeout=30, what=f"version {version} loaded")
        if task.done():
            task.result()  # the puller died: its error is the failure
        return next(t for v, t in engine.loads if v == version)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def exact(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> bool:
    return got.keys() == expected.keys() and all(torch.equal(got[n], expected[n]) for n in got)


async def test_deltas_failing_verification_at_one_holder_are_pulled_from_the_next(
        agents, etcd):
    job = f"job-fo-{uuid.uuid4().hex[:6]}"
    first, second = agents
    v1 = version_1(1)
    diverged = changed(v1, 1000, 1.0)  # the first agent's copy of version 1 is not the others'
    v2 = changed(v1, 97, 0.5)
    await publish(first.endpoint, job, 1, diverged)
    await publish(second.endpoint, job, 1, v1)
    for agent in agents:
        await publish(agent.endpoint, job, 2, v2)
    held = await pull(second.endpoint, job, version=1)
    engine = Engine()
    puller = Puller(etcd, engine, f"worker-{job}", job)
    puller.held, puller.held_version, puller.held_sums = held.tensors, 1, held.sums
    plans = [agent.delta_plans() for agent in agents]
    deltas, dense = pulls("delta"), pulls("dense")
    assert exact(await loaded(puller, engine, 2), v2)
    # Asked the first agent (paired), whose deltas fail the base check, then the second.
    assert [agent.delta_plans() for agent in agents] == [plans[0] + 1, plans[1] + 1]
    assert (pulls("delta"), pulls("dense")) == (deltas + 1, dense)  # the second's deltas
    assert puller.held_version == 2 and exact(puller.held, v2)


async def test_deltas_that_apply_at_no_holder_are_pulled_dense(agents, etcd):
    job = f"job-fo-{uuid.uuid4().hex[:6]}"
    v1 = version_1(2)
    v2 = changed(v1, 97, 0.5)
    for version, tensors in ((1, v1), (2, v2)):
        for agent in agents:
            await publish(agent.endpoint, job, version, tensors)
    engine = Engine()
    puller = Puller(etcd, engine, f"worker-{job}", job)
    # The worker's version 1 is not the agents' (its own sums agree with it, so only the
    # deltas' base check can tell).
    held = changed(v1, 1000, 1.0)
    puller.held, puller.held_version = held, 1
    puller.held_sums = {name: tensor_linear_sum(t) for name, t in held.items()}
    dense = pulls("dense")
    assert exact(await loaded(puller, engine, 2), v2)
    assert pulls("dense") == dense + 1
    assert puller.held_version == 2 and exact(puller.held, v2)


async def test_a_version_whose_load_failed_is_pulled_and_loaded_again(agents, etcd):
    job = f"job-fo-{uuid.uuid4().hex[:6]}"
    v1 = version_1(3)
    for agent in agents:
        await publish(agent.endpoint, job, 1, v1)
    engine = Engine(failures=1)
    puller = Puller(etcd, engine, f"worker-{job}", job)
    assert exact(await loaded(puller, engine, 1), v1)
    assert engine.failures == 0 and puller.held_version == 1
