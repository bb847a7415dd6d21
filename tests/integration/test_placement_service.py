"""The placement scheduler as real processes against a real etcd, driven over gRPC by the job
client library: permits never overlap on a node, a SIGKILLed scheduler (restarted, or replaced
by a standby) loses no place and no permit and no phase runs twice, a failed job leaves its
group and comes back as a new arrival, and bad input gets a precise status."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from collections.abc import Callable

import grpc
import psutil
import pytest

from rlharvest.common import registry
from rlharvest.common.local_etcd import free_port
from rlharvest.common.pb import placement_scheduler_pb2 as pb
from rlharvest.services.placement_scheduler.client import (
    JobLeftError, JobSpec, PhaseRun, PlacementJob, SchedulerClient)
from rlharvest.services.placement_scheduler.model import JobProfile, Pool

from .worker_client import WorkerHandle, wait_serving

pytestmark = pytest.mark.integration

# Worst-case estimates far above the real phase times of these tests, so no drift eviction.
SPEC = dict(t_roll_s=10.0, t_train_s=10.0, slo=2.0)
PROFILE = JobProfile(batch_size=64, prompt_tokens=256, max_response_tokens=1024,
                     decode_s_per_token=0.01, prefill_s=1.0, train_tokens_per_s=20_000.0)


def start_scheduler(stack, name: str, *extra: str, leader: bool = True) -> WorkerHandle:
    port = free_port()
    proc = stack.start("placement_scheduler", name, [
        "--scheduler-id", name, "--port", str(port), "--lease-ttl", "2", "--json-logs",
        "--rollout-nodes", "2", "--train-nodes", "1", *extra])
    handle = WorkerHandle(proc, f"127.0.0.1:{port}", 0)
    if leader:
        wait_serving(handle, 60)
    return handle


async def wait_standby(etcd, name: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not any(k.endswith("/" + name) for k in await registry.list_members(
            etcd, "placement_scheduler")):
        assert time.monotonic() < deadline, f"standby {name} did not register"
        await asyncio.sleep(0.1)


async def drive(job: PlacementJob, iterations: int, runs: list, phase_s: float,
                in_phase: Callable[[PhaseRun], None] | None = None) -> None:
    """The job's training loop under the shim: every phase records where and when it ran.
    ``in_phase`` is called at the start of every phase, while the phase's permit is held."""

    async def phase(run: PhaseRun) -> None:
        start = time.monotonic()
        if in_phase is not None:
            in_phase(run)
        await asyncio.sleep(phase_s)
        runs.append((job.spec.job_id, run.phase, run.iteration, tuple(run.node_ids), start,
                     time.monotonic()))

    rollout, train = job.rollout(phase), job.train(phase)
    for _ in range(iterations):
        await rollout()
        await train()


def assert_no_overlap_and_no_repeat(runs: list, jobs: dict[str, int]) -> None:
    seen = [(j, p, i) for j, p, i, *_ in runs if j in jobs]
    assert len(seen) == len(set(seen)), "a phase ran twice"
    for job_id, iterations in jobs.items():
        assert sorted((i, p is Pool.TRAIN) for j, p, i in seen if j == job_id) == \
            [(i, t) for i in range(iterations) for t in (False, True)], f"{job_id} skipped a phase"
    by_node: dict[str, list] = {}
    for job_id, _, _, nodes, start, end in runs:
        for node in nodes:
            by_node.setdefault(node, []).append((start, end, job_id))
    for node, spans in by_node.items():
        spans.sort()
        for (s1, e1, j1), (s2, e2, j2) in zip(spans, spans[1:]):
            assert e1 <= s2, f"{j1} and {j2} ran on {node} at the same time"


async def test_permits_never_overlap_on_a_node_across_two_jobs_in_one_group(stack, etcd_client):
    start_scheduler(stack, "sched-a")
    runs: list = []
    async with PlacementJob(JobSpec("job-a", **SPEC), stack.etcd.endpoint) as a, \
            PlacementJob(JobSpec("job-b", **SPEC), stack.etcd.endpoint) as b:
        assert a.placement.group_id == b.placement.group_id, "the second job should co-execute"
        assert b.placement.strategy == "direct_packing"
        assert a.placement.rollout_node_ids == b.placement.rollout_node_ids
        await asyncio.gather(drive(a, 4, runs, 0.05), drive(b, 4, runs, 0.05))
        state = await a.client.state()
    assert_no_overlap_and_no_repeat(runs, {"job-a": 4, "job-b": 4})
    assert {j.iterations_done for j in state.jobs} == {4}
    assert state.slo_attainment == 1.0


