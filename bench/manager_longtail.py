"""Long-tail step makespan with real workers of unequal speed: RLBoost Algorithm 2 vs JSQ without
migration vs round-robin (§4.2.1, §6.4.3).

Six real rollout workers (torch engine, tiny model, --max-running 4); two are slowed by sleeping
`--step-delay-s` after each engine step (emulated slower hardware), two by a third as much.
Response lengths are long-tailed: each request's max_tokens is drawn from a seeded log-normal and
no stop token is set, so every request generates exactly that many tokens. Three real managers,
one per `--balancer`, run the same steps in turn on the same workers; each first runs a warm-up
step (it captures the batching profile P that Algorithm 2's executing-request migration uses).

    python bench/manager_longtail.py [--quick] [--repeats 2]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlharvest.common.local_etcd import free_port  # noqa: E402
from rlharvest.cli.launcher import LocalStack  # noqa: E402
from tests.integration.worker_client import WorkerHandle, start_worker, wait_serving  # noqa: E402

from bench.job_turns import placed_flags, turn  # noqa: E402
from bench.manager_preemption import manager_status, run_step, step_request  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "manager_longtail.md"
BALANCERS = {"algorithm2": "Algorithm 2 (SELECTINSTANCE Θ + CONTINUOUSLB)",
             "jsq": "JSQ, immediate dispatch, no migration",
             "round_robin": "round-robin, no migration"}


def lognormal_lengths(n: int, seed: int, median: int, sigma: float, cap: int) -> list[int]:
    rng = random.Random(seed)
    return [min(cap, max(4, int(rng.lognormvariate(0.0, sigma) * median))) for _ in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--median", type=int, default=32)
    parser.add_argument("--sigma", type=float, default=0.9)
    parser.add_argument("--cap", type=int, default=200)
    parser.add_argument("--step-delay-s", type=float, default=0.03)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.quick:
        # A smaller workload: 24 requests fill the 24 slots at once, so nothing queues and
        # only the tail on the slow workers is left to rebalance (expect ratios near 1).
        args.requests, args.median, args.cap, args.repeats = 24, 16, 96, 1
    delays = [0.0, 0.0, args.step_delay_s / 3, args.step_delay_s / 3, args.step_delay_s,
              args.step_delay_s]
    wall0 = time.perf_counter()

    stack = LocalStack(Path(tempfile.mkdtemp(prefix="rlh-longtail-")))
    etcd = stack.start_etcd()
    nodes = [f"node-{i}" for i in range(len(delays))]
    makespans: dict[str, list[float]] = {b: [] for b in BALANCERS}
    migrations: dict[str, list[int]] = {b: [] for b in BALANCERS}
    try:
        for i, delay in enumerate(delays):  # handed from balancer to balancer (job_turns.py)
            start_worker(stack, f"w{i}", "--max-running", "4", "--log-level", "warning",
                         "--max-len", "320", "--step-delay-s", str(delay),
                         *placed_flags(nodes[i], len(BALANCERS)))
        managers = {}
        for balancer in BALANCERS:
            port = free_port()
            proc = stack.start("rollout_manager", balancer, [
                # A job each: managers of one job elect one leader (the others stand by).
                "--manager-id", balancer, "--job", balancer, "--port", str(port),
                "--balancer", balancer,
                "--log-level", "warning", "--theta", "2"])
            managers[balancer] = f"127.0.0.1:{port}"
            wait_serving(WorkerHandle(proc, managers[balancer], 0), 60)
        warm = lognormal_lengths(args.requests, 99, args.median, args.sigma, args.cap)
        for balancer, endpoint in managers.items():
            turn(etcd, nodes, balancer, endpoint)
            warm_step = step_request(f"warm-{balancer}-", warm, seed=11)
            asyncio.run(run_step(endpoint, warm_step, None, None))
        for k in range(args.repeats):
            lengths = lognormal_lengths(args.requests, k, args.median, args.sigma, args.cap)
            for balancer, endpoint in managers.items():  # interleaved: noise hits all alike
                turn(etcd, nodes, balancer, endpoint)  # the workers are this balancer's job's
                before = asyncio.run(manager_status(endpoint)).migrations
                makespans[balancer].append(asyncio.run(run_step(
                    endpoint, step_request(f"s{k}-{balancer}-", lengths, seed=11), None, None)))
                migrations[balancer].append(asyncio.run(manager_status(endpoint)).migrations
                                            - before)
    finally:
        stack.stop()

    lengths0 = lognormal_lengths(args.requests, 0, args.median, args.sigma, args.cap)
    lines = [f"6 real workers (tiny model, CPU, --max-running 4), step delays {delays} s; "
             f"{args.requests} requests/step, max_tokens log-normal (median {args.median}, "
             f"sigma {args.sigma}, cap {args.cap}; step 0: max {max(lengths0)}, total "
             f"{sum(lengths0)} tokens), {args.repeats} step(s) per balancer after a warm-up step",
             "", "| balancer | mean step makespan (s) | vs Algorithm 2, per step: median "
             "[spread] | migrations/step |", "| --- | --- | --- | --- |"]
    ratios = {}
    for balancer, label in BALANCERS.items():
        mean = statistics.mean(makespans[balancer])
        per_step = sorted(m / a for m, a in zip(makespans[balancer], makespans["algorithm2"]))
        ratios[balancer] = f"{statistics.median(per_step):.2f}x [{per_step[0]:.2f}–{per_step[-1]:.2f}]"
        lines.append(f"| {label} | {mean:.2f} | {ratios[balancer]} | "
                     f"{statistics.mean(migrations[balancer]):.1f} |")
    lines += ["", f"ratio (median [spread] over {args.repeats} interleaved steps): round-robin / "
                  f"Algorithm 2 = {ratios['round_robin']}, JSQ / Algorithm 2 = {ratios['jsq']}",
              f"wall time of the benchmark: {time.perf_counter() - wall0:.0f} s"]
    print("\n".join(lines))
    if not args.quick:
        RESULTS.write_text("# Long-tail step makespan with real workers of unequal speed\n\n"
                           f"`python bench/manager_longtail.py --repeats {args.repeats}`\n\n"
                           + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
