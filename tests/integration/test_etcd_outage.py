"""etcd killed and restarted under a training job: the outage is waited out by every
service. Found as an operator's chaos soak found it: an etcd restart stopped the trainer (its
manager and agent lookups) and the standby manager (its election)."""

from __future__ import annotations

import asyncio
import json

import pytest

from rlharvest.common import keys, registry
from rlharvest.common.local_etcd import LocalEtcd, free_port
from rlharvest.cli.launcher import LocalStack
from rlharvest.services.rollout_manager.client import wait_workers

from .test_coexecutor import until
from .test_trainer import (
    COMMON,
    metric,
    scrape,
    start_job,
    start_trainer,
    wait_manager_roles,
    wait_trainer,
)

pytestmark = pytest.mark.integration
STEPS = 6


async def test_an_etcd_sigkilled_mid_training_stops_neither_the_trainer_nor_the_standby(
        tmp_path, fork_server):
    etcd = await asyncio.to_thread(LocalEtcd().start)  # its own: this test kills it
    stack = LocalStack(tmp_path / "logs", etcd=etcd, fork_server=fork_server)
    try:
        leader = await start_job(stack, 2)
        standby_metrics = free_port()
        standby = stack.start("rollout_manager", "standby", [
            "--manager-id", "manager-standby", "--port", str(free_port()), "--metrics-port",
            str(standby_metrics), *COMMON])
        client = await registry.connect(etcd.endpoint)
        try:
            await wait_manager_roles(client, ["leader", "standby"])
        finally:
            await client.close()
        trainer, trainer_metrics = await start_trainer(
            stack, "trainer", "--backend", "torch", "--steps", str(STEPS),
            "--checkpoint-dir", str(tmp_path / "ckpt"))
        await wait_trainer(trainer, lambda s: s.steps_done >= 2)
        # SIGKILL, down 3 s (longer than every lease), back on its data directory.
        await asyncio.to_thread(etcd.restart, crash=True, down_s=3.0)
        done = await wait_trainer(trainer, lambda s: s.state == "done", timeout=300)
        assert done.steps_done == STEPS and trainer.process.alive()
        assert standby.alive(), "the standby manager stopped:\n" + standby.log_tail()
        assert metric(scrape(trainer_metrics), "rlh_etcd_up") == 1
        logs = [json.loads(line)["msg"] for line in trainer.process.log_path.read_text()
                .splitlines() if line.startswith("{")]
        assert any(m.startswith("etcd answers again after") for m in logs), logs[-20:]
        # The standby still campaigns: the leader's death hands it the job.
        leader.process.kill()
        client = await registry.connect(etcd.endpoint)
        try:
            await wait_manager_roles(client, ["leader"])
        finally:
            await client.close()
        assert metric(scrape(standby_metrics), "rlh_manager_leader") == 1
    finally:
        for proc in stack.processes:
            proc.kill()
        etcd.stop()


async def test_a_version_whose_only_agent_died_before_any_pull_is_published_again(
        stack, etcd_client):
    """A version is never left nowhere. Version 1 goes to the one agent, which is
    SIGKILLed before any worker pulled it (the step-1 worker does not pull); its holder record
    goes with its lease. The trainer sees no agent and no worker holding version 1 before the
    next step's rollout (or its retry) and publishes it again, to the agent started since."""
    first = stack.start("transfer_agent", "agent-1", ["--agent-id", "agent-1", *COMMON])
    manager_port = free_port()
    stack.start("rollout_manager", "manager", ["--port", str(manager_port), *COMMON])
    stack.start("rollout_worker", "w0", ["--worker-id", "w0", "--torch-threads", "1",
                                         "--job", "default", *COMMON])  # version 0 only
    await wait_workers(f"127.0.0.1:{manager_port}", 1, timeout=120)
    trainer, trainer_metrics = await start_trainer(
        stack, "trainer", "--backend", "torch", "--steps", "2", "--no-worker-deadline-s", "3")
    holder = keys.weights_holder_key("default", "agent-1").encode()

    async def version_1_held() -> bool:
        found = await etcd_client.get(holder)
        return found is not None and 1 in json.loads(found.value)["versions"]

    await until(version_1_held, what="version 1 at agent-1")
    first.kill()
    while await etcd_client.get(holder) is not None:  # its lease lapses (2 s)
        await asyncio.sleep(0.1)
    stack.start("transfer_agent", "agent-2", ["--agent-id", "agent-2", *COMMON])
    stack.start("rollout_worker", "w1", ["--worker-id", "w1", "--torch-threads", "1",
                                         "--job", "default", "--agent-pull", *COMMON])
    done = await wait_trainer(trainer, lambda s: s.state == "done", timeout=240)
    assert [s.step for s in done.steps] == [1, 2] and done.steps[-1].weight_version == 1
    assert metric(scrape(trainer_metrics), "rlh_trainer_versions_republished_total") == 1