async def test_tail_migration_starts_the_next_rollout_on_the_freed_node(stack, etcd_client):
    start_scheduler(stack, "sched-a")
    spec = dict(SPEC, rollout_nodes=2)
    async with PlacementJob(JobSpec("job-a", **spec), stack.etcd.endpoint) as a, \
            PlacementJob(JobSpec("job-b", **spec), stack.etcd.endpoint) as b:
        assert a.placement.group_id == b.placement.group_id
        async with a.permit(Pool.ROLLOUT) as run_a:
            nodes = sorted(run_a.node_ids)
            assert await run_a.report_progress(10, 5, {nodes[0]: 3, nodes[1]: 2}) is None
            b_acquire = asyncio.create_task(b.client.acquire("job-b", Pool.ROLLOUT, 0, 5))
            await asyncio.sleep(0.3)
            assert not b_acquire.done(), "job-b started while job-a held both rollout nodes"
            migration = await run_a.report_progress(10, 9, {nodes[0]: 1, nodes[1]: 0})
            assert migration is not None
            assert list(migration.keep_node_ids) == [nodes[0]]
            assert list(migration.freed_node_ids) == [nodes[1]]
            permit_b = await asyncio.wait_for(b_acquire, 10)  # starts before job-a's tail ends
            assert list(permit_b.node_ids) == [nodes[1]]
            assert list(permit_b.pending_node_ids) == [nodes[0]]
            state = await a.client.state()
            holders = {q.node_id: q.holder for q in state.queues}
            assert holders[nodes[0]] == "job-a" and holders[nodes[1]] == "job-b"
        state = await a.client.state()  # job-a released: its tail node went to job-b
        assert {q.node_id: q.holder for q in state.queues if q.pool == "rollout"} == \
            {nodes[0]: "job-b", nodes[1]: "job-b"}
        assert state.tail_migrations == 1 and state.bubble_node_seconds_reclaimed > 0
        await b.client.release("job-b", Pool.ROLLOUT, 0)
        b.next_phase = (Pool.TRAIN, 0)


async def test_sigkill_with_permits_held_standby_takes_over_and_no_phase_runs_twice(
        stack, etcd_client):
    first = start_scheduler(stack, "sched-a")
    start_scheduler(stack, "sched-b", leader=False)
    await wait_standby(etcd_client, "sched-b")
    runs: list = []
    async with PlacementJob(JobSpec("job-a", **SPEC), stack.etcd.endpoint) as a, \
            PlacementJob(JobSpec("job-b", **SPEC), stack.etcd.endpoint) as b:
        placed = {j: (p.group_id, list(p.rollout_node_ids), list(p.train_node_ids))
                  for j, p in (("job-a", a.placement), ("job-b", b.placement))}
        started: list[PhaseRun] = []

        def kill_in_the_fourth_phase(run: PhaseRun) -> None:
            # Inside a phase, so a permit is certainly held when the leader dies.
            started.append(run)
            if len(started) == 4:
                first.process.kill()

        await asyncio.wait_for(asyncio.gather(  # the clients follow the standby
            drive(a, 5, runs, 0.15, kill_in_the_fourth_phase),
            drive(b, 5, runs, 0.15, kill_in_the_fourth_phase)), 120)
        assert not first.process.alive() and len(started) == 20
        for job_id, (group, rollout, train) in placed.items():
            p = await a.client.placement(job_id)
            assert (p.group_id, list(p.rollout_node_ids), list(p.train_node_ids)) == \
                (group, rollout, train), f"{job_id} lost its place"
        with pytest.raises(grpc.aio.AioRpcError) as err:  # a finished phase is never re-granted
            await a.client.acquire("job-a", Pool.ROLLOUT, 2, wait_s=1)
        assert err.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        assert "already ran" in err.value.details()
    assert_no_overlap_and_no_repeat(runs, {"job-a": 5, "job-b": 5})


