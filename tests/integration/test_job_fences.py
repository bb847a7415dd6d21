"""On real processes: two jobs sharing a cluster, their weights distinct, sit at the same
version numbers, and every completion each job gets is exactly what a worker holding only that
job's weights generates (greedy references computed here). A manager admits only its job's
workers; a worker refuses another job's requests and adopts kept requests only for their own
job; version 0 is fenced by the start weights' fingerprint; a co-executor handed from one job to
the other mid-step takes the new job's requests only once that job's weights are loaded."""

from __future__ import annotations

import asyncio
import json

import pytest
from safetensors.torch import save_file

from rlharvest.common import keys, start_weights
from rlharvest.common.lending_record import Claim
from rlharvest.common.pb import common_pb2, rollout_manager_pb2 as mpb
from rlharvest.services.transfer_agent.client import publish

from ..builders import greedy_reference, job_weights
from .test_coexecutor import gauge, launch_coexecutor, member_job, until
from .test_manager import PROMPTS, run_step, scrape, start_manager, status
from .test_transfer_agent import start_agent
from .worker_client import launch_worker, wait_serving

pytestmark = pytest.mark.integration

JOBS = {"ja": 1, "jb": 2}  # job -> the seed of its own start weights
MAX_TOKENS = 16
N = 8


def greedy_step(version: int) -> mpb.SubmitStepRequest:
    """The same step for either job: a trainer's ids (s{step}-g{g}-r{r}) and prompts collide
    across jobs that share a data seed."""
    return mpb.SubmitStepRequest(step_id="s0", weight_version=version, requests=[
        mpb.RolloutRequest(request_id=f"s0-g{i // 4}-r{i % 4}", group_id=f"g{i // 4}",
                           prompt_token_ids=PROMPTS[i % len(PROMPTS)],
                           sampling=common_pb2.SamplingParams(temperature=0.0,
                                                              max_tokens=MAX_TOKENS))
        for i in range(N)])


def references() -> dict[str, tuple[dict[str, list[int]], str]]:
    """Per job: the greedy completions of ``greedy_step`` on its weights, and their fingerprint."""
    prompts = {r.request_id: list(r.prompt_token_ids) for r in greedy_step(0).requests}
    refs = {job: greedy_reference(job_weights(seed), prompts, MAX_TOKENS)
            for job, seed in JOBS.items()}
    assert refs["ja"][0] != refs["jb"][0], "the two jobs' weights must generate differently"
    return refs


async def own_start_weights(etcd_client, tmp_path, refs) -> dict:
    """Each job's start weights in a file (a worker's --weights), and their fingerprint in etcd
    as the job's trainer writes it before its first step."""
    files = {}
    for job, seed in JOBS.items():
        files[job] = tmp_path / f"{job}.safetensors"
        save_file(job_weights(seed), str(files[job]))
        await etcd_client.put(keys.start_weights_key(job).encode(),
                              start_weights.record(refs[job][1], f"tiny seed {seed} x10"))
    return files


def assert_own_tokens(done: dict[str, mpb.Completion], reference: dict[str, list[int]],
                      job: str) -> None:
    assert len(done) == N and not any(c.failed for c in done.values()), job
    for rid, completion in done.items():
        assert list(completion.token_ids) == reference[rid], f"{job} {rid}: another policy's tokens"


async def workers_of(manager) -> set[str]:
    return {w.worker_id for w in (await status(manager.endpoint)).workers}


async def test_two_jobs_at_equal_versions_on_shared_workers_each_train_only_their_own_tokens(
        stack, etcd_client, tmp_path):
    refs = references()
    files = await own_start_weights(etcd_client, tmp_path, refs)
    workers = [launch_worker(stack, f"w-{job}", "--job", job, "--weights", str(files[job]),
                             "--max-running", "4") for job in JOBS]
    # Named for job ja but started from jb's weights: at version 0 it holds jb's policy.
    stray = launch_worker(stack, "w-stray", "--job", "ja", "--weights", str(files["jb"]),
                          "--max-running", "4")
    managers = {job: start_manager(stack, "--job", job, "--manager-id", f"m-{job}")
                for job in JOBS}
    for worker in (*workers, stray):
        wait_serving(worker, 120)
    await until(lambda: _pools_are(managers, {"ja": {"w-ja", "w-stray"}, "jb": {"w-jb"}}),
                what="each manager sees only its job's workers")
    done = await asyncio.gather(*(run_step(managers[job].endpoint, greedy_step(0))
                                  for job in JOBS))
    for job, completions in zip(JOBS, done):
        assert_own_tokens(completions, refs[job][0], job)
        assert (await status(managers[job].endpoint)).tokens_regenerated == 0
    # The stray worker's start weights are not job ja's: it got none of ja's version-0 work.
    assert scrape(stray.metrics_port).get("rlh_worker_tokens_generated_total", 0) == 0


async def _pools_are(managers, expected: dict[str, set[str]]) -> bool:
    return all([await workers_of(managers[job]) == want for job, want in expected.items()])


