"""Agentic rollout: turn-wise routing with KV-cache affinity vs pinned vs turnwise (ROSE §4.3,
Table 3), on real processes.

etcd, rollout workers (``small``, one torch thread, paged KV with the prefix cache, 4 running
each), and one rollout manager started per configuration (``--turn-routing``). Trajectories run
concurrently, each turn by turn through the manager's ``Generate``. A turn's prompt is the last
turn's prompt, its completion and a 150-token environment reply. The first prompt is 300 tokens,
and a turn samples 8–48 tokens (drawn per trajectory and turn, the same in every configuration).
So histories grow to about 800 tokens, and the workers' loads drift apart as trajectories do.
Configurations, interleaved over rounds, fresh prompts each run:

- ``pinned``: a trajectory stays on its first turn's worker (bound when a worker has room);
- ``pinned-static``: the paper's baseline, bound at launch to the least assigned worker;
- ``turnwise``: each turn placed like any request (Algorithm 2's shortest queue);
- ``turnwise+affinity``: to the worker holding the history while it is under its cap, else as
  turnwise (the default).

With ``--coexec N`` (ROSE's end-to-end setting behind Table 3), N co-executors join the pool
(serving and rollout model ``small``, 4 rollout requests, prefix cache in the shared pool), the
manager borrows them, and each serves a bursty synthetic trace through its OpenAI-compatible API
for the whole run. Turns beyond the dedicated workers' caps spill onto them; their serving
traffic shares their core and takes their KV memory back.

Reported per configuration: rollout seconds (medians), the speed-up of each over pinned (median
[spread]), prefix-cache hits and the prefill tokens they skipped, summed over the dedicated
workers and the co-executors (both export ``rlh_worker_prefix_cache_*``), and how the manager
routed the turns.

    python bench/agentic_routing.py [--quick] [--rounds 3] [--trajectories 12] [--turns 4] [--workers 2] [--env-ms 0] [--coexec 0] [--serving-rps 2] [--no-write]

A full run writes ``bench/results/agentic_routing[_coexec].md``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlharvest.common import rpc  # noqa: E402
from rlharvest.common.local_etcd import free_port  # noqa: E402
from rlharvest.common.pb import rollout_manager_pb2_grpc  # noqa: E402
from rlharvest.cli import loadgen  # noqa: E402
from rlharvest.cli.launcher import LocalStack, ServiceProcess  # noqa: E402
from rlharvest.services.trainer.environments.runner import PlayConfig, generate_turn  # noqa: E402
from rlharvest.sim.ratios import spread  # noqa: E402
from rlharvest.sim.serving_trace import synthetic  # noqa: E402
from tests.integration.test_manager import scrape  # noqa: E402

from bench.coexec_serving import wait_http  # noqa: E402
from bench.manager_preemption import wait_healthy  # noqa: E402

SERVED = "served"
MODES = ("pinned", "pinned-static", "turnwise", "turnwise+affinity")
PROMPT, REPLY = 300, 150
RESULTS = Path(__file__).resolve().parent / "results"
REFUSED = 'rlh_worker_command_errors_total{code="RESOURCE_EXHAUSTED"}'
HIT_METRICS = ("rlh_worker_prefix_cache_hits_total", "rlh_worker_prefix_cache_saved_tokens_total")


async def trajectory(endpoint: str, tag: str, index: int, turns: int, seed: int,
                     env_s: float = 0.0) -> int:
    """One trajectory, turn by turn; returns the tokens it sampled."""
    rng = random.Random(f"{seed}-{tag}-{index}")
    lengths = random.Random(f"{seed}-{index}")  # the same in every configuration
    history = [1] + [rng.randrange(3, 128) for _ in range(PROMPT - 1)]
    sampled = 0
    cfg = PlayConfig(max_turns=turns, context=1024)
    async with rpc.channel(endpoint) as chan:
        stub = rollout_manager_pb2_grpc.RolloutManagerStub(chan)
        for turn in range(turns):
            tokens, _ = await generate_turn(
                stub, f"{tag}-{index}", turn, history, turn,
                dataclasses.replace(cfg, max_new_tokens=lengths.randint(8, 48)))
            sampled += len(tokens)
            history = history + tokens + [rng.randrange(3, 128) for _ in range(REPLY)]
            if env_s and turn < turns - 1:  # the environment acts (a tool call, a game step)
                await asyncio.sleep(env_s * lengths.uniform(0.5, 1.5))
    return sampled


async def run_trajectories(endpoint: str, tag: str, count: int, turns: int,
                           seed: int = 0, env_s: float = 0.0) -> float:
    """All trajectories at once; the wall seconds until the last one's last turn."""
    started = time.perf_counter()
    await asyncio.gather(*(trajectory(endpoint, tag, i, turns, seed, env_s)
                           for i in range(count)))
    return time.perf_counter() - started


