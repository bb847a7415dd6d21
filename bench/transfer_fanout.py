"""Many workers pulling one version from one agent at once vs one worker alone. Pulls of
different workers are independent streams; the agent encodes and packs once (cache) and the
aggregate is bounded by the agent's send side. Each puller is its own process, as workers are.

    python bench/transfer_fanout.py           # 128 MB, 1 vs 2/4/8 pullers
    python bench/transfer_fanout.py --quick   # 32 MB, 1 vs 4, < 30 s
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from transfer_harness import local_stack, start_agent, write_results  # noqa: E402


def _pull(endpoint: str, barrier) -> float:
    from rlharvest.services.transfer_agent.client import pull
    barrier.wait()
    started = time.perf_counter()
    asyncio.run(pull(endpoint, "fanout", version=1))
    return time.perf_counter() - started


def concurrent(endpoint: str, n: int) -> tuple[float, float]:
    """(wall seconds until all n have their decoded version, mean per-pull seconds)."""
    ctx = mp.get_context("fork")
    with ctx.Manager() as manager:
        barrier = manager.Barrier(n + 1)
        with ctx.Pool(n) as pool:
            pending = pool.starmap_async(_pull, [(endpoint, barrier)] * n)
            barrier.wait()
            started = time.perf_counter()
            each = pending.get()
            wall = time.perf_counter() - started
    return wall, sum(each) / n


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=0, help="rounds (0: 3, quick 1)")
    args = parser.parse_args()
    mb, counts = (32, (1, 4)) if args.quick else (128, (1, 2, 4, 8))
    from rlharvest.services.transfer_agent.client import publish
    stack = local_stack()
    rows = []
    try:
        endpoint, _ = start_agent(stack, "fanout-agent")
        tensors = {f"model.layers.{i}.mlp.up_proj.weight": torch.randn((mb << 20) // 2 // 16)
                   .to(torch.bfloat16) for i in range(16)}
        asyncio.run(publish(endpoint, "fanout", 1, tensors))
        concurrent(endpoint, 1)  # warm the agent's encode/pack cache
        runs: dict[int, list[tuple[float, float]]] = {n: [] for n in counts}
        for _ in range(args.repeats or (1 if args.quick else 3)):
            for n in counts:  # each round measures every count: noise hits all alike
                runs[n].append(concurrent(endpoint, n))
        for n in counts:
            wall = statistics.median(w for w, _ in runs[n])
            mean = statistics.median(m for _, m in runs[n])
            vs_one = sorted(w / one for (w, _), (one, _) in zip(runs[n], runs[counts[0]]))
            rows.append(f"| {n} | {wall:.2f} | {mean:.2f} | {n * mb / wall:.0f} | "
                        f"{statistics.median(vs_one):.2f}x [{vs_one[0]:.2f}–{vs_one[-1]:.2f}] |")
    finally:
        stack.stop()
    text = "\n".join([
        "# transfer_fanout: N workers pulling at once vs one\n",
        f"`python bench/transfer_fanout.py{' --quick' if args.quick else ''}` — {mb} MB bf16 "
        f"version, each puller a process (pull + decode + checksums), one agent, loopback; "
        f"{os.cpu_count()} cores shared by agent and pullers, load average "
        f"{os.getloadavg()[0]:.1f}.\n",
        "| pullers | wall s (all done), median | mean per-pull s, median | aggregate MB/s | "
        "wall vs 1, per round: median [spread] |",
        "|---|---|---|---|---|", *rows]) + "\n"
    write_results("transfer_fanout", text, args.quick)


if __name__ == "__main__":
    main()
