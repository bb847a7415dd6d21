"""The manager's policy at thousands of workers, on the simulator's virtual clock: the cost of a
tick (wall time of ``RolloutControl.tick``, the whole decision loop: SELECTINSTANCE, CONTINUOUSLB
and the rest) and the step's makespan of Algorithm 2 with the cost-aware migration rule against
the paper's rule and JSQ without migration.

Workers of capacity ``--per-worker``, one in ten at half speed (a slow or throttled GPU), decode
a step of ``workers x per-worker`` requests of log-normal lengths after a warm-up step of the
same size (it captures P and the lengths the cost-aware rule expects). Strategies run
interleaved per seed; ticks are timed in the measured step only.

    python bench/manager_scale_sim.py            # 1,024 workers x 32 and 10,240 x 4, 3 seeds
    python bench/manager_scale_sim.py --quick    # 256 workers x 32, 1 seed
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlharvest.common.engine_types import SamplingParams  # noqa: E402
from rlharvest.services.rollout_manager.tracker import NewRequest  # noqa: E402
from rlharvest.sim.manager_policy import (  # noqa: E402
    Scenario,
    SimClock,
    SimWorker,
    StepSimulation,
    long_tail_lengths,
    make_control,
)

RESULTS = Path(__file__).resolve().parent / "results" / "manager_scale_sim.md"
STRATEGIES: dict[str, str] = {"cost_aware": "Algorithm 2, cost-aware migration",
                              "rlboost": "Algorithm 2, the paper's migration rule",
                              "jsq": "JSQ, immediate dispatch, no migration"}


def run(workers: int, per_worker: int, seed: int, strategy: str,
        gc_paused: bool) -> dict[str, float]:
    specs = tuple(SimWorker(f"w{i:05d}", speed=0.5 if i % 10 == 0 else 1.0,
                            capacity=per_worker) for i in range(workers))
    n = workers * per_worker
    scenario = Scenario(specs, long_tail_lengths(n, 2 * seed + 1, median=32, max_tokens=256),
                        iterations_per_event=16, lb_interval_s=0.25)
    warm = Scenario(specs, long_tail_lengths(n, 2 * seed + 2, median=32, max_tokens=256),
                    iterations_per_event=16, lb_interval_s=0.25)
    clock = SimClock()
    control = make_control(strategy, clock)  # type: ignore[arg-type]
    StepSimulation(warm, control, clock, "warm").run()
    migrations0 = control.tracker.counters.migrations
    ticks: list[float] = []
    tick = control.tick

    def timed():  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        out = tick()
        ticks.append(time.perf_counter() - t)
        return out

    control.tick = timed  # type: ignore[method-assign]
    if gc_paused:  # the policy's own cost: no gen-2 collection of the whole heap in a tick
        gc.collect()
        gc.disable()
    try:
        result = StepSimulation(scenario, control, clock, "step").run()
    finally:
        gc.enable()
    assert result.contiguous and result.finished == n
    burst, ticks = ticks[0], sorted(ticks[1:])  # the first dispatches the whole step
    return {"makespan": result.makespan_s, "ticks": len(ticks),
            "p50_ms": 1e3 * ticks[len(ticks) // 2],
            "p99_ms": 1e3 * ticks[min(len(ticks) - 1, int(0.99 * len(ticks)))],
            "burst_ms": 1e3 * burst,
            "migrations_per_completion": (control.tracker.counters.migrations - migrations0) / n}


def memory_per_request(workers: int, per_worker: int) -> float:
    """Bytes the manager's core holds per request in flight: traced allocations of adding a
    step of ``workers x per_worker`` requests (64-token prompts, the caller's) and of the tick
    that dispatches it, less the growth of the ledger's token arena (the tokens' own storage)."""
    control = make_control("cost_aware", SimClock())
    for i in range(workers):
        control.worker_joined(f"w{i:05d}", 0, per_worker, "gpu")
    n = workers * per_worker
    sampling = SamplingParams(max_tokens=256)
    requests = [NewRequest(f"r{i}", f"r{i}", (5,) * 64, sampling, 0) for i in range(n)]
    ledger = control.tracker.ledger
    gc.collect()
    tracemalloc.start()
    before, arena = tracemalloc.get_traced_memory()[0], ledger.token_bytes
    control.add_step("memory", requests, 0)
    dispatched = len(control.tick())  # its commands are the caller's: not kept
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] - before - (ledger.token_bytes - arena)
    tracemalloc.stop()
    assert dispatched == n
    return held / n


def spread(values: list[float], bases: list[float]) -> str:
    r = sorted(v / b for v, b in zip(values, bases) if b > 0)
    return f"{statistics.median(r):.2f}x [{r[0]:.2f}–{r[-1]:.2f}]" if r else "n/a"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--sizes", default="1024x32,10240x4",
                        help="workers x requests per worker, comma-separated")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--gc", choices=("paused", "on"), default="paused",
                        help="paused: Python's cyclic collector is off during the measured "
                             "step, so a tick's time is the policy's (with it on, a gen-2 "
                             "collection of the simulator's whole heap lands in some tick, "
                             "hundreds of ms at 32k requests, whichever strategy)")
    args = parser.parse_args()
    if args.quick:
        args.sizes = "256x32"
        args.seeds = 1 if "--seeds" not in sys.argv else args.seeds
    strategies = args.strategies.split(",")
    wall0 = time.perf_counter()
    lines = ["One worker in ten at half speed; log-normal lengths (median 32, cap 256), 16 "
             "decode iterations per simulated engine step, a tick every 0.25 s of virtual "
             f"time and on every completion while requests wait; {args.seeds} seed(s), "
             "strategies interleaved. Tick times are wall ms of the whole tick on this "
             "machine (2 shared cores), in the measured step: p50 and p99 over its ticks but the "
             "first, which dispatches the whole step (its own column); Python's cyclic "
             f"collector {'paused during the step' if args.gc == 'paused' else 'on'}.", "",
             "| workers x per worker (in flight) | strategy | makespan vs JSQ: median [spread] "
             "| vs the paper's rule | migrations per completion | ticks | tick p50 / p99 (ms) | "
             "p99 per 1k workers (ms) | the step's first tick, dispatching it (ms) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for size in args.sizes.split(","):
        workers, per_worker = (int(x) for x in size.split("x"))
        runs: dict[str, list[dict[str, float]]] = {s: [] for s in strategies}
        for seed in range(args.seeds):
            for s in strategies:  # interleaved: the machine's noise hits all alike
                runs[s].append(run(workers, per_worker, seed, s, args.gc == "paused"))
                r = runs[s][-1]
                print(f"{workers}x{per_worker} seed {seed} {s}: makespan {r['makespan']:.2f} "
                      f"tick p99 {r['p99_ms']:.1f} ms", flush=True)
        for s in strategies:
            ms = [r["makespan"] for r in runs[s]]
            vs_jsq = spread(ms, [r["makespan"] for r in runs["jsq"]]) if "jsq" in runs else "n/a"
            vs_paper = (spread(ms, [r["makespan"] for r in runs["rlboost"]])
                        if "rlboost" in runs else "n/a")
            p50 = statistics.median(r["p50_ms"] for r in runs[s])
            p99 = statistics.median(r["p99_ms"] for r in runs[s])
            burst = statistics.median(r["burst_ms"] for r in runs[s])
            mpc = statistics.mean(r["migrations_per_completion"] for r in runs[s])
            ticks = statistics.mean(r["ticks"] for r in runs[s])
            lines.append(f"| {workers:,} x {per_worker} ({workers * per_worker:,}) | "
                         f"{STRATEGIES.get(s, s)} | {vs_jsq} | {vs_paper} | {mpc:.2f} | "
                         f"{ticks:.0f} | {p50:.1f} / {p99:.1f} | {p99 / workers * 1024:.1f} | "
                         f"{burst:.0f} |")
    lines += ["", "The core's memory per request in flight (tracemalloc around adding a step and the "
              "tick that dispatches it, the ledger's token arena excluded): " + "; ".join(
                  f"{w:,} x {p}: {memory_per_request(w, p) / 1024:.2f} KB" for w, p in (
                      (int(x) for x in size.split("x")) for size in args.sizes.split(",")))]
    lines += ["", f"wall time of the benchmark: {time.perf_counter() - wall0:.0f} s"]
    print("\n".join(lines))
    if not args.quick:
        RESULTS.write_text("# The manager's policy at thousands of workers (simulated)\n\n"
                           f"`python bench/manager_scale_sim.py --sizes {args.sizes} --seeds "
                           f"{args.seeds} --gc {args.gc}`\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