def start_workers(stack: LocalStack, count: int) -> list[tuple[ServiceProcess, int]]:
    workers = []
    for i in range(count):
        metrics = free_port()
        proc = stack.start("rollout_worker", f"w{i}", [
            "--worker-id", f"w{i}", "--port", str(free_port()), "--metrics-port", str(metrics),
            "--lease-ttl", "2", "--torch-threads", "1", "--model", "small", "--max-running", "4",
            "--max-len", "1024", "--kv-pages", "4096", "--page-tokens", "16", "--prefix-cache",
            "--json-logs"])
        workers.append((proc, metrics))
    for proc, metrics in workers:
        wait_http(f"http://127.0.0.1:{metrics}/healthz", proc)
    return workers


def start_coexecs(stack: LocalStack, count: int) -> list[tuple[ServiceProcess, int, str]]:
    """Co-executors lent to the rollout; each one's process, metrics port and serving URL."""
    coexecs = []
    for i in range(count):
        metrics, http = free_port(), free_port()
        proc = stack.start("coexecutor", f"c{i}", [
            "--coexec-id", f"c{i}", "--port", str(free_port()), "--metrics-port", str(metrics),
            "--http-port", str(http), "--lease-ttl", "2", "--torch-threads", "1",
            "--serving-model", "small", "--model", "small", "--served-model-name", SERVED,
            "--max-running", "4", "--max-len", "1024", "--total-pages", "1024",
            "--page-tokens", "16", "--prefix-cache", "--drain-timeout", "1", "--json-logs"])
        coexecs.append((proc, metrics, f"http://127.0.0.1:{http}"))
    for proc, metrics, _ in coexecs:
        wait_http(f"http://127.0.0.1:{metrics}/healthz", proc)
    return coexecs


async def serve_bursts(urls: list[str], rps: float, seed: int) -> None:
    """Bursty serving traffic on every co-executor until cancelled (the run's end)."""
    async def one(url: str, k: int) -> None:
        for lap in range(1000):
            trace = [loadgen.fit_to_context(r, 512) for r in synthetic(
                60.0, rps, seed=seed + 1000 * k + lap, max_tokens=512, prompt_median=128,
                output_median=48, peak_to_mean=1.9)]
            await loadgen.replay(url, SERVED, trace, max_seconds=60.0)
    await asyncio.gather(*(one(url, k) for k, url in enumerate(urls)))


def start_manager(stack: LocalStack, mode: str, name: str,
                  coexecs: int = 0) -> tuple[ServiceProcess, str, int]:
    port, metrics = free_port(), free_port()
    proc = stack.start("rollout_manager", name, [
        "--port", str(port), "--metrics-port", str(metrics), "--lease-ttl", "2",
        "--turn-routing", mode, "--max-serving-workers", str(coexecs), "--json-logs"])
    wait_http(f"http://127.0.0.1:{metrics}/healthz", proc)
    # The last configuration's manager may still hold the job's leadership (its lease runs
    # out after --lease-ttl): a standby refuses Generate.
    deadline = time.monotonic() + 30
    while scrape(metrics).get("rlh_manager_leader", 0.0) != 1.0:
        if time.monotonic() > deadline:
            raise TimeoutError(f"manager {name} never led the job:\n{proc.log_tail()}")
        time.sleep(0.1)
    return proc, f"127.0.0.1:{port}", metrics


def refusals(coexecs: list[tuple[ServiceProcess, int, str]]) -> float:
    """Rollout requests the co-executors refused for memory so far (the manager re-places
    each; its routed counts include the re-placements)."""
    return sum(scrape(metrics).get(REFUSED, 0.0) for _, metrics, _ in coexecs)


def hits(metrics_ports: list[int]) -> tuple[float, float]:
    """Prefix-cache hits and prefill tokens skipped so far, summed over every rollout engine:
    the dedicated workers and the co-executors (whose worker core exports the same counters; a
    turn that spills onto a co-executor adopts its parked prefix there)."""
    samples = [scrape(metrics) for metrics in metrics_ports]
    return tuple(sum(s.get(name, 0.0) for s in samples) for name in HIT_METRICS)  # type: ignore


