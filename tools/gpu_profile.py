"""Where a decode step of the torch engine spends its time on a GPU (run on a lent machine:
``python3 tools/gpu_profile.py``): per step, the wall time and the GPU's busy time, then
torch.profiler's top operators by host time and by device time. The fast paths start
from this."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlharvest.common.engine_types import EngineRequest, SamplingParams  # noqa: E402
from rlharvest.services.rollout_worker.torch_engine import TorchEngine  # noqa: E402


def engine_at(preset: str, batch: int, kv_pages: int) -> TorchEngine:
    engine = TorchEngine(preset, device="cuda", dtype=torch.bfloat16, max_running=batch,
                         max_len=512, kv_pages=kv_pages)
    for i in range(batch):
        engine.add(EngineRequest(f"r{i}", [1] + [5 + j % 90 for j in range(64)],
                                 SamplingParams(temperature=1.0, max_tokens=400, seed=i)))
    for _ in range(5):
        engine.step()
    return engine


def main() -> None:
    for preset, kv_pages in ((preset, kv) for preset in sys.argv[1:] or ["qwen3-8b"]
                             for kv in (0, 1024)):
        engine = engine_at(preset, 16, kv_pages)
        torch.cuda.synchronize()
        walls = []
        for _ in range(10):
            started = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - started)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                engine.step()
        events = prof.key_averages()
        device_us = sum(getattr(e, "self_device_time_total", 0) for e in events) / 3
        print(f"== {preset} {'paged' if kv_pages else 'slots'} batch 16: step wall median "
              f"{1000 * sorted(walls)[5]:.1f} ms, GPU busy {device_us / 1000:.1f} ms per step",
              flush=True)
        print(events.table(sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=40))
        try:
            print(events.table(sort_by="self_device_time_total", row_limit=12,
                               max_name_column_width=40), flush=True)
        except (KeyError, AttributeError, ValueError) as exc:
            print(f"(device-time table unavailable: {exc})")
        del engine
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
