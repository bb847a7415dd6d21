"""A job's rollout manager split into two shards (real etcd, manager and worker processes): a
step fans out over both and every request completes once; a shard's leader SIGKILLed mid-step
hands its part to its standby with no token generated twice; queued requests cross to a shard
whose workers are idle. The trainer's client (shard_client.py) drives every step."""

from __future__ import annotations

import asyncio
import itertools
import signal

import pytest

from rlharvest.common import delta_batch, registry
from rlharvest.common.local_etcd import free_port
from rlharvest.common.pb import rollout_manager_pb2 as mpb
from rlharvest.services.rollout_manager.client import ManagerAt, locate_manager
from rlharvest.services.rollout_manager.shard_client import JobStepStream, ShardedStep
from rlharvest.services.rollout_manager.sharding import shard_of

from .test_manager import scrape, status, step_request, wait_workers
from .test_trainer import sampled_by_workers, wait_manager_roles
from .worker_client import WorkerHandle, launch_worker, wait_serving

pytestmark = pytest.mark.integration
SHARDS = 2


def worker_ids(shard: int, count: int) -> list[str]:
    """The first ``count`` ids w<i> that belong to ``shard`` (crc32(id) mod SHARDS)."""
    ids = (f"w{i}" for i in itertools.count())
    return list(itertools.islice((w for w in ids if shard_of(w, SHARDS) == shard), count))


def start_shard_manager(stack, shard: int, name: str, *extra: str) -> WorkerHandle:
    """A manager of ``shard`` (not waited for: a standby serves only once it leads)."""
    port, metrics_port = free_port(), free_port()
    proc = stack.start("rollout_manager", name, [
        "--manager-id", name, "--shards", str(SHARDS), "--shard-index", str(shard),
        "--port", str(port), "--metrics-port", str(metrics_port), "--stall-timeout-s", "5",
        "--lease-ttl", "2", "--reattach-grace-s", "0", *extra])
    return WorkerHandle(proc, f"127.0.0.1:{port}", metrics_port)


class Record:
    """The trainer's side of a step (StepReader): asserts every streamed delta continues its
    request without gap and every completion comes once, and resumes from what streamed."""

    def __init__(self, request: mpb.SubmitStepRequest) -> None:
        self.request = request
        self.streamed: dict[str, tuple[list[int], list[float]]] = {}
        self.completions: dict[str, mpb.Completion] = {}
        self.successors: list[ManagerAt] = []

    def tokens(self) -> int:
        return sum(len(tokens) for tokens, _ in self.streamed.values())

    def take(self, event: mpb.StepEvent, request_ids: list[str]) -> None:
        for row in delta_batch.decode(event.batch).iter():
            rid = request_ids[row.request]
            tokens, logprobs = self.streamed.setdefault(rid, ([], []))
            assert row.position == len(tokens), f"{rid}: gap or duplicate at {row.position}"
            tokens.extend(row.token_ids)
            logprobs.extend(row.logprobs)
        for c in event.completions:
            assert c.request_id not in self.completions, f"{c.request_id} completed twice"
            assert not c.failed, c
            assert list(c.token_ids) == self.streamed.get(c.request_id, ([], []))[0]
            self.completions[c.request_id] = c

    def resume(self, of: mpb.SubmitStepRequest | None = None) -> mpb.SubmitStepRequest:
        of = self.request if of is None else of
        again = mpb.SubmitStepRequest()
        again.CopyFrom(of)
        del again.requests[:]
        for original in of.requests:
            if original.request_id in self.completions:
                continue
            resumed = again.requests.add()
            resumed.CopyFrom(original)
            tokens, logprobs = self.streamed.get(original.request_id, ([], []))
            del resumed.resume_token_ids[:], resumed.resume_logprobs[:]
            resumed.resume_token_ids.extend(tokens)
            resumed.resume_logprobs.extend(logprobs)
        return again

    def failed_over(self, successor: ManagerAt) -> None:
        self.successors.append(successor)


