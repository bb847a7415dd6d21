"""Rewards inside real trainer steps (the TrainerLoop in this process; the job's manager and a
worker as processes on the session's etcd): a reward function that raises or hangs yields a
recorded failure for that sample, never a stuck step; the code task runs its completions in the
sandbox and its adaptive-timeout anchors survive a checkpoint and resume."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time

import pytest

from rlharvest.services.trainer.config import TrainerConfig
from rlharvest.services.trainer.loop import TrainerLoop

from .test_trainer import start_job

pytestmark = pytest.mark.integration
REWARD_TIMEOUT_S = 1.0

_calls = itertools.count()
_calls_lock = threading.Lock()
_release_hung = threading.Event()


def raising_or_hanging_reward(prompt: str, completion: str, reference: str) -> float:
    """By call order, one in four raises and one in four hangs (until the test ends): each step
    of 2 x 2 samples gets exactly one of each, whatever the completions say."""
    with _calls_lock:
        call = next(_calls)
    if call % 4 == 0:
        raise RuntimeError("judge exploded")
    if call % 4 == 1:
        _release_hung.wait(120)
    return 1.0


def loop_config(manager: str, etcd: str, **overrides) -> TrainerConfig:
    # Unpublished: every step runs on the version 0 the workers start with.
    return TrainerConfig(manager=manager, etcd=etcd, publish=False, backend="torch",
                         prompts_per_step=2, samples_per_prompt=2, micro_batch_groups=1,
                         **overrides)


async def run_loop(loop: TrainerLoop, timeout: float) -> None:
    await loop.restore()
    await asyncio.wait_for(loop.run(), timeout)


async def test_raising_and_hanging_reward_functions_are_recorded_failures_not_stuck_steps(
        stack, etcd_client, etcd_endpoint):
    manager = await start_job(stack, 1)
    spec = f"{__name__}:raising_or_hanging_reward"
    loop = TrainerLoop(loop_config(manager.endpoint, etcd_endpoint, steps=2, reward_fn=spec,
                                   reward_timeout_s=REWARD_TIMEOUT_S), etcd_client)
    try:
        started = time.monotonic()
        await run_loop(loop, timeout=120)
        elapsed = time.monotonic() - started
    finally:
        _release_hung.set()
        loop.close()

    assert loop.status.state == "done" and [s.step for s in loop.status.summaries] == [1, 2]
    # The failures trained as reward 0 beside the two samples that earned 1.0.
    assert [s.mean_reward for s in loop.status.summaries] == [0.5, 0.5]
    for step in (1, 2):
        reasons = sorted(f.reason for f in loop.status.reward_failures if f.step == step)
        assert reasons == ["RuntimeError: judge exploded",
                           f"timed out after {REWARD_TIMEOUT_S:g}s"], reasons
    assert elapsed < 60  # each hang cost its step the reward timeout, not the 120 s it sleeps


async def test_the_code_task_trains_in_the_sandbox_and_resumes_with_its_timeout_anchors(
        stack, etcd_client, etcd_endpoint, tmp_path):
    manager = await start_job(stack, 1)
    cfg = loop_config(manager.endpoint, etcd_endpoint, task="code", steps=1,
                      checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=1,
                      sandbox_t_min_s=1.0, sandbox_t_max_s=3.0, reward_timeout_s=6.0)
    loop = TrainerLoop(cfg, etcd_client)
    try:
        # A correct run anchors its test case; random-init completions rarely pass by themselves.
        assert await loop.task.score("7==", "3+4", "7") == 1.0
        await run_loop(loop, timeout=120)  # checkpoints after its one step
    finally:
        loop.close()
    assert loop.status.state == "done"
    assert loop.task.name == "code" and loop.status.current.completions == 4
    # Whatever the untrained model wrote was run: what did not run cleanly says why.
    assert all(f.reason.split(" ", 1)[0] in ("runtime_error", "timeout", "cpu_limit",
                                             "memory_limit") for f in loop.status.reward_failures)
    anchors = loop.task.checkpoint_state()["timeout_anchors"]
    assert "7==" in anchors

    resumed = TrainerLoop(cfg.model_copy(update={"steps": 1}), etcd_client)
    try:
        await resumed.restore()
    finally:
        resumed.close()
    assert resumed.status.resumed_from_step == 1
    assert resumed.task.checkpoint_state()["timeout_anchors"] == anchors
    assert resumed.task.timeout_for("7==") == loop.task.timeout_for("7==") < 3.0
