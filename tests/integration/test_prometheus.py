"""`rlharvest up --prometheus` against a live stack: a real Prometheus (the Debian package)
discovers every member through etcd and the trainer's reward series reads back through its
HTTP API; a member that joins later is scraped too."""

from __future__ import annotations

import asyncio
import time

import pytest

from rlharvest.common.local_etcd import free_port
from rlharvest.services.prometheus_stack import LocalPrometheus

from .test_trainer import start_job, start_trainer, start_worker, wait_trainer

pytestmark = pytest.mark.integration


async def eventually(query, check, timeout: float = 60):
    deadline = time.monotonic() + timeout
    while True:
        result = await asyncio.to_thread(query)
        if check(result):
            return result
        assert time.monotonic() < deadline, result
        await asyncio.sleep(0.5)


async def test_prometheus_scrapes_every_member_and_reads_the_trainers_reward_back(
        stack, etcd_client, tmp_path):
    await start_job(stack, 1)
    trainer, _ = await start_trainer(stack, "trainer", "--backend", "torch", "--steps", "3")
    await wait_trainer(trainer, lambda s: s.state == "done")
    prometheus = LocalPrometheus(stack.etcd.endpoint, tmp_path / "prometheus",
                                 port=free_port(), scrape_interval_s=0.5).start()
    try:
        reward = await eventually(lambda: prometheus.query("rlh_trainer_mean_reward"), bool)
        assert reward[0]["metric"]["service"] == "trainer"
        steps = await eventually(lambda: prometheus.query("rlh_trainer_step"), bool)
        assert float(steps[0]["value"][1]) == 3
        # Each target's first scrape lands somewhere in its interval: wait for all of them.
        every = {"trainer", "rollout_manager", "rollout_worker", "transfer_agent"}
        await eventually(lambda: prometheus.query("up == 1"),
                         lambda up: every <= {r["metric"]["service"] for r in up})
        start_worker(stack, "late", False)  # a member that joins is discovered through etcd
        await eventually(lambda: prometheus.query('up{member="late"} == 1'), bool)
    finally:
        prometheus.stop()