async def sharded_step(etcd_client, request: mpb.SubmitStepRequest, record: Record,
                       **kwargs) -> ShardedStep:
    step = ShardedStep(etcd_client, "default", SHARDS, max_message_bytes=64 << 20,
                       resume_wait_s=60.0, **kwargs)
    await asyncio.wait_for(step.run(request, record), 180)
    assert set(record.completions) == {r.request_id for r in request.requests}
    return step


async def test_a_two_shard_step_fans_out_by_capacity_and_completes_every_request_once(
        stack, etcd_client):
    workers = [launch_worker(stack, w, "--max-running", "4")
               for shard in range(SHARDS) for w in worker_ids(shard, 2)]
    managers = [start_shard_manager(stack, shard, f"manager-{shard}") for shard in range(SHARDS)]
    for handle in (*managers, *workers):
        wait_serving(handle, 120)
    for manager in managers:  # each shard sees its own two workers, never the other's
        await wait_workers(manager.endpoint, 2)
        assert len((await status(manager.endpoint)).workers) == 2
    located = await locate_manager(etcd_client, "default")
    assert located.shards == SHARDS
    request = step_request(16, 12)
    record = Record(request)
    stream = JobStepStream(etcd_client, "default", located, max_message_bytes=64 << 20,
                           resume_wait_s=30.0)
    await asyncio.wait_for(stream.run(request, record), 180)  # the trainer's entry point
    assert set(record.completions) == {r.request_id for r in request.requests}
    statuses = [await status(m.endpoint) for m in managers]
    assert [s.completions for s in statuses] == [8, 8]  # equal capacity: equal parts
    assert all(s.tokens_regenerated == 0 and s.in_flight == 0 for s in statuses)
    assert sum(s.tokens_generated for s in statuses) == record.tokens()


async def test_a_sigkilled_shard_leaders_standby_finishes_its_part_with_no_token_generated_twice(
        stack, etcd_client):
    # Slowed workers (50 ms an engine step): the kill lands with most of the step to run. JSQ:
    # Algorithm 2's in-shard migrations may waste the one engine step a worker runs before
    # their abort lands, which would blur the count of sampled tokens.
    workers = [launch_worker(stack, w, "--max-running", "4", "--step-delay-s", "0.05")
               for shard in range(SHARDS) for w in worker_ids(shard, 2)]
    leader = start_shard_manager(stack, 0, "leader-0", "--balancer", "jsq")
    other = start_shard_manager(stack, 1, "leader-1", "--balancer", "jsq")
    for handle in (leader, other, *workers):
        wait_serving(handle, 120)
    standby = start_shard_manager(stack, 0, "standby-0", "--balancer", "jsq")
    await wait_manager_roles(etcd_client, ["leader", "leader", "standby"])
    for manager in (leader, other):
        await wait_workers(manager.endpoint, 2)
    request = step_request(16, 40)
    record = Record(request)
    run = asyncio.create_task(sharded_step(etcd_client, request, record))
    part_of_0 = {r.request_id for r in request.requests[:8]}
    while sum(len(record.streamed.get(rid, ([], []))[0]) for rid in part_of_0) < 40:
        assert not run.done(), run
        await asyncio.sleep(0.02)
    leader.process.kill()  # SIGKILL mid-step
    step = await run
    assert [s.shard for s in record.successors] == [0]
    assert record.successors[0].endpoint == standby.endpoint
    members = await registry.list_members(etcd_client, "rollout_worker")
    assert sampled_by_workers(members) == record.tokens()  # each token sampled once
    successor = await status(standby.endpoint)
    assert successor.tokens_regenerated == 0 and successor.in_flight == 0
    assert step.moved == 0


