"""On-policy under mixed weight versions (docs/architecture.md, invariants): no token of a completion
comes from a worker holding another weight version — not at dispatch, not when the step's own
workers are full, and not when one of them is SIGKILLed and its requests migrate."""

from __future__ import annotations

import asyncio
import urllib.request

from safetensors.torch import save_file

from rlharvest.models.tiny_model import build_model

from .test_manager import run_step, start_manager, status, step_request, wait_workers
from .worker_client import start_worker

import pytest

pytestmark = pytest.mark.integration


def tokens_generated(metrics_port: int) -> float:
    body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read()
    for line in body.decode().splitlines():
        if line.startswith("rlh_worker_tokens_generated_total "):
            return float(line.split()[1])
    raise AssertionError("worker exposes no rlh_worker_tokens_generated_total")


async def test_no_token_of_a_completion_comes_from_a_worker_of_another_version(stack, tmp_path):
    weights = tmp_path / "v1.safetensors"
    model = build_model("tiny", seed=1)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()
               if k != "lm_head.weight"}, str(weights))
    # One worker holds version 0 and has 2 batch slots: the v0 step queues on it while the two
    # v1 workers are idle at times; spilling onto them would be the off-policy bug.
    v0 = start_worker(stack, "v0", "--max-running", "2")
    # The v1 workers are slowed (an emulated slower GPU) so the kill lands mid-step however
    # busy the test machine is.
    v1 = [start_worker(stack, f"v1-{i}", "--max-running", "4", "--weights", str(weights),
                       "--weight-version", "1", "--step-delay-s", "0.02") for i in range(2)]
    manager = start_manager(stack, "--theta", "1")
    await wait_workers(manager.endpoint, 3)

    killed = []

    async def kill_a_v1_worker(completions, streamed):
        if not killed and sum(map(len, streamed.values())) >= 16:
            # The v1 worker holding most of the step right now: its requests must migrate to
            # the other v1 worker, never to the v0 one.
            assigned = {w.worker_id: w.assigned for w in (await status(manager.endpoint)).workers}
            victim = max((0, 1), key=lambda i: assigned.get(f"v1-{i}", 0))
            if assigned.get(f"v1-{victim}", 0):
                v1[victim].process.kill()
                killed.append(1 - victim)  # the survivor

    step0 = step_request(8, 24, version=0, prefix="a")
    step1 = step_request(8, 48, version=1, prefix="b")
    done0, done1 = await asyncio.gather(run_step(manager.endpoint, step0),
                                        run_step(manager.endpoint, step1, kill_a_v1_worker))
    assert killed
    for version, done in ((0, done0), (1, done1)):
        assert len(done) == 8 and not any(c.failed for c in done.values())
        assert {c.weight_version for c in done.values()} == {version}
    # run_step checked every streamed delta against its completion; the deltas themselves:
    # the manager drops any delta whose version differs from its request's (tracker), so a
    # complete, gap-free stream is made only of tokens of the step's version.
    assert sum(c.migrations for c in done1.values()) > 0, "the SIGKILL moved nothing"
    # Each request ran only on workers of its version: the v0 worker generated exactly the v0
    # step's tokens (none of v1's), and the surviving v1 worker none of v0's.
    assert tokens_generated(v0.metrics_port) == sum(len(c.token_ids) for c in done0.values())
    survivor = tokens_generated(v1[killed[0]].metrics_port)
    assert 0 < survivor <= sum(len(c.token_ids) for c in done1.values())
    st = await status(manager.endpoint)
    assert st.tokens_regenerated == 0
    assert {w.worker_id: w.weight_version for w in st.workers if w.state == "healthy"} == \
        {"v0": 0, f"v1-{killed[0]}": 1}
