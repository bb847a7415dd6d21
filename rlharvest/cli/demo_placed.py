"""``rlharvest demo --placement-jobs N``: N GRPO jobs share one rollout worker and one training
node under the placement scheduler (WEAVE), all real processes on the local stack.

The scheduler puts the jobs in one co-execution group; the worker, placed on the group's rollout
node, serves whichever job's turn the node is and keeps the others' weights resident in host
memory. The table shows each step of each job as it lands, and at the end what sharing did:
the worker's job switches (warm from host memory or cold), the scheduler's reclaimed bubble and
long-tail migrations, and the node-seconds per step against the same jobs run solo (a worker and
a training node each: twice the nodes, measured in ``bench/placement_e2e.py``).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from rlharvest.common import observability, rpc
from rlharvest.common.local_etcd import free_port
from rlharvest.common.pb import trainer_pb2 as tpb, trainer_pb2_grpc
from rlharvest.cli.launcher import LocalStack

COMMON = ["--json-logs"]  # the default 5 s leases: a demo on a busy laptop keeps its leader
console = Console()


async def trainer_status(stub: trainer_pb2_grpc.TrainerStub,
                         timeout: float = 2.0) -> tpb.TrainerStatus | None:
    """The trainer's status, or None while it is not answering yet (the demos poll again)."""
    try:
        return await stub.GetStatus(tpb.TrainerStatusRequest(), timeout=timeout)
    except Exception:  # noqa: BLE001 - still starting: the caller polls again
        return None


def jobs_table(statuses: dict[str, tpb.TrainerStatus]) -> Table:
    """One row per step index: each job's reward and step seconds side by side."""
    table = Table(title="one GRPO step per row and job, the jobs taking turns on one worker "
                        "and one training node")
    table.add_column("step", justify="right")
    for job in statuses:
        table.add_column(f"{job} reward", justify="right")
        table.add_column(f"{job} step s", justify="right")
    for i in range(max((len(s.steps) for s in statuses.values()), default=0)):
        row = [str(i + 1)]
        for status in statuses.values():
            step = status.steps[i] if i < len(status.steps) else None
            row += ["" if step is None else f"{step.mean_reward:.3f}",
                    "" if step is None else f"{step.step_time_s:.2f}"]
        table.add_row(*row)
    return table


def start(stack: LocalStack, jobs: list[str], steps: int, step_delay_s: float
          ) -> tuple[dict[str, str], int, int]:
    """The scheduler, one placed worker, a manager and a trainer per job. Returns the
    trainers' endpoints and the worker's and scheduler's metrics ports."""
    worker_metrics, scheduler_metrics = free_port(), free_port()
    # One admission window for all the jobs: on a busy box one trainer can be up long before the
    # other, and admitted alone it would run all its steps before the other took a turn.
    stack.start("placement_scheduler", "placement-scheduler", [
        "--scheduler-id", "scheduler-0", "--rollout-nodes", "1", "--train-nodes", "1",
        "--admission-window-s", "60", "--admission-window-jobs", str(len(jobs)),
        "--metrics-port", str(scheduler_metrics), *COMMON])
    stack.start("rollout_worker", "worker-1", [
        "--worker-id", "worker-1", "--placement-node", "rollout-1", "--torch-threads", "1",
        "--max-running", "16", "--step-delay-s", str(step_delay_s),
        "--metrics-port", str(worker_metrics), *COMMON])
    endpoints = {}
    for seed, job in enumerate(jobs):
        stack.start("rollout_manager", f"manager-{job}", [
            "--manager-id", f"manager-{job}", "--job", job, "--port", str(free_port()),
            *COMMON])
        port = free_port()
        stack.start("trainer", f"trainer-{job}", [
            "--trainer-id", f"trainer-{job}", "--job", job, "--port", str(port),
            "--backend", "torch", "--torch-threads", "1", "--no-publish", "--steps", str(steps),
            "--prompts-per-step", "4", "--samples-per-prompt", "4", "--no-exit-when-done",
            "--data-seed", str(seed),
            "--placement-scheduler", "--placement-t-roll-s", "30", "--placement-t-train-s", "30",
            "--placement-slo", str(len(jobs) + 1), *COMMON])
        endpoints[job] = f"127.0.0.1:{port}"
    return endpoints, worker_metrics, scheduler_metrics