async def test_queued_requests_cross_to_a_shard_whose_workers_are_idle(stack, etcd_client):
    """Shard 1 has no worker when the step is split, so shard 0 takes it all and queues most of
    it; shard 1's worker then joins, idle, and the queued requests move there: withdrawn by
    shard 0 (only those that never reached its worker) and run once, on shard 1."""
    (busy,) = worker_ids(0, 1)
    (late,) = worker_ids(1, 1)
    managers = [start_shard_manager(stack, shard, f"manager-{shard}") for shard in range(SHARDS)]
    worker = launch_worker(stack, busy, "--max-running", "2", "--step-delay-s", "0.05")
    for handle in (*managers, worker):
        wait_serving(handle, 120)
    await wait_workers(managers[0].endpoint, 1)
    request = step_request(16, 24)
    record = Record(request)
    run = asyncio.create_task(sharded_step(etcd_client, request, record, poll_s=0.1))
    while (await status(managers[0].endpoint)).waiting == 0:
        assert not run.done(), run
        await asyncio.sleep(0.05)
    wait_serving(launch_worker(stack, late, "--max-running", "4"), 120)
    step = await run
    first, second = [await status(m.endpoint) for m in managers]
    assert step.moved > 0 and second.completions == step.moved
    assert first.completions + second.completions == len(request.requests)
    assert first.tokens_regenerated == second.tokens_regenerated == 0
    assert scrape(managers[0].metrics_port)["rlh_manager_withdrawn_total"] == step.moved
    members = await registry.list_members(etcd_client, "rollout_worker")
    assert sampled_by_workers(members) == record.tokens()  # none ran on both shards


# ---- the manager's worker-fault tests, on one manager and on two shards ------------------------

@pytest.fixture(params=[1, 2], ids=["shards=1", "shards=2"])
def job(request, etcd_client, stack):
    """Workers w0 (slowed: still holding requests late in a step), w1 and, on two shards, w4
    of shard 1 (w0 and w1 are shard 0's); the job's one manager or a manager per shard."""
    # etcd_client first: it empties the keyspace, which would take the member records.
    shards = request.param
    names = ["w0", "w1"] + (worker_ids(1, 1) if shards > 1 else ["w2"])
    workers = {name: launch_worker(stack, name, "--max-running", "4", "--shutdown-grace", "1",
                                   *(("--step-delay-s", "0.05") if name == "w0" else ()))
               for name in names}
    flags = ("--migration-rule", "paper")  # as test_manager.py's cluster: w0 keeps its own
    managers = [start_shard_manager(stack, s, f"manager-{s}", *flags) for s in range(shards)] \
        if shards > 1 else [start_plain_manager(stack, *flags)]
    for handle in (*managers, *workers.values()):
        wait_serving(handle, 120)
    return shards, workers, managers


def start_plain_manager(stack, *extra: str) -> WorkerHandle:
    port, metrics_port = free_port(), free_port()
    proc = stack.start("rollout_manager", "manager", [
        "--port", str(port), "--metrics-port", str(metrics_port), "--stall-timeout-s", "5",
        "--lease-ttl", "2", "--reattach-grace-s", "0", *extra])
    return WorkerHandle(proc, f"127.0.0.1:{port}", metrics_port)


async def client_step(etcd_client, request: mpb.SubmitStepRequest, on_tokens=None
                      ) -> Record:
    """The step through the trainer's client (fanned out when the job has shards);
    ``on_tokens(record)`` runs while it streams."""
    record = Record(request)
    stream = JobStepStream(etcd_client, "default",
                           await locate_manager(etcd_client, "default"),
                           max_message_bytes=64 << 20, resume_wait_s=30.0)
    run = asyncio.create_task(stream.run(request, record))
    while on_tokens is not None and not run.done():
        await on_tokens(record)
        await asyncio.sleep(0.02)
    await asyncio.wait_for(run, 180)
    assert set(record.completions) == {r.request_id for r in request.requests}
    return record


async def wait_job_workers(job) -> None:
    shards, workers, managers = job
    for manager in managers:
        await wait_workers(manager.endpoint, len(workers) if shards == 1 else 1)


