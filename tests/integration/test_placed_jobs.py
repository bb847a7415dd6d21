"""Two RL jobs under the placement scheduler, all real processes (WEAVE §5.1): each trainer
submits its job and runs every rollout and training phase under the scheduler's permits; one
rollout worker placed on the one rollout node serves whichever job's turn the node is, keeping
the other job's weights resident; a SIGKILLed trainer's job leaves the group and the other job
goes on to finish, through a SIGKILL of the scheduler's leader (its standby takes over) with no
phase run twice."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import time

import pytest

from rlharvest.common import keys
from rlharvest.common.local_etcd import free_port

from .test_trainer import metric, scrape, trainer_status, wait_trainer
from .worker_client import WorkerHandle, wait_serving

pytestmark = pytest.mark.integration
COMMON = ["--lease-ttl", "2", "--json-logs"]
# Worst-case phase estimates far above these phases' real times: no drift eviction.
PLACED = ["--placement-scheduler", "--placement-t-roll-s", "30", "--placement-t-train-s", "30",
          "--placement-slo", "3"]
STEPS = 8  # job A's
PERMIT = re.compile(r"placement: (rollout|train) #(\d+) of job (\S+) (granted|ends)")


def start_trainer(stack, job: str, steps: int, *flags: str) -> WorkerHandle:
    port, metrics_port = free_port(), free_port()
    return WorkerHandle(stack.start("trainer", f"trainer-{job}", [
        "--trainer-id", f"trainer-{job}", "--job", job, "--port", str(port),
        "--metrics-port", str(metrics_port), "--torch-threads", "1", "--no-publish",
        "--steps", str(steps), "--prompts-per-step", "2", "--samples-per-prompt", "2",
        "--micro-batch-groups", "1", *PLACED, *COMMON, *flags]), f"127.0.0.1:{port}",
        metrics_port)


def json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]  # not DeepSpeed's


def phases(trainer_logs: list[str], scheduler_log: str) -> list[tuple[str, str, int, float, float]]:
    """(job, phase, iteration, granted ts, released ts) from the trainers' JSON logs; a phase
    still held when its trainer died ends when the scheduler took the job out of its group."""
    left = {found.group(1): record["ts"] for record in json_lines(scheduler_log)
            if (found := re.match(r"job (\S+)(:| failed \() ?client lease expired",
                                  record["msg"]))}
    opened: dict[tuple[str, str, int], float] = {}
    closed = []
    for record in (r for text in trainer_logs for r in json_lines(text)):
        if (found := PERMIT.search(record.get("msg", ""))) is None:
            continue
        phase, iteration, job, what = found.groups()
        key = (job, phase, int(iteration))
        if what == "granted":
            assert key not in opened and key not in {c[:3] for c in closed}, f"{key} ran twice"
            opened[key] = record["ts"]
        else:
            closed.append((*key, opened.pop(key), record["ts"]))
    return closed + [(*key, start, left[key[0]]) for key, start in opened.items()]


async def test_two_jobs_share_a_worker_by_permits_and_a_sigkilled_trainers_job_leaves(
        stack, etcd_client):
    schedulers = [stack.start("placement_scheduler", name, [
        "--scheduler-id", name, "--rollout-nodes", "1", "--train-nodes", "1", *COMMON])
        for name in ("leader", "standby")]
    managers = {}
    for job in ("job-a", "job-b"):
        port = free_port()
        managers[job] = stack.start("rollout_manager", f"manager-{job}", [
            "--manager-id", f"manager-{job}", "--job", job, "--port", str(port), *COMMON])
    worker_metrics = free_port()
    worker = stack.start("rollout_worker", "w0", [
        "--worker-id", "w0", "--placement-node", "rollout-1", "--torch-threads", "1",
        "--max-running", "8", "--step-delay-s", "0.05", "--metrics-port", str(worker_metrics),
        *COMMON])
    # Both jobs join one group (one rollout node, one training node) and take turns on each.
    # A starts once B has stepped: started together, a B slow to join let A run all its steps
    # alone before the kills (seen once in CI).
    b = start_trainer(stack, "job-b", 1000)
    await asyncio.to_thread(wait_serving, b, 120)
    await wait_trainer(b, lambda s: s.steps_done >= 1)
    a = start_trainer(stack, "job-a", STEPS, "--no-exit-when-done")
    await asyncio.to_thread(wait_serving, a, 120)
    await wait_trainer(a, lambda s: s.steps_done >= 1)
    # B's trainer and the scheduler's leader die together: A waits for the standby, which
    # takes B out of the group once B's lease expires (at its restore or after).
    leader = next(s for s in schedulers if "leads on" in s.log_path.read_text())
    b.process.process.send_signal(signal.SIGKILL)
    leader.process.send_signal(signal.SIGKILL)
    assert (await trainer_status(a.endpoint)).steps_done < STEPS, "A finished before the kills"
    assert (await wait_trainer(a, lambda s: s.state == "done")).steps_done == STEPS
    assert "leads on" in next(s for s in schedulers if s is not leader).log_path.read_text()
    deadline = time.monotonic() + 30
    while await etcd_client.get(keys.placement_state_key("jobs/job-b").encode()) is not None:
        assert time.monotonic() < deadline, "job-b never left the group"
        await asyncio.sleep(0.1)

    runs = phases([a.process.log_path.read_text(), b.process.log_path.read_text()],
                  "".join(s.log_path.read_text() for s in schedulers))
    ran = {(job, phase, i) for job, phase, i, _, _ in runs}
    assert {("job-a", p, i) for p in ("rollout", "train") for i in range(STEPS)} <= ran, runs
    assert ("job-b", "train", 0) in ran, runs
    first_a = min(start for job, _, _, start, _ in runs if job == "job-a")
    assert any(job == "job-b" and start > first_a for job, _, _, start, _ in runs), \
        f"B never ran a phase after A joined: {runs}"
    for phase in ("rollout", "train"):  # one node per pool: never two jobs on it at once
        held = sorted((start, end, job) for job, p, _, start, end in runs if p == phase)
        for (_, end, job), (start, _, other) in zip(held, held[1:]):
            assert end <= start or job == other, f"{phase} overlaps: {held}"

    # The worker followed the node's turn: it switched between the jobs, and back to a job it
    # had served was a warm load of that job's resident weights.
    text = scrape(worker_metrics)
    assert metric(text, 'rlh_worker_job_switches_total{load="cold"}') == 2, text
    assert metric(text, 'rlh_worker_job_switches_total{load="warm"}') >= 1
    # Each switch closed the old job's sessions, so the worker kept their requests; the trainers'
    # request ids collide across the jobs, yet the new job's manager adopted none.
    assert metric(text, 'rlh_worker_kept_request_outcomes_total{outcome="adopted"}') == 0, text
    assert worker.alive() and all(m.alive() for m in managers.values())
    # A's job left the group when it finished; no group holds the node now.
    assert await etcd_client.get(keys.placement_state_key("jobs/job-a").encode()) is None
    assert await etcd_client.get(keys.placement_node_key("rollout-1").encode()) is None


async def test_a_tail_bound_rollout_reports_its_progress_and_its_tail_migrates(stack):
    """A placed trainer reports its rollout's progress; once 80% of a step's
    responses are done the scheduler shrinks the one-node rollout onto the GPU slot of its tail
    (two slots, a placed worker each) and passes the other slot's turn on (to job B, or to A's
    next rollout). Every step still completes: only open requests move, with their tokens, to
    the kept slot's worker."""
    metrics_port = free_port()
    stack.start("placement_scheduler", "scheduler", [
        "--scheduler-id", "scheduler", "--rollout-nodes", "1", "--rollout-slots", "2",
        "--train-nodes", "1",
        "--metrics-port", str(metrics_port), *COMMON])
    for job in ("job-a", "job-b"):
        stack.start("rollout_manager", f"manager-{job}", [
            "--manager-id", f"manager-{job}", "--job", job, "--port", str(free_port()), *COMMON])
    for w in range(2):
        stack.start("rollout_worker", f"w{w}", [
            "--worker-id", f"w{w}", "--placement-node", f"rollout-1.gpu{w}", "--torch-threads",
            "1", "--max-running", "8", "--step-delay-s", "0.05", *COMMON])
    # Eight responses a step, lengths log-normal around 6 tokens and up to 48: a long tail.
    a = start_trainer(stack, "job-a", 3, "--samples-per-prompt", "4", "--bench-length-median", "6",
                      "--max-new-tokens", "48", "--placement-progress-s", "0.1",
                      "--no-exit-when-done")
    b = start_trainer(stack, "job-b", 3, "--no-exit-when-done")
    for trainer in (a, b):
        await asyncio.to_thread(wait_serving, trainer, 120)
    for trainer in (a, b):
        assert (await wait_trainer(trainer, lambda s: s.state == "done")).steps_done == 3
    migrated = metric(scrape(a.metrics_port), "rlh_trainer_tail_migrations_total")
    assert migrated >= 1, a.process.log_tail()
    assert metric(scrape(metrics_port), "rlh_placement_tail_migrations") == migrated
    assert "is tail-bound at" in a.process.log_path.read_text()


