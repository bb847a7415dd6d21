"""End to end on real processes: two RL jobs co-executed under WEAVE vs the same jobs solo.

Both configurations run the same two GRPO jobs (managers, trainers, placed rollout workers, the
placement scheduler, etcd; all processes) for the same steps; only the inventory differs:

- solo: each job on a stack of its own (etcd, manager, one rollout worker, trainer; no
  scheduler, no permits): a rollout worker and a training node per job, each idle while its job
  is in the other phase (the dependency bubble). Not the scheduler at SLO 1.0: two jobs with
  T_roll = T_train pack into one group without any slowdown, so it co-executes them too;
- WEAVE: 1 rollout node + 1 training node, SLO ``--slo`` — the jobs share one group, and the
  scheduler's permits run one job's rollout while the other trains (§4.3).

Rollouts cost ``--step-delay-s`` per engine step (GPU-like: the sleep uses no CPU), training
costs the real optimizer step plus ``--train-delay-s`` (a training node's time), so
T_roll ~= T_train, the case WEAVE is built for. Reported, runs interleaved and repeated (median
[spread]): each job's mean step time, the slowdown against solo (the SLO bounds it), rollout
worker-seconds idle per step (the bubbles), and node-seconds per step (cost per unit of work:
nodes x makespan / steps), whose solo/WEAVE ratio is the saving.

The makespan is the longer job's summed step times (process start-up excluded). Training
"nodes" here are the scheduler's permits: both trainers compute on this machine's CPU in either
configuration, so only the rollout side's bubbles are physically reclaimed.

    python bench/placement_e2e.py [--quick] [--repeats 3] [--steps 10]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from rlharvest.common.local_etcd import free_port
from rlharvest.cli.launcher import LocalStack

from e2e_tail_batching import wait_trainer_done  # noqa: I001 - a sibling script

COMMON = ["--lease-ttl", "2", "--json-logs"]
JOBS = ("job-a", "job-b")


@dataclass
class Outcome:
    step_s: dict[str, float]  # mean step time per job
    makespan_s: float
    steps: int
    nodes: int
    idle_worker_s: float  # rollout worker-seconds idle, all workers, over the makespan

    @property
    def idle_per_step(self) -> float:
        return self.idle_worker_s / self.steps

    @property
    def node_s_per_step(self) -> float:
        return self.nodes * self.makespan_s / self.steps


def scrape_busy(port: int, step_delay_s: float) -> float:
    """Seconds the worker's engine spent on steps (their compute plus the emulated delay)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    values = {sample.name: sample.value for family in text_string_to_metric_families(text)
              for sample in family.samples if not sample.labels}
    return values.get("rlh_worker_step_seconds_sum", 0.0) + \
        values.get("rlh_worker_engine_steps_total", 0.0) * step_delay_s


def start_job(stack: LocalStack, job: str, worker: list[str] | None, trainer: list[str], args,
              metrics_port: int, port: int) -> None:
    """One job's manager, its trainer, and (``worker`` flags not None) a worker for it."""
    stack.start("rollout_manager", f"manager-{job}", [
        "--manager-id", f"manager-{job}", "--job", job, "--port", str(free_port()), *COMMON])
    if worker is not None:
        stack.start("rollout_worker", f"worker-{job}", [
            "--worker-id", f"worker-{job}", *worker, "--torch-threads", "1", "--max-running",
            "32", "--step-delay-s", str(args.step_delay_s), "--metrics-port", str(metrics_port),
            *COMMON])
    stack.start("trainer", f"trainer-{job}", [
        "--trainer-id", f"trainer-{job}", "--job", job, "--port", str(port), "--backend",
        "torch", "--torch-threads", "1", "--no-publish", "--steps", str(args.steps),
        "--prompts-per-step", "4", "--samples-per-prompt", "4", "--max-new-tokens",
        str(args.max_tokens), "--bench-length-median", str(args.max_tokens),
        "--bench-train-delay-s", str(args.train_delay_s), "--no-exit-when-done", *trainer,
        *COMMON])