async def test_a_sigkilled_worker_loses_no_token_on_one_manager_or_two_shards(job, etcd_client):
    shards, workers, managers = job
    await wait_job_workers(job)
    reference = await client_step(etcd_client, step_request(12, 48, prefix="ref"))

    async def kill_midway(record: Record) -> None:
        if workers["w0"].process.alive() and record.tokens() >= 200:
            workers["w0"].process.kill()  # SIGKILL mid-step

    killed = await client_step(etcd_client, step_request(12, 48, prefix="k"), kill_midway)
    assert not workers["w0"].process.alive()
    for i in range(12):  # seeded sampling keyed by (seed, position): the same tokens
        assert list(killed.completions[f"k{i}"].token_ids) == \
            list(reference.completions[f"ref{i}"].token_ids), i
    for manager in managers:
        assert (await status(manager.endpoint)).tokens_regenerated == 0
    assert scrape(managers[0].metrics_port).get(
        'rlh_manager_migrations_total{cause="lost"}', 0) >= 1  # the kill moved requests


async def test_a_drained_worker_hands_its_requests_on_on_one_manager_or_two_shards(
        job, etcd_client):
    shards, workers, managers = job
    await wait_job_workers(job)

    async def drain_midway(record: Record) -> None:
        if workers["w0"].process.alive() and record.tokens() >= 60 and \
                workers["w0"].process.process.returncode is None and not drained:
            workers["w0"].process.process.send_signal(signal.SIGTERM)
            drained.append(True)

    drained: list[bool] = []
    await client_step(etcd_client, step_request(12, 60), drain_midway)
    assert drained
    code = await asyncio.to_thread(workers["w0"].process.process.wait, 30)
    assert code == 0, workers["w0"].process.log_tail()
    samples = scrape(managers[0].metrics_port)
    assert samples['rlh_manager_migrations_total{cause="drain"}'] >= 1
    assert samples.get('rlh_manager_migrations_total{cause="lost"}', 0) == 0
    for manager in managers:
        assert (await status(manager.endpoint)).tokens_regenerated == 0


async def test_running_requests_cross_shards_with_every_token(stack, etcd_client):
    """Shard 0's worker runs the whole step (JSQ: every request dispatched to it at once);
    shard 1's worker joins idle and the client moves every open request there, those queued
    on the worker and the running ones with their tokens: each resumes on shard 1 after its
    last token, and every completion equals that of an unmoved run with the same seeds. (Aborting a running request wastes the engine steps its worker ran before the
    abort landed, as a migration within a shard does: not counted here.)"""
    (busy,) = worker_ids(0, 1)
    (late,) = worker_ids(1, 1)
    managers = [start_shard_manager(stack, shard, f"manager-{shard}", "--balancer", "jsq")
                for shard in range(SHARDS)]
    worker = launch_worker(stack, busy, "--max-running", "4", "--step-delay-s", "0.05")
    for handle in (*managers, worker):
        wait_serving(handle, 120)
    await wait_workers(managers[0].endpoint, 1)
    reference = Record(step_request(8, 64, prefix="ref"))
    await sharded_step(etcd_client, reference.request, reference)
    request = step_request(8, 64, prefix="m")
    record = Record(request)
    step = ShardedStep(etcd_client, "default", SHARDS, max_message_bytes=64 << 20,
                       resume_wait_s=60.0, poll_s=3600)  # only the moves below
    run = asyncio.create_task(step.run(request, record))
    while record.tokens() < 16:
        assert not run.done(), run
        await asyncio.sleep(0.02)
    wait_serving(launch_worker(stack, late, "--max-running", "8"), 120)
    await wait_workers(managers[1].endpoint, 1)
    await step.move(request, record, True, src=0, dst=1, count=8)
    await asyncio.wait_for(run, 180)
    arrived = [r for p in step.parts if p.shard == 1 for r in p.request.requests]
    assert len(arrived) == step.moved >= 1
    assert any(r.resume_token_ids for r in arrived)  # running ones came with their tokens
    # Record checked that each request's deltas continued without gap or repeat across the
    # move (a resume from an earlier token would repeat positions); seeded sampling keyed by
    # (seed, position) then gives the unmoved run's tokens.
    for i in range(8):
        assert list(record.completions[f"m{i}"].token_ids) == \
            list(reference.completions[f"ref{i}"].token_ids), i
    second = await status(managers[1].endpoint)
    assert second.completions == step.moved and second.tokens_regenerated == 0
