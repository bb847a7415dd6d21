"""`rlharvest-coexecutor` as a real process on the real stack: the job's manager places rollout
requests on it like on any worker while it answers OpenAI-compatible traffic (the official
client), and a SIGKILLed co-executor loses no rollout token (the manager migrates them)."""

from __future__ import annotations

import asyncio

import openai
import pytest

from rlharvest.common.local_etcd import free_port

from .test_manager import run_step, scrape, start_manager, status, step_request, wait_workers
from .worker_client import WorkerHandle, launch_worker, wait_serving

pytestmark = pytest.mark.integration


def launch_coexecutor(stack, name: str, *extra: str) -> tuple[WorkerHandle, str]:
    port, metrics_port, http_port = free_port(), free_port(), free_port()
    proc = stack.start("coexecutor", name, [
        "--coexec-id", name, "--port", str(port), "--metrics-port", str(metrics_port),
        "--http-port", str(http_port), "--lease-ttl", "2", "--torch-threads", "1",
        "--serving-model", "tiny", "--served-model-name", "served", "--max-running", "8",
        "--ttft-slo-ms", "2000", "--tpot-slo-ms", "500", *extra])
    return WorkerHandle(proc, f"127.0.0.1:{port}", metrics_port), f"http://127.0.0.1:{http_port}"


@pytest.fixture
def lent(stack):
    """A co-executor lent to the default job, one dedicated worker, the job's manager."""
    coexec, url = launch_coexecutor(stack, "coexec-0")
    worker = launch_worker(stack, "w0", "--max-running", "4")
    manager = start_manager(stack)
    wait_serving(coexec, 120)
    wait_serving(worker, 120)
    return coexec, url, worker, manager


async def serve_traffic(url: str, count: int) -> list[int]:
    api = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    replies = await asyncio.gather(*(
        api.completions.create(model="served", prompt=f"{i}+{i}=", max_tokens=8, seed=i,
                               extra_body={"ignore_eos": True}) for i in range(count)))
    return [r.usage.completion_tokens for r in replies]


async def test_the_manager_places_rollout_on_it_while_it_serves_openai_traffic(lent):
    coexec, url, _, manager = lent
    await wait_workers(manager.endpoint, 2)
    kinds = {w.worker_id: w.kind for w in (await status(manager.endpoint)).workers}
    assert set(kinds) == {"coexec-0", "w0"}
    step = asyncio.create_task(run_step(manager.endpoint, step_request(12, 24)))
    served = await serve_traffic(url, 6)
    done = await step
    assert served == [8] * 6
    assert len(done) == 12 and not any(c.failed for c in done.values())
    assert all(len(c.token_ids) == 24 for c in done.values())
    metrics = scrape(coexec.metrics_port)
    assert metrics["rlh_worker_tokens_generated_total"] > 0  # it harvested rollout tokens
    assert metrics['rlh_coexec_serving_requests_total{outcome="ok"}'] == 6
    assert sum(metrics.get(f'rlh_coexec_serving_slo_total{{met="{m}"}}', 0)
               for m in ("yes", "no")) == 6  # every finished serving request judged
    pages = [v for k, v in metrics.items() if k.startswith("rlh_coexec_pages{")]
    assert len(pages) == 4 and sum(pages) == 512  # the pool, by state, conserved
    assert metrics["rlh_coexec_rollout_budget_pages"] > 0
    assert metrics['rlh_coexec_ticks_total{action="rollout"}'] > 0
    assert metrics["rlh_coexec_rollout_tokens_total"] == metrics["rlh_worker_tokens_generated_total"]
    assert (await status(manager.endpoint)).tokens_regenerated == 0


async def test_a_sigkilled_coexecutor_loses_no_rollout_token(lent):
    coexec, _, _, manager = lent
    await wait_workers(manager.endpoint, 2)
    reference = await run_step(manager.endpoint, step_request(8, 40, prefix="ref"))
    killed: list[bool] = []

    async def kill_mid_step(completions, streamed):
        if not killed and sum(map(len, streamed.values())) >= 60:
            coexec.process.kill()
            killed.append(True)

    done = await run_step(manager.endpoint, step_request(8, 40, prefix="k"), kill_mid_step)
    assert killed and len(done) == 8 and not any(c.failed for c in done.values())
    for i in range(8):  # seeded sampling keyed by (seed, position): as if nothing happened
        assert list(done[f"k{i}"].token_ids) == list(reference[f"ref{i}"].token_ids), i
    assert (await status(manager.endpoint)).tokens_regenerated == 0


async def test_sigterm_mid_step_drains_rollout_to_the_worker_and_exits_0(lent):
    coexec, url, _, manager = lent
    await wait_workers(manager.endpoint, 2)
    assert await serve_traffic(url, 2) == [8, 8]
    stopping: list[asyncio.Task] = []

    async def stop_mid_step(completions, streamed):
        if not stopping and sum(map(len, streamed.values())) >= 40:
            stopping.append(asyncio.create_task(asyncio.to_thread(coexec.process.terminate)))

    done = await run_step(manager.endpoint, step_request(8, 40, prefix="t"), stop_mid_step)
    assert stopping and await stopping[0] == 0  # drained, deregistered, exit code 0
    assert len(done) == 8 and not any(c.failed for c in done.values())
    assert all(len(c.token_ids) == 40 for c in done.values())
    assert (await status(manager.endpoint)).tokens_regenerated == 0
    assert "co-executor coexec-0 stopped" in coexec.process.log_path.read_text()