async def test_restarted_scheduler_keeps_places_and_the_held_permit(stack, etcd_client):
    sched = start_scheduler(stack, "sched-a")
    async with PlacementJob(JobSpec("job-a", **SPEC), stack.etcd.endpoint) as a, \
            PlacementJob(JobSpec("job-b", **SPEC), stack.etcd.endpoint) as b:
        held = await a.client.acquire("job-a", Pool.ROLLOUT, 0)
        sched.process.kill()
        # (in a thread: the job clients' lease keepalives run on this event loop)
        await asyncio.to_thread(start_scheduler, stack, "sched-a2")
        again = await a.client.acquire("job-a", Pool.ROLLOUT, 0)  # the same permit, not a new one
        assert (list(again.node_ids), again.granted_at_unix) == \
            (list(held.node_ids), held.granted_at_unix)
        reply = await b.client._call("AcquirePermit", pb.AcquirePermitRequest(
            job_id="job-b", phase=pb.PHASE_ROLLOUT, iteration=0, wait_s=0.5))
        assert not reply.granted and "held by job-a" in reply.waiting_for
        assert (await a.client.release("job-a", Pool.ROLLOUT, 0)).released
        assert (await a.client.release("job-a", Pool.ROLLOUT, 0)).already_released
        granted = await b.client.acquire("job-b", Pool.ROLLOUT, 0)
        assert list(granted.node_ids) == list(held.node_ids)
        await b.client.release("job-b", Pool.ROLLOUT, 0)
        a.next_phase = b.next_phase = (Pool.TRAIN, 0)


async def test_a_permit_waited_for_is_granted_when_released_without_spinning_meanwhile(
        stack, etcd_client):
    """AcquirePermit long-polls: a job waiting for its turn costs the scheduler nothing until
    something changes (its not-granted ask changes nothing, so it wakes nobody, not even
    itself), and is granted at once when the holder releases."""
    sched = start_scheduler(stack, "sched-a")
    cpu = psutil.Process(sched.process.process.pid)
    async with PlacementJob(JobSpec("job-a", **SPEC), stack.etcd.endpoint) as a, \
            PlacementJob(JobSpec("job-b", **SPEC), stack.etcd.endpoint) as b:
        await a.client.acquire("job-a", Pool.ROLLOUT, 0)
        before = sum(cpu.cpu_times()[:2])
        reply = await b.client._call("AcquirePermit", pb.AcquirePermitRequest(
            job_id="job-b", phase=pb.PHASE_ROLLOUT, iteration=0, wait_s=2.0))
        spent = sum(cpu.cpu_times()[:2]) - before
        assert not reply.granted
        # A poll that woke itself asked again at once until its deadline: ~a core for 2 s.
        assert spent < 0.5, f"the scheduler used {spent:.2f} CPU-s while job-b waited 2 s"
        waiting = asyncio.create_task(b.client._call("AcquirePermit", pb.AcquirePermitRequest(
            job_id="job-b", phase=pb.PHASE_ROLLOUT, iteration=0, wait_s=20.0)))
        await asyncio.sleep(0.3)
        released = time.monotonic()
        assert (await a.client.release("job-a", Pool.ROLLOUT, 0)).released
        assert (await waiting).granted and time.monotonic() - released < 2.0
        await b.client.release("job-b", Pool.ROLLOUT, 0)
        a.next_phase = b.next_phase = (Pool.TRAIN, 0)


CRASHING_CLIENT = """
import asyncio, sys
from rlharvest.services.placement_scheduler.client import JobSpec, PlacementJob
from rlharvest.services.placement_scheduler.model import Pool

async def main():
    spec = JobSpec(sys.argv[2], t_roll_s=10.0, t_train_s=10.0, slo=2.0)
    async with PlacementJob(spec, sys.argv[1], lease_ttl=2) as job:
        async with job.permit(Pool.ROLLOUT) as run:
            print("RUNNING", *run.node_ids, flush=True)
            await asyncio.sleep(3600)

asyncio.run(main())
"""


