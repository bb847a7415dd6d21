"""Sparse delta pull vs dense pull, end to end through a real transfer agent (ROSE §4.2): the
worker holds v; v+1 differs in 10%, 1% or 0.1% of the elements.

- dense: PlanPull (the agent encodes v+1 dense, cold cache) to decoded, CRC-checked tensors.
- delta: the trainer encodes v+1 against v from the positions its optimizer step changed
  (``LastPublished.encode_next``; timed), publishes it (not timed, like the dense publish it
  replaces), then the worker pulls it: PlanPull (the agent serves the trainer's encodings),
  bytes, decode, apply in place to the held v and verify by linear sums (no full pass).

Every version is pulled both ways, the order alternating; rounds repeat and the speedup is the
median of the per-version ratios with its spread. The first delta after the dense pull of v1
computes each tensor's linear sum once on both sides (a full pass); it runs before the timed
rounds and is reported on its own. Bit-exactness is checked on every pull (outside the timing).

    python bench/transfer_delta.py           # 200 MB of bf16, 3 rounds
    python bench/transfer_delta.py --quick   # 48 MB, 2 rounds, < 30 s
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
from rlharvest.sim.ratios import spread  # noqa: E402
from transfer_harness import local_stack, start_agent, write_results  # noqa: E402

from rlharvest.services.transfer_agent.client import (  # noqa: E402
    agent_channel,
    publish,
    publish_delta,
    pull,
    weights_fingerprint,
)
from rlharvest.services.transfer_agent.delta_publish import (  # noqa: E402
    LastPublished,
    changed_positions,
)

ZEROS = (0.9, 0.99, 0.999)
ENCODE_POOL = ThreadPoolExecutor(2, thread_name_prefix="encode")  # the trainer's 2 codec threads


def next_version(tensors: dict, zero_fraction: float, seed: int) -> tuple[dict, dict]:
    """v+1 with one low bit flipped at (1 - zero_fraction) of the positions, and those
    positions (what the optimizer step knows it changed, on the weights' device)."""
    gen = np.random.default_rng(seed)
    out, positions = {}, {}
    for name, t in tensors.items():
        new = t.clone()
        bits = new.view(-1).view(torch.int16)
        index = torch.from_numpy(np.unique(
            gen.integers(0, bits.numel(), int(bits.numel() * (1 - zero_fraction))))).to(t.device)
        bits[index] ^= 1
        out[name], positions[name] = new, index
    return out, positions


class Worker:
    """The rollout worker's side: the held version, its tensors and their linear sums."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.channel = agent_channel(endpoint)  # kept open, as the worker's puller does
        self.version = 0
        self.tensors: dict = {}
        self.sums: dict[str, int] = {}

    async def pull_delta(self, version: int):
        result = await pull(self.endpoint, "delta", version=version, held=self.tensors,
                            held_version=self.version, inplace=True, held_sums=self.sums,
                            channel=self.channel)
        if any(t.is_cuda for t in result.tensors.values()):  # the scatter ends the apply
            started = time.perf_counter()
            torch.cuda.synchronize()
            result.seconds += time.perf_counter() - started
        assert result.delta, result.note
        self.version, self.tensors, self.sums = version, result.tensors, result.sums
        return result


def record_update(trainer: LastPublished, version: int, new: dict, encoded: dict) -> dict:
    """The trainer's record of the published version: a full copy (``after``, before) timed
    beside the in-place update it now does (``advance``), which moves ``trainer`` on."""
    started = time.perf_counter()
    LastPublished.after(version, new, encoded)
    copy_s = time.perf_counter() - started
    started = time.perf_counter()
    trainer.advance(version, new, encoded)
    return {"record_copy_s": copy_s, "record_advance_s": time.perf_counter() - started}


async def one_version(endpoint: str, trainer: LastPublished, worker: Worker, zeros: float,
                      seed: int, dense_first: bool) -> tuple[dict, LastPublished]:
    """One version pulled both ways; its row and the trainer's record after publishing it."""
    new, positions = next_version(trainer.tensors, zeros, seed)
    version = trainer.version + 1
    started = time.perf_counter()
    encoded, stats = trainer.encode_next(new, positions, ENCODE_POOL.map)
    encode_s = time.perf_counter() - started
    started = time.perf_counter()
    await publish_delta(endpoint, "delta", version, trainer.version, encoded)
    publish_s = time.perf_counter() - started
    diff_s = time.perf_counter()
    for name, t in new.items():  # what a trainer without positions pays (CPU; ~free on a GPU)
        changed_positions(trainer.tensors[name], t)
    diff_s = time.perf_counter() - diff_s
    expected = weights_fingerprint(new)
    if dense_first:
        dense = await pull(endpoint, "delta", version=version)
        sparse = await worker.pull_delta(version)
    else:
        sparse = await worker.pull_delta(version)
        dense = await pull(endpoint, "delta", version=version)
    assert weights_fingerprint(sparse.tensors) == expected, "delta pull is not bit-exact"
    assert weights_fingerprint(dense.tensors) == expected, "dense pull is not bit-exact"
    assert not dense.delta
    return {"zeros": zeros, "dense_s": dense.seconds, "encode_s": encode_s,
            "pull_s": sparse.seconds, "delta_s": encode_s + sparse.seconds,
            "ratio": dense.seconds / (encode_s + sparse.seconds),
            "pull_ratio": dense.seconds / sparse.seconds, "publish_s": publish_s,
            "diff_s": diff_s, "dense_mb": dense.payload_bytes / 1e6,
            "delta_mb": sparse.payload_bytes / 1e6,
            "changed": stats.changed_fraction, **record_update(trainer, version, new, encoded)}, \
        trainer


async def run(mb: int, rounds: int, device: str,
              worker_device: str) -> tuple[list[dict], dict]:
    stack = local_stack()
    try:
        endpoint, _ = start_agent(stack, "delta-agent", "--memory-budget-bytes", str(8 * (mb << 20)))
        n_tensors = 16
        numel = (mb << 20) // 2 // n_tensors
        gen = torch.Generator().manual_seed(0)
        base = {f"model.layers.{i}.mlp.up_proj.weight":
                torch.randn(numel, generator=gen).to(torch.bfloat16) for i in range(n_tensors)}
        await publish(endpoint, "delta", 1, base)
        # The trainer's weights and its record of v on ``device``: on a GPU the compare, the
        # gather and the sums run there (``encode_changes_on_device``).
        trainer = LastPublished(1, {name: t.to(device) for name, t in base.items()})
        worker = Worker(endpoint)
        first = await pull(endpoint, "delta", version=1)
        # A GPU worker keeps its copy where its engine is: deltas apply there
        # (``decode_with_torch``), and a load is a device-to-device copy.
        worker.version, worker.sums = 1, first.sums
        worker.tensors = {name: t.to(worker_device) for name, t in first.tensors.items()}
        warm, trainer = await one_version(endpoint, trainer, worker, 0.99, seed=1,
                                          dense_first=True)
        rows = []
        for round_ in range(rounds):
            for zeros in ZEROS:
                row, trainer = await one_version(endpoint, trainer, worker, zeros,
                                                 seed=trainer.version,
                                                 dense_first=round_ % 2 == 0)
                rows.append(row)
        return rows, warm
    finally:
        stack.stop()


def table(rows: list[dict], warm: dict) -> list[str]:
    out = ["| zeros | dense MB | delta MB | dense pull s | trainer encode ms | delta pull s | "
           "speedup, median [spread] | pull alone | delta publish s | trainer CPU diff s | "
           "trainer record: copy ms / in place ms |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for zeros in ZEROS:
        mine = [r for r in rows if r["zeros"] == zeros]

        def med(key: str, mine: list[dict] = mine) -> float:
            return statistics.median(r[key] for r in mine)

        out.append(f"| {zeros:.1%} | {med('dense_mb'):.1f} | {med('delta_mb'):.2f} | "
                   f"{med('dense_s'):.3f} | {med('encode_s') * 1e3:.1f} | {med('pull_s'):.3f} | "
                   f"**{spread([r['ratio'] for r in mine], 1)}** | "
                   f"{spread([r['pull_ratio'] for r in mine], 1)} | {med('publish_s'):.3f} | "
                   f"{med('diff_s'):.3f} | {med('record_copy_s') * 1e3:.0f} / "
                   f"{med('record_advance_s') * 1e3:.1f} |")
    out.append(f"\nFirst delta after the dense pull (99% zeros; each side computes the linear "
               f"sums once): encode {warm['encode_s'] * 1e3:.0f} ms + pull {warm['pull_s']:.3f} s "
               f"vs dense {warm['dense_s']:.3f} s ({warm['ratio']:.1f}x).")
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--device", default="cpu",
                        help="where the trainer's weights and its record live (cuda: the "
                             "encode runs on the GPU)")
    parser.add_argument("--worker-device", default=None,
                        help="where the worker holds its copy and applies deltas (default: "
                             "--device); the dense pull stays a pull to host memory")
    args = parser.parse_args()
    args.worker_device = args.worker_device or args.device
    mb = 48 if args.quick else 200
    rounds = args.rounds or (2 if args.quick else 3)
    started = time.perf_counter()
    rows, warm = asyncio.run(run(mb, rounds, args.device, args.worker_device))
    text = "\n".join([
        "# transfer_delta: sparse delta pull vs dense pull through the agent, end to end\n",
        f"`python bench/transfer_delta.py{' --quick' if args.quick else ''}"
        f"{'' if args.device == 'cpu' else ' --device ' + args.device}"
        f"{'' if args.worker_device == args.device else ' --worker-device ' + args.worker_device}"
        f"` — {mb} MB of bf16 "
        f"(16 tensors), {rounds} rounds of the three sparsities, each version pulled both ways "
        f"(order alternating); loopback; codec on 2 threads per side; bit-exact checked; speedup "
        f"= dense pull / (trainer encode + delta pull), per version (pull alone: without the "
        f"trainer's encode); trainer on {args.device}, worker's copy on {args.worker_device} "
        f"(the dense pull decodes to host memory, its copy to a GPU not counted); "
        f"{os.cpu_count()} cores, load average "
        f"{os.getloadavg()[0]:.1f}; run took {time.perf_counter() - started:.0f}s.\n",
        *table(rows, warm)]) + "\n"
    where = "" if args.device == "cpu" else "_" + args.device.split(":")[0]
    if args.worker_device != args.device:
        where += "_worker_" + args.worker_device.split(":")[0]
    write_results("transfer_delta" + where, text, args.quick)


if __name__ == "__main__":
    main()
