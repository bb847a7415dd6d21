"""Where the trainer's delta encode and the worker's delta apply spend their time on a GPU
(run on a lent machine: ``python3 tools/gpu_delta_profile.py``).

The model of ``bench/transfer_delta.py`` (200 MB of bf16 in 16 tensors) on CUDA, one version
at 99% and one at 99.9% zeros: the encode (``LastPublished.encode_next``) timed on one thread
and on the bench's two, then torch.profiler's top operators by host time for one encode; and
the apply of the same delta to a copy held on the GPU (``decode_with_torch``, in place).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from transfer_delta import ENCODE_POOL, next_version  # noqa: E402  (the bench's own versions)

from rlharvest.services.transfer_agent.delta_codec import (  # noqa: E402
    decode_with_torch,
    undo_delta,
)
from rlharvest.services.transfer_agent.delta_publish import LastPublished  # noqa: E402


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: to check the tool here


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def timed(fn, repeats: int = 5) -> float:
    walls = []
    for _ in range(repeats):
        _sync()
        started = time.perf_counter()
        fn()
        _sync()
        walls.append(time.perf_counter() - started)
    return statistics.median(walls)


def main() -> None:
    numel = (int(sys.argv[1]) if len(sys.argv) > 1 else 200 << 20) // 2 // 16
    gen = torch.Generator().manual_seed(0)
    base = {f"t{i}": torch.randn(numel, generator=gen).to(torch.bfloat16).to(DEVICE)
            for i in range(16)}
    record = LastPublished(1, base)
    record.encode_next(base)  # learns the sums (one full pass), as the bench's warm-up does
    for zeros in (0.99, 0.999):
        new, positions = next_version(base, zeros, seed=int(zeros * 1000))
        serial = timed(lambda: record.encode_next(new, positions))
        threaded = timed(lambda: record.encode_next(new, positions, ENCODE_POOL.map))
        derived = timed(lambda: record.encode_next(new))
        encoded, stats = record.encode_next(new, positions)
        print(f"== {zeros:.1%} zeros, {stats.changed} changes: encode {serial * 1e3:.1f} ms on "
              f"one thread, {threaded * 1e3:.1f} ms on two, {derived * 1e3:.1f} ms comparing "
              f"on the device (no positions given)", flush=True)
        held = {name: t.clone() for name, t in base.items()}

        def apply_and_undo() -> None:
            for name, item in encoded.items():
                decode_with_torch(item, held[name], inplace=True, base_sum=item.base_sum)
                undo_delta(item, held[name])

        print(f"   apply where the copy is held (and undo): {timed(apply_and_undo) * 1e3 / 2:.1f}"
              f" ms per apply of all 16 tensors", flush=True)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            record.encode_next(new, positions)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18,
                                        max_name_column_width=40), flush=True)


if __name__ == "__main__":
    main()
