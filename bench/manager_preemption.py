"""Preemption cost with real processes: migrate (resume from the last token, the default) vs
recompute (restart from the prompt, `--recompute-on-loss`), RLBoost §6.4.3 / Fig. 14.

Six real rollout workers (torch engine, tiny model, --max-running 4) and two real managers, one
of each kind, run the same step in turn: 48 requests x 64-128 tokens (seeded). In a clean run
nothing is killed; in a preempted run a third of the workers are SIGKILLed once the step has
streamed 25% (early), 50% (middle) or 75% (late) of its tokens, and replaced by fresh workers
before the next run. Each worker sleeps --step-delay-s after every engine step: on a machine with
fewer cores than workers, killing workers would otherwise *speed up* the survivors (less CPU
contention) and hide the lost capacity a real preemption costs. Reported: step-time overhead
over the clean step of the same manager, the tokens generated twice (manager GetStatus), and the
ratio migrate / recompute.

    python bench/manager_preemption.py [--quick] [--repeats 2]
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

from rlharvest.common import delta_batch, rpc  # noqa: E402
from rlharvest.common.local_etcd import free_port  # noqa: E402
from rlharvest.common.pb import common_pb2, rollout_manager_pb2 as mpb  # noqa: E402
from rlharvest.common.pb import rollout_manager_pb2_grpc  # noqa: E402
from rlharvest.models.tokenizer import CharTokenizer  # noqa: E402
from rlharvest.cli.launcher import LocalStack  # noqa: E402
from rlharvest.services.rollout_manager import client as manager_client  # noqa: E402
from tests.integration.worker_client import WorkerHandle, start_worker, wait_serving  # noqa: E402

from bench.job_turns import placed_flags, turn  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "manager_preemption.md"
TOK = CharTokenizer()
PROMPTS = [TOK.encode(f"{a}*{b}+{a}=") for a in range(1, 9) for b in range(1, 7)]
POINTS = {"early": 0.25, "middle": 0.5, "late": 0.75}


def step_request(prefix: str, lengths: list[int], seed: int = 7) -> mpb.SubmitStepRequest:
    return mpb.SubmitStepRequest(step_id=prefix, weight_version=0, requests=[
        mpb.RolloutRequest(request_id=f"{prefix}{i}", group_id=f"g{i // 4}",
                           prompt_token_ids=PROMPTS[i % len(PROMPTS)],
                           sampling=common_pb2.SamplingParams(temperature=1.0, max_tokens=n,
                                                              seed=seed + i))
        for i, n in enumerate(lengths)])


async def manager_status(endpoint: str) -> mpb.ManagerStatus:
    status = await manager_client.manager_status(endpoint, timeout=10)
    if status is None:
        raise RuntimeError(f"the manager at {endpoint} did not answer GetStatus")
    return status


async def wait_healthy(endpoint: str, count: int, timeout: float = 120) -> None:
    await manager_client.wait_workers(endpoint, count, timeout=timeout)


async def run_step(endpoint: str, request: mpb.SubmitStepRequest, kill_at: int | None,
                   kill) -> float:
    """Wall seconds of the step; ``kill()`` runs once ``kill_at`` tokens were streamed."""
    progress: dict[str, int] = {}  # per request: furthest position streamed (recompute rewinds)
    done = 0
    async with rpc.channel(endpoint) as chan:
        start = time.perf_counter()
        async for event in rollout_manager_pb2_grpc.RolloutManagerStub(chan).SubmitStep(
                request, timeout=600):
            for row in delta_batch.decode(event.batch).iter():
                rid = request.requests[row.request].request_id
                end = row.position + len(row.token_ids)
                if end > progress.get(rid, 0):
                    progress[rid] = end
            for c in event.completions:
                if c.failed:
                    raise RuntimeError(f"{c.request_id} failed: {c.finish_reason}")
                done += 1
            if kill_at is not None and sum(progress.values()) >= kill_at:
                kill()
                kill_at = None
        elapsed = time.perf_counter() - start
    assert done == len(request.requests), "the step ended before every completion arrived"
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="middle point only, smaller step")
    parser.add_argument("--workers", type=int, default=6)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--min-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="rounds (quick: 1)")
    parser.add_argument("--step-delay-s", type=float, default=0.04,
                        help="per engine step, so a worker's rate, not the machine's few shared "
                             "cores, bounds the step (as a GPU would); 0 = CPU-bound")
    args = parser.parse_args()
    points = dict(POINTS)
    if args.quick:
        args.requests, args.min_tokens, args.max_tokens = 24, 32, 64
        points = {"middle": 0.5}
        args.repeats = 1 if "--repeats" not in sys.argv else args.repeats
    rng = random.Random(0)
    lengths = [rng.randint(args.min_tokens, args.max_tokens) for _ in range(args.requests)]
    total = sum(lengths)
    victims = max(1, args.workers // 3)
    wall0 = time.perf_counter()

    stack = LocalStack(Path(tempfile.mkdtemp(prefix="rlh-preempt-")))
    etcd = stack.start_etcd()
    started = [0]
    nodes = [f"node-{i}" for i in range(args.workers)]

    def new_worker(node: str) -> WorkerHandle:
        """A worker on ``node``, handed between the modes' jobs by its turn (job_turns.py);
        a replacement takes a killed worker's node."""
        started[0] += 1
        return start_worker(stack, f"w{started[0]}", "--max-running", "4", "--log-level",
                            "warning", "--max-len", "256", "--step-delay-s",
                            str(args.step_delay_s), *placed_flags(node, 2))

    def new_manager(name: str, *extra: str) -> str:
        port = free_port()
        proc = stack.start("rollout_manager", name, [
            # A job each: managers of one job elect one leader (the others stand by).
            "--manager-id", name, "--job", name, "--port", str(port), "--log-level", "warning",
            "--lease-ttl", "2", "--stall-timeout-s", "20", *extra])
        wait_serving(WorkerHandle(proc, f"127.0.0.1:{port}", 0), 60)
        return f"127.0.0.1:{port}"

    results: dict[str, dict[str, list[float]]] = {}
    try:
        workers = [new_worker(node) for node in nodes]
        managers = {"migrate": new_manager("migrate"),
                    "recompute": new_manager("recompute", "--recompute-on-loss")}
        for mode, endpoint in managers.items():  # warm-up: first-touch costs out of the figures
            turn(etcd, nodes, mode, endpoint)
            asyncio.run(run_step(endpoint, step_request(f"warm-{mode}-", lengths[:12]), None, None))
        run = 0
        for _ in range(args.repeats):
            for mode, endpoint in managers.items():
                run += 1
                turn(etcd, nodes, mode, endpoint)
                clean = asyncio.run(run_step(endpoint, step_request(f"c{run}-", lengths), None,
                                             None))
                results.setdefault(mode, {}).setdefault("clean", []).append(clean)
            for point, fraction in points.items():
                for mode, endpoint in managers.items():
                    run += 1
                    turn(etcd, nodes, mode, endpoint)
                    before = asyncio.run(manager_status(endpoint)).tokens_regenerated
                    doomed = workers[:victims]

                    def kill(doomed=doomed) -> None:
                        for w in doomed:
                            w.process.kill()  # SIGKILL: a spot reclaim without notice

                    took = asyncio.run(run_step(endpoint, step_request(f"k{run}-", lengths),
                                                int(total * fraction), kill))
                    after = asyncio.run(manager_status(endpoint)).tokens_regenerated
                    row = results[mode].setdefault(point, [])
                    row.append(took)
                    results[mode].setdefault(f"{point}-regen", []).append(after - before)
                    # The killed workers' nodes get new workers; the next turn waits for them.
                    workers = workers[victims:] + [new_worker(n) for n in nodes[:victims]]
                    nodes = nodes[victims:] + nodes[:victims]
    finally:
        stack.stop()

    def mean(mode: str, key: str) -> float:
        return statistics.mean(results[mode][key])

    header = (f"{args.workers} real workers (tiny model, CPU, --max-running 4, "
              f"--step-delay-s {args.step_delay_s}), {args.requests} "
              f"requests x {args.min_tokens}-{args.max_tokens} tokens ({total} tokens), "
              f"{victims} worker(s) SIGKILLed at a fraction of the step's tokens, "
              f"{args.repeats} repeat(s); clean step: migrate {mean('migrate', 'clean'):.2f} s, "
              f"recompute {mean('recompute', 'clean'):.2f} s")
    lines = [header, "",
             "| preempted | migrate overhead (s) | recompute overhead (s) | migrate / recompute | "
             "same, per round: median [spread] | tokens regenerated: migrate / recompute |",
             "| --- | --- | --- | --- | --- | --- |"]
    ratios = {}
    for point, fraction in points.items():
        m = mean("migrate", point) - mean("migrate", "clean")
        r = mean("recompute", point) - mean("recompute", "clean")
        ratios[point] = m / r if r > 0 else float("nan")  # nan: recompute cost nothing here
        # Each round's own: its kill steps against its clean steps (a round whose recompute
        # cost nothing says nothing and is left out).
        rounds = sorted((mk - mc) / (rk - rc) for mk, mc, rk, rc in zip(
            results["migrate"][point], results["migrate"]["clean"],
            results["recompute"][point], results["recompute"]["clean"]) if rk > rc)
        spread = (f"{statistics.median(rounds):.2f}x [{rounds[0]:.2f}–{rounds[-1]:.2f}]"
                  if rounds else "—")
        lines.append(f"| {point} ({fraction:.0%}) | {m:.2f} | {r:.2f} | {ratios[point]:.2f}x | "
                     f"{spread} | "
                     f"{mean('migrate', point + '-regen'):.0f} / "
                     f"{mean('recompute', point + '-regen'):.0f} |")
    lines += ["", f"ratio at the middle point: migrate overhead / recompute overhead = "
                  f"{ratios['middle']:.2f}x (target <= 0.3x)",
              f"wall time of the benchmark: {time.perf_counter() - wall0:.0f} s"]
    print("\n".join(lines))
    if not args.quick:
        RESULTS.write_text("# Preemption with real processes: migrate vs recompute "
                           "(RLBoost §6.4.3, Fig. 14)\n\n"
                           f"`python bench/manager_preemption.py --repeats {args.repeats} "
                           f"--step-delay-s {args.step_delay_s}`\n\n"
                           + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
