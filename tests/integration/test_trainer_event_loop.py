"""The trainer's event loop stays free while a version is copied for publishing: that copy
(the whole model, seconds for a large one on the CPU; under ZeRO-3 a gather every rank joins)
and its casts to the serving dtype run off the event loop, or the loop's etcd lease keepalives and streams would lapse.
The TrainerLoop runs in this process; the job's agent, manager and worker are processes."""

from __future__ import annotations

import asyncio
import time

import pytest

from rlharvest.services.trainer.config import TrainerConfig
from rlharvest.services.trainer import publish
from rlharvest.services.trainer.loop import TrainerLoop

from .test_trainer import start_job

pytestmark = pytest.mark.integration
COPY_S = 1.0  # what copying a large model takes, added to each copy of the tiny one


async def test_copying_a_version_for_its_publish_leaves_the_event_loop_free(
        stack, etcd_client, etcd_endpoint, monkeypatch):
    manager = await start_job(stack, 1)
    cfg = TrainerConfig(manager=manager.endpoint, etcd=etcd_endpoint, backend="torch",
                        prompts_per_step=2, samples_per_prompt=2, micro_batch_groups=1,
                        steps=2, publish_dtype="bfloat16")
    loop = TrainerLoop(cfg, etcd_client)
    copy = loop._ranks.weights
    copies = []

    def slow_copy(*args, **kwargs):
        time.sleep(COPY_S)
        copies.append(time.monotonic())
        return copy(*args, **kwargs)

    loop._ranks.weights = slow_copy  # type: ignore[method-assign]
    cast = publish.as_served

    def slow_cast(*args, **kwargs):  # the casts to the serving dtype: a copy of the model each
        time.sleep(COPY_S)
        return cast(*args, **kwargs)

    monkeypatch.setattr(publish, "as_served", slow_cast)
    longest_gap = 0.0

    async def tick() -> None:
        nonlocal longest_gap
        last = time.monotonic()
        while True:
            await asyncio.sleep(0.02)
            now = time.monotonic()
            longest_gap, last = max(longest_gap, now - last), now

    ticker = asyncio.create_task(tick())
    try:
        await loop.restore()
        await asyncio.wait_for(loop.run(), 180)
    finally:
        ticker.cancel()
        loop.close()
    # Copied three times: for the start weights' fingerprint, versions 1 and 2.
    assert loop.status.state == "done" and len(copies) == 3
    assert longest_gap < COPY_S / 2, f"the event loop stalled {longest_gap:.2f}s"
