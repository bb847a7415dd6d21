"""`rlharvest-coexecutor` as a real process on the real stack: the job's manager borrows it in
etcd (ROSE §5) and places rollout requests on it like on any worker while it answers
OpenAI-compatible traffic (the official client); a SIGKILLed or returned co-executor loses no
rollout token (the manager migrates them); a claim lives as long as its manager, one job at a
time; an etcd outage lapses the lending while serving goes on."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import openai
import pytest

from rlharvest.common import keys
from rlharvest.common.lending_record import Claim, parse_claim
from rlharvest.common.local_etcd import LocalEtcd, free_port
from rlharvest.cli.launcher import LocalStack

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
def lent(stack, etcd_client):
    """A co-executor, one dedicated worker, and the default job's manager, which borrows it."""
    coexec, url = launch_coexecutor(stack, "coexec-0")
    worker = launch_worker(stack, "w0", "--max-running", "4")
    manager = start_manager(stack, "--max-serving-workers", "1")
    wait_serving(coexec, 120)
    wait_serving(worker, 120)
    return coexec, url, worker, manager


async def until(condition, timeout: float = 60.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while not (found := await condition()):
        assert time.monotonic() < deadline, f"{what} not met in {timeout}s"
        await asyncio.sleep(0.2)
    return found


async def member_job(client, coexec_id: str) -> str | None:
    found = await client.get(keys.member_key("coexecutor", coexec_id).encode())
    return json.loads(found.value)["job"] if found is not None else None


async def claim_of(client, coexec_id: str) -> Claim | None:
    found = await client.get(keys.lending_key(coexec_id).encode())
    return parse_claim(found.value if found is not None else None)


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
    assert scrape(manager.metrics_port)["rlh_manager_serving_workers_claimed"] == 1
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


async def test_sigterm_ends_a_serving_stream_in_flight_at_once_with_an_error_event(stack):
    """SIGTERM cancels the engine loop before the HTTP server closes: a stream still waiting
    for tokens ends with an error the client sees at once, rather than hanging until the
    server's shutdown timeout, and the process exits 0 without that wait."""
    coexec, url = launch_coexecutor(stack, "coexec-term", "--drain-timeout", "0")
    wait_serving(coexec, 120)
    api = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    # 500 tokens of the tiny model take many seconds here: in flight when the engine stops.
    stream = await api.completions.create(model="served", prompt="1", max_tokens=500,
                                          stream=True, extra_body={"ignore_eos": True})
    await anext(aiter(stream))
    started = time.monotonic()
    exited = asyncio.create_task(asyncio.to_thread(coexec.process.terminate, 60))
    with pytest.raises(openai.APIError, match="the serving engine stopped"):
        async with asyncio.timeout(20):
            async for _ in stream:
                pass
    assert await exited == 0
    assert time.monotonic() - started < 20


def gauge(handle: WorkerHandle, name: str) -> float:
    return scrape(handle.metrics_port).get(name, 0.0)


async def test_a_claim_lives_with_its_manager_and_lends_to_one_job_at_a_time(stack, etcd_client):
    coexec, url = launch_coexecutor(stack, "coexec-0")
    first = start_manager(stack, "--job", "a", "--manager-id", "ma",
                          "--max-serving-workers", "1")
    wait_serving(coexec, 120)

    async def serves(job: str) -> bool:
        return await member_job(etcd_client, "coexec-0") == job

    await until(lambda: serves("a"), what="lent to job a")
    await wait_workers(first.endpoint, 1)
    second = start_manager(stack, "--job", "b", "--manager-id", "mb",
                           "--max-serving-workers", "1")
    await asyncio.sleep(2)  # several lending rounds of the second manager
    assert await claim_of(etcd_client, "coexec-0") == Claim("a", "ma")  # one job at a time
    assert gauge(second, "rlh_manager_serving_workers_claimed") == 0
    first.process.kill()  # its lease (2 s) ends, and the claim with it
    await until(lambda: serves("b"), what="lent to job b after job a's manager died")
    assert await claim_of(etcd_client, "coexec-0") == Claim("b", "mb")
    await wait_workers(second.endpoint, 1)
    assert gauge(second, "rlh_manager_serving_workers_claimed") == 1
    assert gauge(coexec, 'rlh_coexec_lending_changes_total{change="returned"}') == 1
    assert await serve_traffic(url, 2) == [8, 8]  # serving never stopped


async def test_a_coexecutor_taken_back_mid_step_returns_its_rollout_with_every_token(
        stack, etcd_client):
    coexec, _ = launch_coexecutor(stack, "coexec-0")  # the job's only worker
    manager = start_manager(stack, "--max-serving-workers", "1")
    wait_serving(coexec, 120)
    await wait_workers(manager.endpoint, 1)
    reference = await run_step(manager.endpoint, step_request(8, 40, prefix="ref"))
    key = keys.lending_key("coexec-0").encode()
    handed: list[asyncio.Task] = []

    async def give_back_later() -> None:
        await asyncio.sleep(1.0)  # the requests wait in the manager meanwhile
        await etcd_client.delete(key)  # free again: the job's manager borrows it once more

    async def lend_elsewhere(completions, streamed):
        if not handed and sum(map(len, streamed.values())) >= 40:
            # An operator hands it to another job mid-step: the claim is replaced.
            await etcd_client.put(key, Claim("other", "operator").encode())
            handed.append(asyncio.create_task(give_back_later()))

    done = await run_step(manager.endpoint, step_request(8, 40, prefix="m"), lend_elsewhere)
    assert handed and len(done) == 8 and not any(c.failed for c in done.values())
    for i in range(8):  # resumed from the tokens they had: as if nothing happened
        assert list(done[f"m{i}"].token_ids) == list(reference[f"ref{i}"].token_ids), i
    assert (await status(manager.endpoint)).tokens_regenerated == 0
    # Its requests left it mid-step: ended by the co-executor as it was deactivated, or moved
    # by the manager that saw the claim go first (both watch the claim; either may act first).
    moved = sum(v for k, v in scrape(manager.metrics_port).items()
                if k.startswith("rlh_manager_migrations_total{"))
    assert gauge(coexec, 'rlh_coexec_rollout_aborts_total{cause="deactivated"}') + moved >= 1
    # Lent to default, to other, to default again; returned by default and by other.
    assert gauge(coexec, 'rlh_coexec_lending_changes_total{change="lent"}') == 3
    assert gauge(coexec, 'rlh_coexec_lending_changes_total{change="returned"}') == 2
    assert await claim_of(etcd_client, "coexec-0") == Claim("default", "manager-0")


async def test_an_etcd_outage_lapses_the_lending_while_serving_goes_on(tmp_path, fork_server):
    etcd = await asyncio.to_thread(LocalEtcd().start)
    local = LocalStack(tmp_path / "logs", etcd=etcd, fork_server=fork_server)
    try:
        # Leases longer than the outage: the claim outlives it, so the lending comes back.
        coexec, url = launch_coexecutor(local, "coexec-x", "--lease-ttl", "20",
                                        "--lending-lapse-s", "2", "--lending-probe-s", "0.5")
        manager = start_manager(local, "--lease-ttl", "20", "--max-serving-workers", "1")
        wait_serving(coexec, 120)
        await wait_workers(manager.endpoint, 1)
        assert gauge(coexec, "rlh_coexec_lent") == 1
        os.kill(etcd.process.pid, signal.SIGSTOP)
        try:
            async def lapsed() -> bool:
                return gauge(coexec, "rlh_coexec_lent") == 0

            await until(lapsed, timeout=30, what="the lending lapsed")
            assert await serve_traffic(url, 2) == [8, 8]  # no etcd, serving all the same
        finally:
            os.kill(etcd.process.pid, signal.SIGCONT)

        async def back() -> bool:
            return gauge(coexec, "rlh_coexec_lent") == 1

        await until(back, timeout=30, what="lent again once etcd answered")
        await wait_workers(manager.endpoint, 1)
    finally:
        for proc in local.processes:
            proc.kill()
        etcd.stop()


async def test_a_trajectorys_later_turns_on_a_coexecutor_take_over_its_parked_history(stack):
    """--prefix-cache on the co-executor (on serving GPUs): the manager sends each
    later turn back to the co-executor that served the last one, and there the turn takes over
    the pages its last turn left parked in the shared pool, prefilling only what it adds."""
    from bench.agentic_routing import run_trajectories

    coexec, _ = launch_coexecutor(stack, "coexec-pfx", "--prefix-cache", "--max-len", "1024",
                                  "--total-pages", "512", "--page-tokens", "16")
    manager = start_manager(stack, "--max-serving-workers", "1",
                            "--turn-routing", "turnwise+affinity")
    wait_serving(coexec, 120)
    await wait_workers(manager.endpoint, 1, timeout=60)
    await run_trajectories(manager.endpoint, "pfx", count=2, turns=3)
    routed = scrape(manager.metrics_port)
    assert routed['rlh_manager_turns_routed{outcome="affinity"}'] == 2 * 2
    seen = scrape(coexec.metrics_port)
    assert seen["rlh_worker_prefix_cache_hits_total"] == 2 * 2
    assert seen["rlh_worker_prefix_cache_saved_tokens_total"] >= 2 * 2 * 300
