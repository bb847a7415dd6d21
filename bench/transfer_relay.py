"""Relay across a throttled link (WEAVE §5.2): one copy over the slow link, then broadcast
inside the cluster (relay_mode gateway) vs every receiving agent pulling across the link itself
(relay_mode flat, the baseline). The link is a token bucket in the sender, shared by every pull
that crosses it. Timed from the publish returning to the last receiving agent holding the version.

    python bench/transfer_relay.py           # 64 MB, 4 receivers, 64 MB/s link
    python bench/transfer_relay.py --quick   # 16 MB, 3 receivers, 32 MB/s link, < 30 s
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from transfer_harness import local_stack, start_agent, write_results  # noqa: E402

from rlharvest.common import keys, registry  # noqa: E402
from rlharvest.services.transfer_agent.client import publish  # noqa: E402


async def all_hold(etcd_endpoint: str, job: str, agents: list[str], version: int,
                   timeout: float = 300) -> None:
    etcd = await registry.connect(etcd_endpoint)
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            held = 0
            for agent in agents:
                found = await etcd.get(keys.weights_holder_key(job, agent).encode())
                held += found is not None and version in json.loads(found.value)["versions"]
            if held == len(agents):
                return
            await asyncio.sleep(0.05)
        raise TimeoutError("receivers did not get the version")
    finally:
        await etcd.close()


def run(mode: str, mb: int, receivers: int, link: float) -> tuple[float, float]:
    stack = local_stack()
    try:
        src, src_metrics = start_agent(stack, "src", "--cross-cluster-rate-bytes-per-s",
                                       str(link), "--chunk-bytes", str(1 << 20), cluster="train")
        names = [f"recv-{i}" for i in range(receivers)]
        for name in names:
            start_agent(stack, name, "--relay", "--relay-mode", mode, cluster="rollout")
        tensors = {f"model.layers.{i}.mlp.up_proj.weight": torch.randn((mb << 20) // 2 // 8)
                   .to(torch.bfloat16) for i in range(8)}
        asyncio.run(publish(src, "relay", 1, tensors))
        started = time.perf_counter()
        asyncio.run(all_hold(stack.etcd.endpoint, "relay", names, 1))
        seconds = time.perf_counter() - started
        import urllib.request
        text = urllib.request.urlopen(f"http://127.0.0.1:{src_metrics}/metrics").read().decode()
        cross = sum(float(line.split()[-1]) for line in text.splitlines()
                    if line.startswith('rlh_agent_bytes_out_total{link="cross"}'))
        return seconds, cross
    finally:
        stack.stop()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=0, help="rounds (0: 3, quick 1)")
    args = parser.parse_args()
    mb, receivers, link = (16, 3, 32e6) if args.quick else (64, 4, 64e6)
    flat, gate = [], []
    for k in range(args.repeats or (1 if args.quick else 3)):
        # Interleaved, the order alternating, so the box's noise hits both alike.
        for mode in ("flat", "gateway") if k % 2 == 0 else ("gateway", "flat"):
            (flat if mode == "flat" else gate).append(run(mode, mb, receivers, link))
    speedups = sorted(f[0] / g[0] for f, g in zip(flat, gate))
    flat_s, flat_bytes = statistics.median(f[0] for f in flat), flat[0][1]
    gate_s, gate_bytes = statistics.median(g[0] for g in gate), gate[0][1]
    text = "\n".join([
        "# transfer_relay: one copy over a throttled link, then broadcast, vs flat pulls\n",
        f"`python bench/transfer_relay.py{' --quick' if args.quick else ''}` — {mb} MB bf16 "
        f"version published in cluster `train`; {receivers} relaying agents in cluster "
        f"`rollout`; link = {link / 1e6:.0f} MB/s token bucket in the sender; real agent "
        f"processes, loopback; load average {os.getloadavg()[0]:.1f}.\n",
        "| mode | seconds until every receiver holds it (median) | bytes over the link | copies |",
        "|---|---|---|---|",
        f"| flat (every receiver crosses the link) | {flat_s:.2f} | {flat_bytes / 1e6:.1f} MB | "
        f"{flat_bytes / (mb << 20):.1f} |",
        f"| gateway (one copy, then inside the cluster) | {gate_s:.2f} | "
        f"{gate_bytes / 1e6:.1f} MB | {gate_bytes / (mb << 20):.1f} |",
        f"\nspeedup gateway vs flat, per round: median {statistics.median(speedups):.2f}x "
        f"[{speedups[0]:.2f}–{speedups[-1]:.2f}] over {len(speedups)} interleaved rounds\n"])
    write_results("transfer_relay", text, args.quick)


if __name__ == "__main__":
    main()