async def test_a_coexecutor_handed_between_jobs_mid_step_gives_each_job_only_its_own_tokens(
        stack, etcd_client):
    """Both jobs at version 1 (published to an agent, as their trainers would); the co-executor
    serves job ja's step, is handed to job jb mid-step, and serves jb's step of the same
    request ids: ja's requests it held go back to ja's worker with their tokens, and jb's it
    takes only once jb's weights are in."""
    refs = references()
    _, agent, _ = start_agent(stack, "agent-0")
    for job, seed in JOBS.items():
        await publish(agent, job, 1, job_weights(seed))
    # ja's own worker is slow, so ja's step is still running when the co-executor is handed.
    workers = {job: launch_worker(stack, f"w-{job}", "--job", job, "--agent-pull",
                                  "--max-running", "4",
                                  *(("--step-delay-s", "0.1") if job == "ja" else ()))
               for job in JOBS}
    coexec, _ = launch_coexecutor(stack, "coexec-0", "--agent-pull")
    managers = {"ja": start_manager(stack, "--job", "ja", "--manager-id", "m-ja",
                                    "--max-serving-workers", "1")}
    for handle in (*workers.values(), coexec):
        wait_serving(handle, 120)
    managers["jb"] = start_manager(stack, "--job", "jb", "--manager-id", "m-jb")
    await until(lambda: _at_version(managers["ja"], {"w-ja", "coexec-0"}, 1),
                what="job ja's worker and the co-executor at ja's version 1")
    handed: list[bool] = []
    key = keys.lending_key("coexec-0").encode()
    served_a: list[float] = []  # the co-executor's tokens when it was handed over

    async def hand_to_jb(completions, streamed):
        if not handed and sum(map(len, streamed.values())) >= N * 2:
            served_a.append(gauge(coexec, "rlh_worker_tokens_generated_total"))
            await etcd_client.put(key, Claim("jb", "operator").encode())  # an operator's move
            handed.append(True)

    step_a = asyncio.create_task(run_step(managers["ja"].endpoint, greedy_step(1), hand_to_jb))
    await until(lambda: _handed(etcd_client, handed), what="the co-executor serving job jb")
    await until(lambda: _at_version(managers["jb"], {"w-jb", "coexec-0"}, 1),
                what="the co-executor at jb's version 1")
    before = gauge(coexec, "rlh_worker_tokens_generated_total")
    done_b = await run_step(managers["jb"].endpoint, greedy_step(1))
    assert gauge(coexec, "rlh_worker_tokens_generated_total") > before  # it served jb's step
    done_a = await step_a
    assert served_a[0] > 0  # handed mid-step: it had generated some of ja's step
    # Version 1 of each job here is its start weights published again: the same policy.
    assert_own_tokens(done_a, refs["ja"][0], "ja")
    assert_own_tokens(done_b, refs["jb"][0], "jb")
    assert gauge(coexec, 'rlh_coexec_lending_changes_total{change="lent"}') == 2
    healthy = {w.worker_id for w in (await status(managers["ja"].endpoint)).workers
               if w.state == "healthy"}
    assert healthy == {"w-ja"}  # ja's manager let go of it


async def _handed(etcd_client, handed: list[bool]) -> bool:
    return bool(handed) and await member_job(etcd_client, "coexec-0") == "jb"


async def _at_version(manager, names: set[str], version: int) -> bool:
    workers = {w.worker_id: w for w in (await status(manager.endpoint)).workers}
    return all(n in workers and workers[n].weight_version == version and
               workers[n].state == "healthy" for n in names)


async def test_a_placed_worker_switching_jobs_serves_each_only_with_that_jobs_weights(
        stack, etcd_client, tmp_path):
    """WEAVE's node turn passes from job ja to jb mid-step and back. The placed worker started
    from ja's weights: as jb's version 0 those are not jb's start weights, so jb's manager sends
    it nothing (jb's own worker serves jb's step, the same request ids), and nothing it kept
    for ja's manager is adopted by jb's. Back on ja (a warm load), ja's step ends on ja's
    weights, every token once."""
    refs = references()
    files = await own_start_weights(etcd_client, tmp_path, refs)
    node = keys.placement_node_key("node-1").encode()
    await etcd_client.put(node, b'{"turn": "ja"}')
    placed = launch_worker(stack, "w-placed", "--placement-node", "node-1", "--weights",
                           str(files["ja"]), "--max-running", "8", "--step-delay-s", "0.05")
    own_b = launch_worker(stack, "w-jb", "--job", "jb", "--weights", str(files["jb"]),
                          "--max-running", "8")
    managers = {job: start_manager(stack, "--job", job, "--manager-id", f"m-{job}")
                for job in JOBS}
    for handle in (placed, own_b):
        wait_serving(handle, 120)
    await until(lambda: _pools_are(managers, {"ja": {"w-placed"}, "jb": {"w-jb"}}),
                what="the placed worker serving job ja")
    switched: list[bool] = []

    async def turn_to_jb(completions, streamed):
        if not switched and sum(map(len, streamed.values())) >= N * 2:
            await etcd_client.put(node, b'{"turn": "jb"}')
            switched.append(True)

    step_a = asyncio.create_task(run_step(managers["ja"].endpoint, greedy_step(0), turn_to_jb))
    await until(lambda: _serving_job(etcd_client, "w-placed", "jb"), what="the turn of jb")
    done_b = await run_step(managers["jb"].endpoint, greedy_step(0))
    assert_own_tokens(done_b, refs["jb"][0], "jb")
    await etcd_client.put(node, b'{"turn": "ja"}')
    done_a = await step_a
    assert_own_tokens(done_a, refs["ja"][0], "ja")
    metrics = scrape(placed.metrics_port)
    assert metrics['rlh_worker_job_switches_total{load="warm"}'] == 1  # ja's weights came back
    assert metrics.get('rlh_worker_kept_request_outcomes_total{outcome="adopted"}', 0) == 0
    for job in JOBS:
        assert (await status(managers[job].endpoint)).tokens_regenerated == 0


async def _serving_job(etcd_client, worker_id: str, job: str) -> bool:
    found = await etcd_client.get(keys.member_key("rollout_worker", worker_id).encode())
    return found is not None and json.loads(found.value).get("job") == job
