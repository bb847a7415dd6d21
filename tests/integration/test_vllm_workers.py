"""vLLM workers as service processes under a real manager (`make test-vllm`): one job
mixing two vLLM workers and a torch worker on one checkpoint, a vLLM worker SIGKILLed mid-step
with no token lost or generated twice and its requests resumed on the others, and a weight load
into a vLLM worker that changes its outputs while the version fence holds.

One module-wide stack: a vLLM worker takes ~20 s to start on 2 cores.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import torch
from safetensors.torch import load_file, save_file

from rlharvest.common import rpc
from rlharvest.models.hf_checkpoint import build_checkpoint
from rlharvest.common.pb import common_pb2, rollout_manager_pb2 as mpb, rollout_worker_pb2 as wpb
from rlharvest.common.pb import rollout_worker_pb2_grpc
from rlharvest.services.rollout_manager.client import wait_workers
from rlharvest.services.rollout_worker.vllm_engine import vllm_missing

from .test_manager import run_step, scrape, start_manager, status
from tests.worker_sessions import add

from .worker_client import WorkerSession, launch_worker, wait_serving

pytestmark = [pytest.mark.integration, pytest.mark.vllm_stack,
              pytest.mark.skipif(bool(vllm_missing()), reason=vllm_missing() or "vLLM runs")]

PROMPTS = [[1, 17, 99, 250, 33, 7], [5, 400, 12, 88], [301, 2, 9, 77, 140], [60, 61, 62]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("ckpt") / "small", size="small", seed=6)


@pytest.fixture(scope="module")
def job(module_stack, checkpoint: Path, tmp_path_factory):
    weights_dir = tmp_path_factory.mktemp("weights")
    common = ["--model", str(checkpoint), "--max-len", "256", "--max-running", "6"]
    vllm = ["--engine", "vllm", "--kv-cache-gib", "0.25", "--weights-dir", str(weights_dir)]
    workers = {name: launch_worker(module_stack, name, *common, *flags) for name, flags in (
        # v0 is slowed (an emulated slower GPU) so it still holds requests when it is killed
        ("v0", [*vllm, "--step-delay-s", "0.05"]), ("v1", vllm), ("t0", []))}
    # The paper's migration rule: the cost-aware one (the default) may move every request off
    # a slower worker before the kill, leaving it none to lose.
    manager = start_manager(module_stack, "--migration-rule", "paper")
    for handle in workers.values():
        wait_serving(handle, 240)
    return workers, manager, weights_dir


def greedy_step(step_id: str, n: int, max_tokens: int, version: int = 0) -> mpb.SubmitStepRequest:
    return mpb.SubmitStepRequest(step_id=step_id, weight_version=version, requests=[
        mpb.RolloutRequest(request_id=f"{step_id}-{i}", group_id=f"g{i % len(PROMPTS)}",
                           prompt_token_ids=PROMPTS[i % len(PROMPTS)],
                           sampling=common_pb2.SamplingParams(temperature=0.0,
                                                              max_tokens=max_tokens))
        for i in range(n)])


def by_prompt(done: dict[str, mpb.Completion]) -> dict[int, set[tuple[int, ...]]]:
    """Completions grouped by prompt index: greedy on one checkpoint, each group is one."""
    groups: dict[int, set[tuple[int, ...]]] = {}
    for rid, c in done.items():
        groups.setdefault(int(rid.rsplit("-", 1)[1]) % len(PROMPTS), set()).add(
            tuple(c.token_ids))
    return groups


async def generate_on(worker, command) -> list[int]:
    session = WorkerSession(worker.endpoint)
    try:
        rid = command.add.request_id
        if command.add.generated_token_ids:  # its deltas continue after what it was given
            session.collected.expect_resume(rid, list(command.add.generated_token_ids))
        await session.send(command)
        return list((await session.finish([rid])).completions[rid].tokens)
    finally:
        await session.close()


def children(pid: int) -> set[int]:
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        found.update(int(c) for c in text)
    return found


async def healthy(manager, count: int) -> None:
    try:
        await wait_workers(manager.endpoint, count)
    except TimeoutError:  # say what the manager saw of each worker
        raise AssertionError(str(await status(manager.endpoint))) from None


async def test_one_job_mixes_vllm_and_torch_workers_and_survives_a_vllm_sigkill(job):
    workers, manager, _ = job
    await healthy(manager, 3)
    reference = await run_step(manager.endpoint, greedy_step("ref", 16, 32))
    assert len(reference) == 16 and not any(c.failed for c in reference.values())
    groups = by_prompt(reference)
    # vLLM and the torch engine agree token for token (greedy), whoever served each request
    assert all(len(tokens) == 1 for tokens in groups.values()), groups
    served = {w.worker_id: w for w in (await status(manager.endpoint)).workers}
    assert set(served) == {"v0", "v1", "t0"}

    # A request generated on one vLLM worker resumes on another from its tokens, greedy
    # identical (directly, over each worker's Session stream)
    whole = await generate_on(workers["v0"], add("whole", PROMPTS[0], max_tokens=24,
                                                 temperature=0))
    resumed = await generate_on(workers["v1"], add("resumed", PROMPTS[0], max_tokens=24,
                                                   temperature=0, generated=whole[:10]))
    assert len(whole) == 24 and resumed == whole  # the 10 it was given, then the same 14

    victim = workers["v0"].process.process
    vllm_children = children(victim.pid)
    assert vllm_children, "vLLM's CPU build runs its model in a worker process of its own"
    killed: list[bool] = []

    async def kill_mid_step(completions, streamed) -> None:
        if not killed and sum(map(len, streamed.values())) >= 120:
            # SIGKILL mid-step, of the worker's process alone (as the OOM killer would): vLLM's
            # model process must notice its parent's death by itself
            os.kill(victim.pid, signal.SIGKILL)
            killed.append(True)

    done = await run_step(manager.endpoint, greedy_step("kill", 16, 32), kill_mid_step)
    assert killed and len(done) == 16 and not any(c.failed for c in done.values())
    # resumed elsewhere (on v1 or t0) from the tokens it had: greedy, identical to clean
    assert by_prompt(done) == groups
    st = await status(manager.endpoint)
    assert st.tokens_regenerated == 0
    assert scrape(manager.metrics_port).get('rlh_manager_migrations_total{cause="lost"}', 0) >= 1
    deadline = time.monotonic() + 20  # vLLM's model process follows its parent out
    while any(Path(f"/proc/{pid}").exists() and _alive(pid) for pid in vllm_children):
        assert time.monotonic() < deadline, "vLLM's worker process outlived a SIGKILLed worker"
        await asyncio.sleep(0.2)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


async def test_a_weight_load_into_a_vllm_worker_changes_its_outputs_behind_the_fence(
        job, checkpoint: Path):
    workers, manager, weights_dir = job
    await healthy(manager, 2)
    before = await run_step(manager.endpoint, greedy_step("v0ref", 4, 24))
    tensors = load_file(checkpoint / "model.safetensors")
    gen = torch.Generator().manual_seed(1)
    delta = {name: tensors[name] + 0.5 * torch.randn(tensors[name].shape, generator=gen)
             for name in ("model.layers.0.self_attn.v_proj.weight", "model.layers.2.mlp.down_proj.weight")}
    save_file(delta, os.fspath(weights_dir / "v1.safetensors"))
    async with rpc.channel(workers["v1"].endpoint) as chan:
        reply = await rollout_worker_pb2_grpc.RolloutWorkerStub(chan).LoadWeights(
            wpb.LoadWeightsRequest(path="v1.safetensors", version=1, job="default"), timeout=60)
        assert reply.tensors_loaded == 2
        # the fence: a version-0 request is refused by the worker that now holds version 1
        info = await rollout_worker_pb2_grpc.RolloutWorkerStub(chan).GetInfo(
            wpb.GetInfoRequest(), timeout=10)
        assert info.weight_version == 1
    after = await run_step(manager.endpoint, greedy_step("v1", 4, 24, version=1))
    assert all(c.weight_version == 1 and not c.failed for c in after.values())
    assert by_prompt(after) != by_prompt(before)
    # version 0 is still served, by the torch worker alone, as before the load
    again = await run_step(manager.endpoint, greedy_step("v0again", 4, 24))
    assert by_prompt(again) == by_prompt(before)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        async with rpc.channel(workers["v1"].endpoint) as chan:
            await rollout_worker_pb2_grpc.RolloutWorkerStub(chan).LoadWeights(
                wpb.LoadWeightsRequest(path="../outside.safetensors", version=2, job="default"),
                timeout=10)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_make_run_with_the_vllm_engine_learns(tmp_path):
    """`make run ARGS="--engine vllm"`: the whole demo (20 GRPO steps, a spot worker SIGKILLed
    twice, a co-executor under traffic) on vLLM workers; the demo itself fails unless the
    reward rises (--min-rise, default 0.1)."""
    out = tmp_path / "out"
    result = subprocess.run([sys.executable, "-m", "rlharvest.cli.demo", "--engine", "vllm",
                             "--out", str(out), "--log-dir", str(tmp_path / "logs")],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    steps = json.loads((out / "steps.json").read_text())
    assert len(steps) == 20 and steps[-1]["weight_version"] == 19
    logs = (tmp_path / "logs" / "worker-0.log").read_text()
    assert "engine: vLLM" in logs and "loaded weights version 19" in logs, logs[-3000:]