async def one_run(stack: LocalStack, workers, coexecs, mode: str, tag: str, round_: int,
                  args: argparse.Namespace) -> dict:
    proc, endpoint, metrics = start_manager(stack, mode, f"m-{tag}", len(coexecs))
    serving = None
    try:
        await wait_healthy(endpoint, len(workers) + len(coexecs))
        engines = [m for _, m in workers] + [m for _, m, _ in coexecs]
        before = hits(engines)
        refused_before = refusals(coexecs)
        if coexecs:
            serving = asyncio.ensure_future(serve_bursts([c[2] for c in coexecs],
                                                         args.serving_rps, seed=round_))  # same per round
        seconds = await run_trajectories(endpoint, tag, args.trajectories, args.turns,
                                         env_s=args.env_ms / 1000)
        after = hits(engines)
        refused = refusals(coexecs) - refused_before
        routed = {o: scrape(metrics).get(f'rlh_manager_turns_routed{{outcome="{o}"}}', 0.0)
                  for o in ("affinity", "moved", "first")}
    finally:
        if serving is not None:
            serving.cancel()
            await asyncio.gather(serving, return_exceptions=True)
        proc.terminate()
    return {"seconds": seconds, "hits": after[0] - before[0], "saved": after[1] - before[1],
            "routed": routed, "refused": refused}


async def bench(args: argparse.Namespace) -> None:
    stack = LocalStack(Path(tempfile.mkdtemp(prefix="rlh-agentic-")))
    stack.start_etcd()
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    try:
        workers = start_workers(stack, args.workers)
        coexecs = start_coexecs(stack, args.coexec)
        for r in range(args.rounds):
            shift = r % len(MODES)
            for i, mode in enumerate(MODES[shift:] + MODES[:shift]):
                runs[mode].append(await one_run(stack, workers, coexecs, mode, f"r{r}m{i}",
                                                r, args))
            print(f"  round {r} done", flush=True)
    finally:
        stack.stop()
    lines = report(runs, args)
    print("\n".join(lines))
    if not (args.quick or args.no_write):
        path = RESULTS / ("agentic_routing_coexec.md" if args.coexec else "agentic_routing.md")
        path.write_text(f"# Agentic routing\n\n`python {' '.join(sys.argv)}`, "
                        f"{time.strftime('%Y-%m-%d')}\n\n```\n" + "\n".join(lines) + "\n```\n")


def report(runs: dict[str, list[dict]], args: argparse.Namespace) -> list[str]:
    turns = args.trajectories * args.turns
    lines = [f"{args.workers} workers (small, 4 running, prefix cache), {args.trajectories} "
             f"trajectories x {args.turns} turns, histories {PROMPT}+ tokens, environment "
             f"{args.env_ms:.0f} ms between turns, {args.rounds} rounds, {args.coexec} "
             f"co-executors serving {args.serving_rps} req/s in bursts; cache hits and "
             "prefill tokens skipped: workers and co-executors together"]
    baselines = {b: [run["seconds"] for run in runs[b]] for b in ("pinned", "pinned-static")}
    for mode in MODES:
        secs = [run["seconds"] for run in runs[mode]]
        versus = []
        for name, base in baselines.items():
            versus.append(f"vs {name} {spread([b / s for b, s in zip(base, secs)])}")
        last = runs[mode][-1]
        lines.append(
            f"  {mode:18s} {statistics.median(secs):6.2f} s   {', '.join(versus)}   cache hits "
            f"{statistics.median(run['hits'] for run in runs[mode]):.0f}/{turns}, prefill "
            f"tokens skipped {statistics.median(run['saved'] for run in runs[mode]):.0f}, "
            f"refused by co-executors {statistics.median(run['refused'] for run in runs[mode]):.0f}"
            f"   routed (last run, re-placements included) {last['routed']}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 round, 6 trajectories, 3 turns")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--trajectories", type=int, default=12)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--env-ms", type=float, default=0.0,
                        help="the environment's time between turns (mean; 0.5-1.5x of it)")
    parser.add_argument("--coexec", type=int, default=0,
                        help="co-executors (serving GPUs) lent to the rollout, serving bursts")
    parser.add_argument("--serving-rps", type=float, default=2.0,
                        help="each co-executor's serving traffic, mean (bursts to 1.9x)")
    parser.add_argument("--no-write", action="store_true", help="do not write bench/results")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.trajectories, args.turns = 1, 6, 3
    asyncio.run(bench(args))


if __name__ == "__main__":
    main()