async def test_multi_turn_trajectories_play_under_the_rollout_permit_and_train_under_the_next(
        stack):
    """An --env job placed by the scheduler plays every turn of its
    step's trajectories while it holds the rollout permit, and trains them only once that
    permit ended and the training permit is held (one phase at a time); a job beside it on
    the same rollout node takes the node's turns in between."""
    stack.start("placement_scheduler", "scheduler", [
        "--scheduler-id", "scheduler", "--rollout-nodes", "1", "--train-nodes", "1", *COMMON])
    for job in ("agent", "text"):
        stack.start("rollout_manager", f"manager-{job}", [
            "--manager-id", f"manager-{job}", "--job", job, "--port", str(free_port()), *COMMON])
    stack.start("rollout_worker", "w0", [
        "--worker-id", "w0", "--placement-node", "rollout-1", "--torch-threads", "1",
        "--max-running", "8", "--kv-pages", "512", "--prefix-cache", *COMMON])
    agent = start_trainer(stack, "agent", 2, "--env", "frozen_lake", "--max-new-tokens", "2",
                          "--env-max-turns", "3", "--no-exit-when-done")
    text = start_trainer(stack, "text", 2, "--no-exit-when-done")
    for trainer in (agent, text):
        await asyncio.to_thread(wait_serving, trainer, 120)
    for trainer in (agent, text):
        assert (await wait_trainer(trainer, lambda s: s.state == "done")).steps_done == 2
    played = scrape(agent.metrics_port)
    assert metric(played, 'rlh_trainer_trajectories_total{outcome="played"}') == 2 * 2 * 2
    assert metric(played, 'rlh_trainer_trajectories_total{outcome="failed"}') == 0
    runs = phases([agent.process.log_path.read_text(), text.process.log_path.read_text()], "")
    ran = {(job, phase, i) for job, phase, i, _, _ in runs}
    assert {(job, p, i) for job in ("agent", "text") for p in ("rollout", "train")
            for i in range(2)} <= ran, runs
    by_key = {(job, phase, i): (start, end) for job, phase, i, start, end in runs}
    for i in range(2):  # the agent's training phase began after its rollout phase ended
        assert by_key[("agent", "rollout", i)][1] <= by_key[("agent", "train", i)][0], runs
    for phase in ("rollout", "train"):
        held = sorted((start, end, job) for job, p, _, start, end in runs if p == phase)
        for (_, end, job), (start, _, other) in zip(held, held[1:]):
            assert end <= start or job == other, f"{phase} overlaps: {held}"
