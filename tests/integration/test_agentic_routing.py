"""Agentic turns through a real manager and real workers with prefix caches: every turn after a
trajectory's first goes back to the worker holding its history (the manager counts it), that
worker reads the history from its cache instead of prefilling it, and the last turn ends the
trajectory's entry."""

from __future__ import annotations

import pytest

from bench.agentic_routing import run_trajectories
from tests.integration.test_manager import scrape, start_manager
from tests.integration.worker_client import start_workers
from rlharvest.services.rollout_manager.status_client import wait_workers

pytestmark = pytest.mark.integration


async def test_each_later_turn_returns_to_its_history_and_reads_it_from_the_cache(module_stack):
    workers = start_workers(module_stack, ["aw0", "aw1"], "--model", "small", "--max-running",
                            "4", "--max-len", "1024", "--kv-pages", "2048", "--prefix-cache")
    manager = start_manager(module_stack, "--turn-routing", "turnwise+affinity")
    try:
        await wait_workers(manager.endpoint, 2, timeout=60)
        await run_trajectories(manager.endpoint, "it", count=3, turns=3)
        later_turns = 3 * 2
        routed = scrape(manager.metrics_port)
        assert routed['rlh_manager_turns_routed{outcome="affinity"}'] == later_turns
        assert routed['rlh_manager_turns_routed{outcome="first"}'] == 3
        assert routed["rlh_manager_trajectories"] == 0  # the last turns ended them
        hits = sum(scrape(w.metrics_port)["rlh_worker_prefix_cache_hits_total"]
                   for w in workers)
        assert hits == later_turns
    finally:
        manager.process.terminate()
        for w in workers:
            w.process.terminate()