async def test_failed_job_leaves_its_group_and_resubmitted_is_a_new_arrival(stack, etcd_client):
    start_scheduler(stack, "sched-a")
    crashing = subprocess.Popen([sys.executable, "-c", CRASHING_CLIENT, stack.etcd.endpoint,
                                 "job-a"], stdout=subprocess.PIPE, text=True)
    try:
        line = await asyncio.wait_for(asyncio.to_thread(crashing.stdout.readline), 60)
        assert line.startswith("RUNNING"), line
        async with PlacementJob(JobSpec("job-b", **SPEC), stack.etcd.endpoint) as b:
            assert (await b.client.state()).jobs[0].job_id == "job-a"
            crashing.send_signal(signal.SIGKILL)  # job-a's client dies holding its permit
            runs: list = []
            await asyncio.wait_for(drive(b, 2, runs, 0.02), 60)  # b goes on without job-a
            state = await b.client.state()
            assert [j.job_id for j in state.jobs] == ["job-b"]
            async with PlacementJob(JobSpec("job-a", **SPEC), stack.etcd.endpoint) as again:
                state = await b.client.state()
                assert [g.job_ids for g in state.groups] == [["job-b", "job-a"]]  # at the end
                assert again.next_phase == (Pool.ROLLOUT, 0)
                # Round robin resumes with both members taking turns.
                await asyncio.wait_for(asyncio.gather(drive(b, 1, runs, 0.02),
                                                      drive(again, 1, runs, 0.02)), 60)
            assert_no_overlap_and_no_repeat(runs, {"job-b": 3})
    finally:
        crashing.kill()
        crashing.wait()


async def test_bad_input_gets_precise_statuses_and_the_scheduler_keeps_serving(
        stack, etcd_client):
    sched = start_scheduler(stack, "sched-a")
    client = SchedulerClient(endpoint=sched.endpoint, failover_timeout_s=5)

    async def refused(call, code: grpc.StatusCode, *words: str) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call
        assert err.value.code() is code, err.value.details()
        for word in words:
            assert word in err.value.details(), err.value.details()

    await refused(client.submit(JobSpec("neg", t_roll_s=-1, t_train_s=5)),
                  grpc.StatusCode.INVALID_ARGUMENT, "t_roll", ">= 0")
    await refused(client.submit(JobSpec("slo", t_roll_s=1, t_train_s=5, slo=0.5)),
                  grpc.StatusCode.INVALID_ARGUMENT, "slo must be >= 1")
    await refused(client.submit(JobSpec("a/b", t_roll_s=1, t_train_s=5)),
                  grpc.StatusCode.INVALID_ARGUMENT, "job_id")
    # An explicit 0 is refused, never taken for "unset" and replaced by a default.
    await refused(client.submit(JobSpec("slo0", t_roll_s=1, t_train_s=5, slo=0)),
                  grpc.StatusCode.INVALID_ARGUMENT, "slo must be >= 1", "got 0.0")
    await refused(client.submit(JobSpec("n0", t_roll_s=1, t_train_s=5, rollout_nodes=0)),
                  grpc.StatusCode.INVALID_ARGUMENT, "rollout_nodes must be an integer >= 1")
    await refused(client.submit(JobSpec("n-1", t_roll_s=1, t_train_s=5, train_nodes=-1)),
                  grpc.StatusCode.INVALID_ARGUMENT, "train_nodes must be an integer >= 1")
    await refused(client.submit(JobSpec("none", slo=1.5)),
                  grpc.StatusCode.INVALID_ARGUMENT, "gives no t_roll or t_train")
    await refused(client.submit(JobSpec("both", t_roll_s=1, profile=PROFILE)),
                  grpc.StatusCode.INVALID_ARGUMENT, "not both")
    await refused(client.submit(JobSpec("huge", t_roll_s=1, t_train_s=5, rollout_nodes=3)),
                  grpc.StatusCode.FAILED_PRECONDITION, "needs 3 rollout nodes", "has only 2")
    await refused(client.submit(JobSpec("dead", t_roll_s=1, t_train_s=5), lease_id=0x7777),
                  grpc.StatusCode.FAILED_PRECONDITION, "lease")
    await refused(client.acquire("ghost", Pool.ROLLOUT, 0), grpc.StatusCode.NOT_FOUND, "ghost")
    await client.submit(JobSpec("ok", **SPEC))
    await refused(client.submit(JobSpec("ok", **SPEC)), grpc.StatusCode.ALREADY_EXISTS)
    await refused(client._call("AcquirePermit", pb.AcquirePermitRequest(job_id="ok")),
                  grpc.StatusCode.INVALID_ARGUMENT, "phase")
    await refused(client.acquire("ok", Pool.TRAIN, 0), grpc.StatusCode.FAILED_PRECONDITION,
                  "must first run rollout #0")
    await refused(client.release("ok", Pool.ROLLOUT, 0), grpc.StatusCode.FAILED_PRECONDITION,
                  "acquire a permit")
    permit = await client.acquire("ok", Pool.ROLLOUT, 0)
    await refused(client.report_progress("ok", 0, 4, 1, {"nowhere": 3}),
                  grpc.StatusCode.INVALID_ARGUMENT, "unknown nodes ['nowhere']")
    await refused(client.report_progress("ok", 0, 4, 1, {permit.node_ids[0]: 2}),
                  grpc.StatusCode.INVALID_ARGUMENT, "report every node")
    # Still serving, and nothing above changed the state.
    await client.release("ok", Pool.ROLLOUT, 0)
    state = await client.state()
    assert [j.job_id for j in state.jobs] == ["ok"] and state.jobs[0].next_phase == pb.PHASE_TRAIN
    await client.close()
    assert sched.process.alive()


