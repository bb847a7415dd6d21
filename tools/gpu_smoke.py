"""GPU smoke check of the torch engine (run by ``tools/gpu_checks.sh`` on a lent GPU machine).

The same weights on the CPU and on CUDA (float32, slot and paged KV) generate the same tokens
for greedy and for seeded sampling (noise keyed by (seed, position), so device-independent);
prints the share of requests whose completions agree token for token, then the Qwen3-shaped
presets' load time and one decode step's time in bfloat16.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlharvest.common.engine_types import EngineRequest, SamplingParams  # noqa: E402
from rlharvest.services.rollout_worker.torch_engine import TorchEngine  # noqa: E402


def completions(engine: TorchEngine, temperature: float, n: int = 8) -> dict[str, list[int]]:
    for i in range(n):
        engine.add(EngineRequest(f"r{i}", [1] + [5 + (i * 7 + j) % 90 for j in range(12 + i)],
                                 SamplingParams(temperature=temperature, max_tokens=48, seed=i)))
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(n)}
    while engine.has_work():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    return out


def agreement(paged: bool) -> None:
    kw = dict(max_running=8, max_len=128, kv_pages=64 if paged else 0)
    cpu = TorchEngine("small", **kw)
    gpu = TorchEngine("small", device="cuda", **kw)
    gpu.load_weights(cpu.weights(), 0)
    for temperature in (0.0, 1.0):
        a, b = completions(cpu, temperature), completions(gpu, temperature)
        same = sum(a[k] == b[k] for k in a)
        tokens = sum(x == y for k in a for x, y in zip(a[k], b[k]))
        print(f"small float32 {'paged' if paged else 'slots'} T={temperature}: {same}/{len(a)} "
              f"completions identical on cuda and cpu, {tokens}/{sum(map(len, a.values()))} "
              "tokens", flush=True)


def preset_timing(preset: str, batch: int) -> None:
    started = time.perf_counter()
    engine = TorchEngine(preset, device="cuda", dtype=torch.bfloat16, max_running=batch,
                         max_len=256)
    torch.cuda.synchronize()
    loaded = time.perf_counter() - started
    for i in range(batch):
        engine.add(EngineRequest(f"r{i}", [1] + [5 + j % 90 for j in range(64)],
                                 SamplingParams(temperature=1.0, max_tokens=64, seed=i)))
    engine.step()  # prefill
    steps = []
    for _ in range(20):
        started = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - started)
    steps.sort()
    print(f"{preset} bfloat16: built on cuda in {loaded:.1f} s, "
          f"{torch.cuda.max_memory_allocated() / 2**30:.1f} GiB peak; decode step at batch "
          f"{batch}: median {1000 * steps[len(steps) // 2]:.1f} ms", flush=True)
    del engine
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def main() -> None:
    print(torch.__version__, torch.cuda.get_device_name(0), flush=True)
    agreement(paged=False)
    agreement(paged=True)
    for preset in ("qwen3-0.6b", "qwen3-8b"):
        preset_timing(preset, 16)


if __name__ == "__main__":
    main()
