"""Token delivery over the worker's gRPC Session stream vs the same engine in-process.

Both sides run the same requests (same model, batch, seeds, lengths) on a TorchEngine with the
same thread count; the gRPC side adds a real worker process, protobuf encoding and loopback
transport. Prints tokens/s of each and the ratio (issue target: >= 0.9). A second worker with
``--keep-requests-s 0`` runs interleaved too: what recording every request's tokens for a
successor manager (the default) costs delivery. A third runs its engine in a process of its own
(``--engine-process``, vLLM v1's engine-core split), also interleaved.

    python bench/worker_delivery.py [--quick] [--batch 32] [--tokens 128]
           [--device cuda --dtype bfloat16 --model qwen3-0.6b]   # on a GPU node
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlharvest.common.engine_device import resolve  # noqa: E402
from rlharvest.models.tokenizer import CharTokenizer  # noqa: E402
from rlharvest.cli.launcher import LocalStack  # noqa: E402
from rlharvest.common.engine_types import EngineRequest, SamplingParams  # noqa: E402
from rlharvest.services.rollout_worker.torch_engine import TorchEngine  # noqa: E402
from rlharvest.sim.ratios import spread  # noqa: E402
from tests.integration.worker_client import WorkerSession, start_worker  # noqa: E402
from tests.worker_sessions import add  # noqa: E402

PROMPT = CharTokenizer().encode("Compute 12+34*2=")


def in_process(model: str, batch: int, tokens: int, threads: int, device: str = "cpu",
               dtype: str = "float32") -> tuple[float, int]:
    torch.set_num_threads(threads)
    where, kind = resolve(device, dtype)
    engine = TorchEngine(model=model, max_running=batch, max_len=len(PROMPT) + tokens + 8,
                         device=where, dtype=kind)
    for i in range(batch):
        engine.add(EngineRequest(f"r{i}", list(PROMPT), SamplingParams(max_tokens=tokens, seed=i)))
    produced = 0
    start = time.perf_counter()
    while engine.has_work():
        produced += sum(len(o.new_token_ids) for o in engine.step())
    return produced / (time.perf_counter() - start), produced


_RUNS = iter(range(1 << 30))


class CpuShares:
    """CPU seconds per wall second of a worker's processes (its own and its engine child's)
    and of this client, over one run: where a round's time went on a small machine."""

    def __init__(self, worker_pid: int) -> None:
        worker = psutil.Process(worker_pid)
        # The engine's process is the spawned child (multiprocessing's resource tracker is
        # another child, idle).
        engines = []
        for child in worker.children():
            with contextlib.suppress(psutil.Error):
                if "spawn_main" in " ".join(child.cmdline()):
                    engines.append(child)
        self._procs = [worker, *engines]
        self.shares: dict[str, list[float]] = {}

    def measure(self, run):  # run: a zero-argument callable returning the run's result
        before = [p.cpu_times() for p in self._procs], time.process_time(), time.perf_counter()
        result = run()
        wall = time.perf_counter() - before[2]
        names = ["gRPC process", *["engine process"] * (len(self._procs) - 1)]
        for name, proc, then in zip(names, self._procs, before[0]):
            now = proc.cpu_times()
            self._add(name, (now.user + now.system - then.user - then.system) / wall)
        self._add("client", (time.process_time() - before[1]) / wall)
        return result

    def _add(self, name: str, share: float) -> None:
        self.shares.setdefault(name, []).append(share)

    def summary(self) -> str:
        return ", ".join(f"{name} {statistics.median(v):.2f}" for name, v in self.shares.items())


async def over_grpc(endpoint: str, batch: int, tokens: int) -> tuple[float, int]:
    session = WorkerSession(endpoint)
    try:
        # Ids of their own each run: a worker keeps a closed session's requests for a successor
        # manager, and an add repeating one (same id, prompt and seed) gets its tokens back.
        run = next(_RUNS)
        ids = [f"g{run}-{i}" for i in range(batch)]
        start = time.perf_counter()
        await session.send(*(add(r, list(PROMPT), max_tokens=tokens, seed=i)
                             for i, r in enumerate(ids)))
        got = await session.finish(ids, timeout=600)
        elapsed = time.perf_counter() - start
        produced = sum(len(c.tokens) for c in got.completions.values())
        return produced / elapsed, produced
    finally:
        await session.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    engine_flags = ("--model", args.model, "--torch-threads", str(args.threads),
                    "--device", args.device, "--dtype", args.dtype, "--log-level", "warning")
    if args.quick:
        args.tokens, args.repeats = 48, 1

    stack = LocalStack(Path(tempfile.mkdtemp(prefix="rlh-bench-")))
    stack.start_etcd()
    try:
        worker = start_worker(stack, "bench-worker", "--max-running", str(args.batch),
                              "--max-len", str(len(PROMPT) + args.tokens + 8), *engine_flags)
        unkept = start_worker(stack, "bench-worker-unkept", "--max-running", str(args.batch),
                              "--max-len", str(len(PROMPT) + args.tokens + 8), *engine_flags,
                              "--keep-requests-s", "0")
        # The engine in a process of its own, the gRPC process keeping a proxy.
        split = start_worker(stack, "bench-worker-split", "--max-running", str(args.batch),
                             "--max-len", str(len(PROMPT) + args.tokens + 8), *engine_flags,
                             "--engine-process")
        for w in (worker, unkept, split):
            asyncio.run(over_grpc(w.endpoint, args.batch, 8))  # warm-up
        in_process(args.model, args.batch, 8, args.threads, args.device, args.dtype)
        local, remote, plain, apart = [], [], [], []
        cpu = CpuShares(split.process.process.pid)
        for _ in range(args.repeats):  # interleave so machine noise hits both sides alike
            local.append(in_process(args.model, args.batch, args.tokens, args.threads,
                                    args.device, args.dtype)[0])
            remote.append(asyncio.run(over_grpc(worker.endpoint, args.batch, args.tokens))[0])
            plain.append(asyncio.run(over_grpc(unkept.endpoint, args.batch, args.tokens))[0])
            apart.append(cpu.measure(lambda: asyncio.run(
                over_grpc(split.endpoint, args.batch, args.tokens)))[0])
    finally:
        stack.stop()
    keeping = sorted(k / p for k, p in zip(remote, plain))
    ratios = sorted(r / loc for r, loc in zip(remote, local))
    print(f"model={args.model} batch={args.batch} tokens/request={args.tokens} "
          f"threads={args.threads} repeats={args.repeats} device={args.device} "
          f"dtype={args.dtype}")
    print(f"in-process engine : {statistics.median(local):10.0f} tokens/s (median)")
    print(f"gRPC Session      : {statistics.median(remote):10.0f} tokens/s (median)")
    print(f"ratio gRPC / in-process = {statistics.median(ratios):.3f} "
          f"[{ratios[0]:.3f}-{ratios[-1]:.3f}] over {len(ratios)} interleaved rounds "
          "(target >= 0.9)")
    print(f"keeping tokens for a successor / not: median {statistics.median(keeping):.3f} "
          f"[{keeping[0]:.3f}-{keeping[-1]:.3f}] over {len(keeping)} interleaved rounds")
    print(f"engine in its own process (--engine-process): {statistics.median(apart):.0f} "
          f"tokens/s; / in-process {spread([a / loc for a, loc in zip(apart, local)], 3)}, "
          f"/ one-process gRPC {spread([a / r for a, r in zip(apart, remote)], 3)}")
    print(f"  its CPU per wall second (median over its runs): {cpu.summary()}")

if __name__ == "__main__":
    main()