async def test_a_job_submits_its_profile_and_the_scheduler_plans_its_worst_case(
        stack, etcd_client):
    sched = start_scheduler(stack, "sched-a")
    client = SchedulerClient(endpoint=sched.endpoint, failover_timeout_s=5)
    placed = await client.submit(JobSpec("profiled", profile=PROFILE, slo=1.5))
    assert (placed.t_roll_s, placed.t_train_s) == pytest.approx(
        (PROFILE.worst_case_rollout_s(), PROFILE.worst_case_train_s()))
    assert placed.t_roll_s == pytest.approx(1.0 + 1024 * 0.01)  # every response at the limit
    assert placed.predicted_iteration_s == pytest.approx(placed.t_roll_s + placed.t_train_s)
    state = await client.state()
    assert state.groups[0].t_cycle_s == pytest.approx(placed.predicted_iteration_s)
    await client.close()


async def test_a_job_whose_phase_drifts_past_its_group_is_evicted_and_the_group_goes_on(
        stack, etcd_client):
    start_scheduler(stack, "sched-a")
    spec = dict(t_roll_s=0.5, t_train_s=0.5, slo=2.0)  # each may iterate in at most 2 s
    async with PlacementJob(JobSpec("job-a", **spec), stack.etcd.endpoint) as a, \
            PlacementJob(JobSpec("job-b", **spec), stack.etcd.endpoint) as b:
        assert b.placement.group_id == a.placement.group_id
        async with a.permit(Pool.ROLLOUT):
            await asyncio.sleep(0.05)
        async with b.permit(Pool.ROLLOUT):
            await asyncio.sleep(3.0)  # 6x its estimate: job-a would now iterate in >= 3.5 s
        assert "re-profile and resubmit" in b.left_reason
        with pytest.raises(JobLeftError, match="job-b"):
            async with b.permit(Pool.TRAIN):
                pass
        state = await a.client.state()
        assert [j.job_id for j in state.jobs] == ["job-a"]
        assert [list(g.job_ids) for g in state.groups] == [["job-a"]]
        for phase in (Pool.TRAIN, Pool.ROLLOUT):  # job-a goes on, alone in its group
            async with a.permit(phase):
                await asyncio.sleep(0.05)
        assert a.next_phase == (Pool.TRAIN, 1) and not a.left_reason


def test_bad_inventory_stops_the_scheduler_with_a_message(stack):
    proc = stack.start("placement_scheduler", "bad", ["--rollout-gpu", "A100",
                                                      "--train-node-names", "x,x"])
    assert proc.process.wait(timeout=60) == 2
    log = proc.log_path.read_text()
    assert "rollout_gpu 'A100' is not a known node type" in log
    assert "appear more than once" in log


