"""Measures the torch engine's step cost and fits the agentic simulator's model to it.

``rlharvest/sim/agentic.py`` prices an engine step as ``decode_s + per_request_s * batch +
prefill_token_s * prefill_tokens``. Its defaults are a guess at a GPU; this tool replaces the
guess with a measurement on the device it runs on:

- decode: the median step wall time at several batch sizes, every request decoding with a
  history of ``--context`` tokens, fitted by least squares to ``decode_s + per_request_s * b``;
- prefill: the wall time of a step that prefills one fresh prompt of P tokens (and decodes
  nothing else), fitted to ``a + prefill_token_s * P``.

It prints the fit and the simulator command that uses it. On a lent GPU node:

    python3 tools/step_costs.py --preset qwen3-8b --device cuda --dtype bfloat16

and here (CPU, a small preset, to check the tool): ``python tools/step_costs.py --preset tiny``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlharvest.common.engine_types import EngineRequest, SamplingParams  # noqa: E402
from rlharvest.services.rollout_worker.torch_engine import TorchEngine  # noqa: E402


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _prompt(length: int, salt: int) -> list[int]:
    return [1] + [5 + (salt * 31 + j * 7) % 90 for j in range(length - 1)]


def _request(rid: str, length: int, salt: int, new_tokens: int) -> EngineRequest:
    return EngineRequest(rid, _prompt(length, salt),
                         SamplingParams(temperature=1.0, max_tokens=new_tokens, seed=salt))


def timed_step(engine: TorchEngine, device: str) -> float:
    _sync(device)
    started = time.perf_counter()
    engine.step()
    _sync(device)
    return time.perf_counter() - started


def decode_times(args: argparse.Namespace) -> dict[int, float]:
    """Median decode step per batch size, histories of ``--context`` tokens."""
    out = {}
    for batch in args.batches:
        engine = TorchEngine(args.preset, device=args.device, dtype=args.torch_dtype,
                             max_running=batch, max_len=args.context + args.steps + 16)
        for i in range(batch):
            engine.add(_request(f"d{i}", args.context, i, args.steps + 8))
        engine.step()  # prefills them all
        for _ in range(3):
            engine.step()  # warm
        out[batch] = statistics.median(timed_step(engine, args.device)
                                       for _ in range(args.steps))
        del engine
    return out


def prefill_times(args: argparse.Namespace) -> dict[int, float]:
    """Median wall time of a step that prefills one fresh prompt of each length."""
    longest = max(args.prefills)
    engine = TorchEngine(args.preset, device=args.device, dtype=args.torch_dtype,
                         max_running=1, max_len=longest + 16, prefill_token_budget=longest)
    out, salt = {}, 1000
    for length in [args.prefills[0], *args.prefills]:  # the first one warms
        walls = []
        for _ in range(args.repeats):
            salt += 1
            engine.add(_request(f"p{salt}", length, salt, 8))
            walls.append(timed_step(engine, args.device))
            engine.abort(f"p{salt}")
        out[length] = statistics.median(walls)
    return out


def fit(points: dict[int, float]) -> tuple[float, float]:
    """Least squares ``y = a + b x`` with both costs >= 0: (a, b). A negative slope (a
    launch-bound step, whose time does not grow with the batch) is fitted flat (b = 0, a = the
    mean); a negative intercept, through the origin (a = 0)."""
    xs, ys = list(points), list(points.values())
    slope, intercept = statistics.linear_regression(xs, ys)
    if slope < 0:
        return statistics.fmean(ys), 0.0
    if intercept < 0:
        return 0.0, sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)
    return intercept, slope


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 16, 32])
    parser.add_argument("--context", type=int, default=1200,
                        help="history tokens of every decoding request")
    parser.add_argument("--prefills", type=int, nargs="+", default=[256, 512, 1024, 2048])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    args.torch_dtype = getattr(torch, args.dtype)
    started = time.perf_counter()
    decode = decode_times(args)
    prefill = prefill_times(args)
    decode_s, per_request_s = fit(decode)
    _, prefill_token_s = fit(prefill)
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(json.dumps({"preset": args.preset, "device": device, "dtype": args.dtype,
                      "decode_step_s": decode, "prefill_step_s": prefill,
                      "decode_s": decode_s, "per_request_s": per_request_s,
                      "prefill_token_s": prefill_token_s,
                      "took_s": round(time.perf_counter() - started, 1)}, indent=1))
    print(f"python3 -m rlharvest.sim.agentic --decode-s {decode_s:.5f} "
          f"--per-request-s {per_request_s:.6f} --prefill-token-s {prefill_token_s:.7f}")


if __name__ == "__main__":
    main()
