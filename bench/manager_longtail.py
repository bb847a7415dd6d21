"""Long-tail step makespan with real workers: Algorithm 2 with the cost-aware migration rule vs
the paper's rule vs JSQ without migration vs round-robin (RLBoost §4.2.1, §6.4.3).

Six real rollout workers (torch engine, tiny model, --max-running 4), slowed by sleeping after
each engine step (emulated GPU-like step cost, or slower hardware). `--case unequal` (the
default): two sleep `--step-delay-s`, two a third as much, two not at all. `--case equal`: all
sleep `--step-delay-s`. `--case slow`: all sleep `--step-delay-s`, one four times as much. `--case trainer`: what `rlharvest up --trainer`
runs by default, three workers of `--max-running 64` without delays, 64 requests of a few tokens
(median 4, cap 16). It does not show the paper's rule's two moves per completion under `rlharvest up
--trainer`: those came at each step's head, from new weights reaching one worker first
(bench/up_migrations.py runs the real command).
Response lengths are long-tailed: each request's max_tokens is drawn from a seeded log-normal and
no stop token is set, so every request generates exactly that many tokens. Three real managers,
one per `--balancer`, run the same steps in turn on the same workers; each first runs a warm-up
step (it captures the batching profile P that Algorithm 2's executing-request migration uses,
and the lengths the cost-aware rule expects). Each configuration is a job of its own; steps run
interleaved, one configuration after the other on the same lengths (a seed per round).
Reported: makespan ratios per round (median [spread]) and migrations per completion.

    python bench/manager_longtail.py [--quick] [--case equal|slow|unequal] [--repeats 3]
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

RESULTS = Path(__file__).resolve().parent / "results"  # manager_longtail_<case>.md
# configuration -> (label, manager flags)
CONFIGS = {
    "paper": ("Algorithm 2, the paper's migration rule",
              ["--balancer", "algorithm2", "--migration-rule", "paper"]),
    "cost-aware": ("Algorithm 2, cost-aware migration",
                   ["--balancer", "algorithm2", "--migration-rule", "cost-aware"]),
    "jsq": ("JSQ, immediate dispatch, no migration", ["--balancer", "jsq"]),
    "round_robin": ("round-robin, no migration", ["--balancer", "round_robin"]),
}


def delays_of(case: str, delay: float) -> list[float]:
    if case == "trainer":
        return [0.0] * 3
    if case == "equal":
        return [delay] * 6
    if case == "slow":
        return [delay] * 5 + [4 * delay]
    return [0.0, 0.0, delay / 3, delay / 3, delay, delay]


def spread(values: list[float], bases: list[float]) -> str:
    r = sorted(v / b for v, b in zip(values, bases) if b > 0)
    return f"{statistics.median(r):.2f}x [{r[0]:.2f}–{r[-1]:.2f}]" if r else "n/a"


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
    parser.add_argument("--repeats", type=int, default=3, help="rounds, a seed of lengths each")
    parser.add_argument("--case", choices=("unequal", "equal", "slow", "trainer"),
                        default="unequal")
    parser.add_argument("--configs", default="paper,cost-aware,jsq,round_robin",
                        help=f"comma-separated, of {', '.join(CONFIGS)}; the first is the base")
    args = parser.parse_args()
    if args.quick:
        # A smaller workload: 24 requests fill the 24 slots at once, so nothing queues and
        # only the tail is left to rebalance.
        args.requests, args.median, args.cap = 24, 16, 96
        args.repeats = 1 if "--repeats" not in sys.argv else args.repeats
    max_running = "4"
    if args.case == "trainer":
        args.requests, args.median, args.cap, max_running = 64, 4, 16, "64"
    configs = {c: CONFIGS[c] for c in args.configs.split(",")}
    base = next(iter(configs))
    delays = delays_of(args.case, args.step_delay_s)
    wall0 = time.perf_counter()

    stack = LocalStack(Path(tempfile.mkdtemp(prefix="rlh-longtail-")))
    etcd = stack.start_etcd()
    nodes = [f"node-{i}" for i in range(len(delays))]
    makespans: dict[str, list[float]] = {b: [] for b in configs}
    migrations: dict[str, list[int]] = {b: [] for b in configs}
    try:
        for i, delay in enumerate(delays):  # handed from config to config (job_turns.py)
            start_worker(stack, f"w{i}", "--max-running", max_running, "--log-level", "warning",
                         "--max-len", "320", "--step-delay-s", str(delay),
                         *placed_flags(nodes[i], len(configs)))
        managers = {}
        for balancer, (_, flags) in configs.items():
            port = free_port()
            job = balancer.replace("-", "_")
            proc = stack.start("rollout_manager", job, [
                # A job each: managers of one job elect one leader (the others stand by).
                "--manager-id", job, "--job", job, "--port", str(port), *flags,
                "--log-level", "warning", "--theta", "2"])
            managers[balancer] = f"127.0.0.1:{port}"
            wait_serving(WorkerHandle(proc, managers[balancer], 0), 60)
        warm = lognormal_lengths(args.requests, 99, args.median, args.sigma, args.cap)
        for balancer, endpoint in managers.items():
            turn(etcd, nodes, balancer.replace("-", "_"), endpoint)
            warm_step = step_request(f"warm-{balancer}-", warm, seed=11)
            asyncio.run(run_step(endpoint, warm_step, None, None))
        for k in range(args.repeats):
            lengths = lognormal_lengths(args.requests, k, args.median, args.sigma, args.cap)
            for balancer, endpoint in managers.items():  # interleaved: noise hits all alike
                turn(etcd, nodes, balancer.replace("-", "_"), endpoint)  # its job's workers
                before = asyncio.run(manager_status(endpoint)).migrations
                makespans[balancer].append(asyncio.run(run_step(
                    endpoint, step_request(f"s{k}-{balancer}-", lengths, seed=11), None, None)))
                migrations[balancer].append(asyncio.run(manager_status(endpoint)).migrations
                                            - before)
    finally:
        stack.stop()

    lengths0 = lognormal_lengths(args.requests, 0, args.median, args.sigma, args.cap)
    lines = [f"case {args.case}: {len(delays)} real workers (tiny model, CPU, --max-running "
             f"{max_running}), step delays "
             f"{delays} s; {args.requests} requests/step, max_tokens log-normal (median "
             f"{args.median}, sigma {args.sigma}, cap {args.cap}; step 0: max {max(lengths0)}, "
             f"total {sum(lengths0)} tokens), {args.repeats} round(s) after a warm-up step",
             "", f"| configuration | makespan vs {base}, per round: median [spread] | "
             "makespan vs jsq | migrations per completion |", "| --- | --- | --- | --- |"]
    for balancer, (label, _) in configs.items():
        vs_jsq = spread(makespans[balancer], makespans["jsq"]) if "jsq" in configs else "n/a"
        per_completion = statistics.mean(migrations[balancer]) / args.requests
        lines.append(f"| {label} | {spread(makespans[balancer], makespans[base])} | {vs_jsq} | "
                     f"{per_completion:.2f} |")
    lines += ["", f"wall time of the benchmark: {time.perf_counter() - wall0:.0f} s"]
    print("\n".join(lines))
    if not args.quick:
        out = RESULTS / f"manager_longtail_{args.case}.md"
        out.write_text(f"# Long-tail step makespan with real workers ({args.case})\n\n"
                       f"`python bench/manager_longtail.py --case {args.case} --repeats "
                       f"{args.repeats} --configs {args.configs}`\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