async def test_a_job_leaving_while_no_scheduler_leads_exits_in_seconds_not_a_failover_wait(
        stack, etcd_client):
    """The whole stack stopping at once (`rlharvest up`, Ctrl-C): the scheduler is gone when a
    trainer's job leaves. Its cancel waits briefly for a leader, then the revoked lease takes
    the job out: the trainer does not wait out the one-minute failover timeout."""
    scheduler = start_scheduler(stack, "sched-gone")
    job = PlacementJob(JobSpec("job-a", **SPEC), stack.etcd.endpoint)
    await job.__aenter__()
    scheduler.process.process.send_signal(signal.SIGKILL)
    scheduler.process.process.wait()
    started = time.monotonic()
    await job.__aexit__(None, None, None)
    assert time.monotonic() - started < 20, "the leaving job waited for a failover"


async def test_jobs_submitted_within_the_admission_window_are_placed_largest_first(stack):
    """--admission-window-s: three jobs submitted at once are admitted together in the order
    batch_order finds cheapest. In arrival order Algorithm 1 opens a second group for them
    (114.08 $/h); admitted together they share one (71.84 $/h). Each call gets its own
    placement; a bad one among them gets its own precise refusal. With --admission-window-jobs 4
    the window closes as soon as the fourth submission arrives, not after its 30 s."""
    scheduler = start_scheduler(stack, "sched-window", "--admission-window-s", "30",
                                "--admission-window-jobs", "4")
    client = SchedulerClient(endpoint=scheduler.endpoint)
    jobs = [JobSpec("job-0", t_roll_s=10, t_train_s=100, slo=2.0),
            JobSpec("job-1", t_roll_s=100, t_train_s=20, slo=2.0),
            JobSpec("job-2", t_roll_s=60, t_train_s=10, slo=3.0)]
    try:
        started = time.monotonic()
        placed = await asyncio.gather(*(client.submit(j) for j in jobs),
                                      client.submit(JobSpec("job-3", t_roll_s=10, t_train_s=10,
                                                            slo=0.5)),
                                      return_exceptions=True)
        assert time.monotonic() - started < 15, "the full window closed it, not the 4th job"
        assert [p.job_id for p in placed[:3]] == ["job-0", "job-1", "job-2"], placed
        assert isinstance(placed[3], grpc.aio.AioRpcError)
        assert placed[3].code() is grpc.StatusCode.INVALID_ARGUMENT
        assert len({p.group_id for p in placed[:3]}) == 1
        state = await client.state()
        assert state.cost_per_hour == pytest.approx(71.84)
        for j in jobs:  # the keyspace outlives this test: leave no job for the next scheduler
            await client.cancel(j.job_id)
    finally:
        await client.close()


async def test_consolidate_moves_a_job_of_a_thinned_group_between_its_phases(stack):
    """--consolidate: A|C fill one group and B|D another. C and D leave; B is then repacked
    into A's group between two of its phases, its next phases run on A's nodes, and no phase
    of A or B runs twice or beside another on a node."""
    start_scheduler(stack, "sched-consol", "--train-nodes", "2", "--consolidate")
    runs: list = []
    jobs = {name: PlacementJob(JobSpec(f"job-{name}", **SPEC), stack.etcd.endpoint)
            for name in "acbd"}  # submitted in this order
    for job in jobs.values():
        await job.__aenter__()
    try:
        groups = {name: job.placement.group_id for name, job in jobs.items()}
        assert groups["a"] == groups["c"] != groups["b"] == groups["d"], groups
        await asyncio.gather(*(drive(job, 1, runs, 0.05) for job in jobs.values()))
        for name in "cd":
            await jobs[name].__aexit__(None, None, None)
        await asyncio.gather(drive(jobs["a"], 3, runs, 0.05), drive(jobs["b"], 3, runs, 0.05))
        state = await jobs["a"].client.state()
    finally:
        for name in "ab":
            await jobs[name].__aexit__(None, None, None)
    assert state.consolidation_moves == 1, state
    assert_no_overlap_and_no_repeat([r for r in runs if r[0] in ("job-a", "job-b")],
                                    {"job-a": 4, "job-b": 4})
    a_nodes = {n for j, _, i, nodes, _, _ in runs if j == "job-a" for n in nodes}
    b_first = {n for j, _, i, nodes, _, _ in runs if j == "job-b" and i == 0 for n in nodes}
    b_late = {n for j, _, i, nodes, _, _ in runs if j == "job-b" and i >= 2 for n in nodes}
    assert not b_first & a_nodes and b_late <= a_nodes, (b_first, b_late, a_nodes)