async def watch(endpoints: dict[str, str], steps: int, timeout: float
                ) -> dict[str, tpb.TrainerStatus]:
    """Until every job trained ``steps`` steps, printing each step as it lands."""
    deadline, shown = time.monotonic() + timeout, {job: 0 for job in endpoints}
    statuses: dict[str, tpb.TrainerStatus] = {}
    channels = {job: rpc.channel(endpoint) for job, endpoint in endpoints.items()}
    try:
        return await _poll(channels, statuses, shown, steps, deadline, timeout)
    finally:
        for chan in channels.values():
            await chan.close()


async def _poll(channels: dict, statuses: dict[str, tpb.TrainerStatus], shown: dict[str, int],
                steps: int, deadline: float, timeout: float) -> dict[str, tpb.TrainerStatus]:
    stubs = {job: trainer_pb2_grpc.TrainerStub(chan) for job, chan in channels.items()}
    while True:
        for job, stub in stubs.items():
            status = await trainer_status(stub)
            if status is None:
                continue
            statuses[job] = status
            if status.state == "failed":
                raise RuntimeError(f"{job}'s trainer failed: {status.error}")
            for step in status.steps[shown[job]:]:
                console.log(f"{job} step {step.step}: reward {step.mean_reward:.3f} in "
                            f"{step.step_time_s:.2f} s")
            shown[job] = len(status.steps)
        if len(statuses) == len(stubs) and all(s.state == "done"
                                                   for s in statuses.values()):
            return statuses
        if time.monotonic() > deadline:
            raise TimeoutError(f"the jobs trained {shown} of {steps} steps in {timeout:.0f} s")
        await asyncio.sleep(0.5)


def run(jobs: int, steps: int, step_delay_s: float, log_dir: Path, timeout: float) -> None:
    names = [f"job-{chr(ord('a') + i)}" for i in range(jobs)]
    console.print(f"[bold]rlharvest demo[/]: {jobs} GRPO jobs x {steps} steps sharing one "
                  f"rollout worker and one training node under the placement scheduler; logs "
                  f"in {log_dir}")
    stack = LocalStack(log_dir)
    try:
        stack.start_etcd()
        endpoints, worker_metrics, scheduler_metrics = start(stack, names, steps, step_delay_s)
        statuses = asyncio.run(watch(endpoints, steps, timeout))
        worker, scheduler = (observability.scrape(f"127.0.0.1:{port}")
                             for port in (worker_metrics, scheduler_metrics))
    finally:
        stack.stop()
    console.print(jobs_table(statuses))

    def switches(load: str) -> float:
        return observability.sample(worker, f'rlh_worker_job_switches_total{{load="{load}"}}')

    makespan = max(sum(s.step_time_s for s in st.steps) for st in statuses.values())
    done = sum(len(st.steps) for st in statuses.values())
    console.print(
        f"the worker switched jobs {switches('warm'):.0f} times warm (weights resident in host "
        f"memory) and {switches('cold'):.0f} cold; the scheduler reclaimed "
        f"{observability.sample(scheduler, 'rlh_placement_bubble_node_seconds_reclaimed'):.1f} "
        f"node-seconds of long-tail bubbles in "
        f"{observability.sample(scheduler, 'rlh_placement_tail_migrations'):.0f} migrations; "
        f"{2 * makespan / done:.2f} node-seconds per step on the 2 shared nodes "
        "(bench/placement_e2e.py runs the same jobs solo, 2 nodes each, for the comparison)")
