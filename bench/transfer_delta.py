"""Sparse delta pull vs dense pull, end to end through a real transfer agent (ROSE §4.2): the
worker holds v; v+1 differs in 10%, 1% or 0.1% of the elements. Both pulls are timed from
PlanPull (which encodes on the agent, cold cache) to decoded, checksummed tensors in the worker.
Both sides run the codec on 2 threads (agent --codec-threads, client codec_threads); the delta
pull applies in place to the held version, as the worker's puller does.

    python bench/transfer_delta.py           # ~200 MB of bf16
    python bench/transfer_delta.py --quick   # ~48 MB, < 30 s
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from transfer_harness import local_stack, start_agent, write_results  # noqa: E402

from rlharvest.services.transfer_agent.client import publish, pull, weights_fingerprint  # noqa: E402

ZEROS = (0.9, 0.99, 0.999)


def next_version(tensors: dict, zero_fraction: float, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in tensors.items():
        new = t.clone()
        bits = new.view(-1).view(torch.int16)
        k = int(bits.numel() * (1 - zero_fraction))
        bits[torch.randint(0, bits.numel(), (k,), generator=gen)] ^= 1
        out[name] = new
    return out


async def run(mb: int) -> list[str]:
    stack = local_stack()
    rows = []
    try:
        endpoint, _ = start_agent(stack, "delta-agent", "--memory-budget-bytes", str(8 * (mb << 20)))
        n_tensors = 16
        numel = (mb << 20) // 2 // n_tensors
        base = {f"model.layers.{i}.mlp.up_proj.weight": torch.randn(numel).to(torch.bfloat16)
                for i in range(n_tensors)}
        version = 1
        await publish(endpoint, "delta", version, base)
        held = (await pull(endpoint, "delta", version=version)).tensors
        for zeros in ZEROS:
            new = next_version(held, zeros, seed=version)
            version += 1
            await publish(endpoint, "delta", version, new)
            expected = weights_fingerprint(new)
            sparse = await pull(endpoint, "delta", version=version, held=held,
                                held_version=version - 1, inplace=True)
            dense = await pull(endpoint, "delta", version=version)  # cold: dense encode too
            assert weights_fingerprint(sparse.tensors) == expected
            assert weights_fingerprint(dense.tensors) == expected
            assert sparse.delta and not dense.delta
            rows.append(f"| {zeros:.1%} | {dense.payload_bytes / 1e6:.1f} | "
                        f"{sparse.payload_bytes / 1e6:.2f} | "
                        f"{sparse.payload_bytes / dense.payload_bytes:.2%} | {dense.seconds:.3f} | "
                        f"{sparse.seconds:.3f} | {dense.seconds / sparse.seconds:.1f}x |")
            held = sparse.tensors
    finally:
        stack.stop()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    mb = 48 if args.quick else 200
    started = time.perf_counter()
    rows = asyncio.run(run(mb))
    text = "\n".join([
        "# transfer_delta: sparse delta pull vs dense pull through the agent, end to end\n",
        f"`python bench/transfer_delta.py{' --quick' if args.quick else ''}` — {mb} MB of bf16 "
        f"(16 tensors); worker holds v, pulls v+1; loopback; encode on the agent (cold), bytes, "
        f"decode + checksums in the worker (delta applied in place, as the puller does); codec on 2 "
        f"threads per side; bit-exact checked; 2 cores, load average "
        f"{os.getloadavg()[0]:.1f}; run took {time.perf_counter() - started:.0f}s.\n",
        "| zeros | dense MB | delta MB | delta / dense | dense s | delta s | speedup |",
        "|---|---|---|---|---|---|---|", *rows]) + "\n"
    write_results("transfer_delta" + ("_quick" if args.quick else ""), text)


if __name__ == "__main__":
    main()
