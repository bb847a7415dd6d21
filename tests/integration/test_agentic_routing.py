"""Agentic turns through a real manager and real workers with prefix caches: every turn after a
trajectory's first goes back to the worker holding its history (the manager counts it), that
worker reads the history from its cache instead of prefilling it, and the last turn ends the
trajectory's entry."""

from __future__ import annotations

import pytest

from bench.agentic_routing import run_trajectories
from tests.integration.test_manager import scrape, start_manager
from tests.integration.worker_client import start_workers
from rlharvest.services.rollout_manager.client import wait_workers

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


class Raises:
    def reset(self, seed: int) -> str:
        return "go"

    def step(self, action: str):
        raise KeyError("the environment's own bug")


class Hangs(Raises):
    def step(self, action: str):
        import time

        time.sleep(30)


class Malformed(Raises):
    def step(self, action: str):
        return {"observation": "x"}


async def test_frozen_lake_trajectories_play_through_the_manager_and_bad_envs_fail_alone(
        module_stack):
    import asyncio

    from rlharvest.services.trainer.environments.frozen_lake import FrozenLake
    from rlharvest.services.trainer.environments.runner import (
        PlayConfig,
        manager_generator,
        play,
        play_group,
    )

    workers = start_workers(module_stack, ["ew0"], "--max-running", "8", "--kv-pages", "512",
                            "--prefix-cache")
    manager = start_manager(module_stack)
    try:
        await wait_workers(manager.endpoint, 1, timeout=60)
        cfg = PlayConfig(max_turns=6, max_new_tokens=2, env_timeout_s=0.5)
        async with manager_generator(manager.endpoint, cfg) as generate:
            group, *bad = await asyncio.gather(
                play_group(generate, FrozenLake, "g0", seed=1, size=4, cfg=cfg),
                play(generate, Raises(), "raises", 0, cfg),
                play(generate, Hangs(), "hangs", 0, cfg),
                play(generate, Malformed(), "malformed", 0, cfg))
        for t in group:
            assert not t.failed and 1 <= t.turns <= 6 and t.reward in (0.0, 1.0)
            assert t.done or t.turns == 6
            assert len(t.token_ids) == len(t.trained) == len(t.logprobs)
            assert sum(t.trained) == sum(2 for _ in range(t.turns))  # 2 sampled per turn
            assert all(lp <= 0 for lp, own in zip(t.logprobs, t.trained) if own)
            assert all(lp == 0 for lp, own in zip(t.logprobs, t.trained) if not own)
            # The environment's observations are the untrained stretches between turns.
            observed = [tok for tok, own in zip(t.token_ids, t.trained) if not own]
            assert len(observed) > 0 or t.turns == 1
        assert "KeyError" in bad[0].failed and "turn 0" in bad[0].failed
        assert "within 0.5 s" in bad[1].failed
        assert "EnvStep" in bad[2].failed
        # Each trajectory's later turns went back to the worker of its last one.
        routed = scrape(manager.metrics_port)
        assert routed['rlh_manager_turns_routed{outcome="affinity"}'] == \
            sum(t.turns - 1 for t in group)
    finally:
        manager.process.terminate()
        for w in workers:
            w.process.terminate()