def run_case(shared: bool, args, log_dir: Path) -> Outcome:
    """WEAVE: one etcd, the scheduler, one placed worker. Solo: each job on a stack of its own
    (its etcd, manager, worker, trainer; no scheduler, no permits)."""
    stacks = [LocalStack(log_dir)] if shared else [LocalStack(log_dir / job) for job in JOBS]
    ports = {job: free_port() for job in JOBS}
    metric_ports = [free_port() for _ in stacks]
    try:
        for stack in stacks:
            stack.start_etcd()
        if shared:
            stacks[0].start("placement_scheduler", "scheduler", [
                "--rollout-nodes", "1", "--train-nodes", "1", *COMMON])
            stacks[0].start("rollout_worker", "w1", [
                "--worker-id", "w1", "--placement-node", "rollout-1", "--torch-threads", "1",
                "--max-running", "32", "--step-delay-s", str(args.step_delay_s),
                "--metrics-port", str(metric_ports[0]), *COMMON])
            placed = ["--placement-scheduler", "--placement-t-roll-s", "30",
                      "--placement-t-train-s", "30", "--placement-slo", str(args.slo)]
            for job in JOBS:
                start_job(stacks[0], job, None, placed, args, 0, ports[job])
        else:
            for stack, job, metrics_port in zip(stacks, JOBS, metric_ports):
                start_job(stack, job, [], [], args, metrics_port, ports[job])

        async def wait_all():
            return await asyncio.gather(*(wait_trainer_done(f"127.0.0.1:{ports[job]}",
                                                            args.timeout) for job in JOBS))

        statuses = asyncio.run(wait_all())
        busy = sum(scrape_busy(port, args.step_delay_s) for port in metric_ports)
    finally:
        for stack in stacks:
            stack.stop()
    makespan = max(sum(s.step_time_s for s in st.steps) for st in statuses)
    steps = sum(len(st.steps) for st in statuses)
    return Outcome(step_s={job: statistics.mean(s.step_time_s for s in st.steps)
                           for job, st in zip(JOBS, statuses)},
                   makespan_s=makespan, steps=steps, nodes=2 * len(metric_ports),
                   idle_worker_s=max(len(metric_ports) * makespan - busy, 0.0))


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="6 steps, one repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10, help="steps per job")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--step-delay-s", type=float, default=0.02)
    parser.add_argument("--train-delay-s", type=float, default=0.3)
    parser.add_argument("--slo", type=float, default=2.5)
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args()
    if args.quick:
        args.steps, args.repeats = 6, 1
    log_root = Path(tempfile.mkdtemp(prefix="rlharvest-placement-e2e-"))
    results: dict[str, list[Outcome]] = {"solo": [], "WEAVE": []}
    for repeat in range(args.repeats):  # interleaved
        for name in results:
            outcome = run_case(name == "WEAVE", args, log_root / f"{name}-{repeat}")
            results[name].append(outcome)
            print(f"repeat {repeat + 1} {name}: makespan {outcome.makespan_s:.1f}s, step s "
                  f"{ {j: round(v, 2) for j, v in outcome.step_s.items()} }, idle worker-s/step "
                  f"{outcome.idle_per_step:.2f}, node-s/step {outcome.node_s_per_step:.2f}",
                  flush=True)
    solo, weave = results["solo"], results["WEAVE"]
    print(f"\n2 jobs x {args.steps} steps, 4 prompts x 4 samples x {args.max_tokens} tokens, "
          f"engine step {args.step_delay_s:g}s, training +{args.train_delay_s:g}s, WEAVE SLO "
          f"{args.slo:g}, {args.repeats} repeats (median [spread])\n")
    print("| configuration | nodes | step s, job-a | step s, job-b | idle rollout worker-s "
          "per step | node-s per step |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, outcomes in results.items():
        print(f"| {name} | {outcomes[0].nodes} | "
              f"{spread([o.step_s['job-a'] for o in outcomes])} | "
              f"{spread([o.step_s['job-b'] for o in outcomes])} | "
              f"{spread([o.idle_per_step for o in outcomes])} | "
              f"{spread([o.node_s_per_step for o in outcomes])} |")
    slowdown = [max(w.step_s[j] / s.step_s[j] for j in JOBS) for s, w in zip(solo, weave)]
    saving = [s.node_s_per_step / w.node_s_per_step for s, w in zip(solo, weave)]
    reclaimed = [s.idle_per_step - w.idle_per_step for s, w in zip(solo, weave)]
    print(f"\nWEAVE vs solo: node-seconds per step saved {spread(saving)}x; rollout "
          f"worker-seconds idle per step {spread(reclaimed)} fewer (the bubble reclaimed); "
          f"the slower job's step time {spread(slowdown)}x of solo (SLO {args.slo:g})")
    print(f"logs in {log_root}")


if __name__ == "__main__":
    main()
