"""vLLM workers against torch workers on one checkpoint: token delivery over the
worker's Session stream, and whole rollout steps through a manager.

1. **Delivery.** A vLLM worker process (`--engine vllm`) and a torch worker process serve the
   same requests over real gRPC; the same VllmEngine runs them in this process too. Prints the
   vLLM worker's tokens/s over the in-process VllmEngine's (what the worker adds to vLLM) and
   over the torch worker's. Interleaved rounds; medians and spreads.
2. **A rollout step.** Two jobs, each with its own manager: `vllm` on two vLLM workers, `torch`
   on two torch workers, the same step (requests, lengths, seeds) submitted to each in turn.
   Prints the torch job's step time over the vLLM job's (> 1: vLLM faster).

The model is a `small` Qwen3 checkpoint built here (vLLM's CPU attention needs head_dim >= 32).

    python bench/vllm_workers.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from rlharvest.common.engine_types import EngineRequest, SamplingParams  # noqa: E402
from rlharvest.models.hf_checkpoint import build_checkpoint  # noqa: E402
from rlharvest.common.local_etcd import free_port  # noqa: E402
from rlharvest.cli.launcher import LocalStack  # noqa: E402
from rlharvest.services.rollout_worker.vllm_engine import VllmEngine, vllm_missing  # noqa: E402
from rlharvest.sim.ratios import spread  # noqa: E402
from tests.integration.worker_client import WorkerHandle, launch_worker, wait_serving  # noqa: E402

from bench.manager_preemption import run_step, step_request, wait_healthy  # noqa: E402
from bench.worker_delivery import PROMPT, over_grpc  # noqa: E402
from results_file import results_path  # noqa: E402


def in_process(engine: VllmEngine, batch: int, tokens: int) -> float:
    for i in range(batch):
        engine.add(EngineRequest(f"local{time.monotonic_ns()}-{i}", list(PROMPT),
                                 SamplingParams(max_tokens=tokens, seed=i)))
    start, produced = time.perf_counter(), 0
    while engine.has_work():
        produced += sum(len(o.new_token_ids) for o in engine.step())
    return produced / (time.perf_counter() - start)


VLLM = ["--engine", "vllm", "--kv-cache-gib", "0.5"]


def start(stack: LocalStack, specs: list[tuple[str, list[str]]]) -> list[WorkerHandle]:
    """Workers started together (their imports overlap), then awaited."""
    handles = [launch_worker(stack, name, *flags) for name, flags in specs]
    for handle in handles:
        wait_serving(handle, 300)
    return handles


def delivery(stack: LocalStack, ckpt: str, args: argparse.Namespace) -> list[str]:
    flags = ["--model", ckpt, "--max-running", str(args.batch), "--max-len",
             str(len(PROMPT) + args.tokens + 8), "--log-level", "warning"]
    vllm_worker, torch_worker = start(stack, [("d-vllm", [*flags, *VLLM]), ("d-torch", flags)])
    engine = VllmEngine(ckpt, max_len=len(PROMPT) + args.tokens + 8, max_running=args.batch,
                        kv_cache_gib=0.5)
    for w in (vllm_worker, torch_worker):
        asyncio.run(over_grpc(w.endpoint, args.batch, 8))  # warm-up
    in_process(engine, args.batch, 8)
    local, remote, torch_remote = [], [], []
    for _ in range(args.repeats):  # interleaved: the machine's noise falls on all alike
        local.append(in_process(engine, args.batch, args.tokens))
        remote.append(asyncio.run(over_grpc(vllm_worker.endpoint, args.batch, args.tokens))[0])
        torch_remote.append(asyncio.run(over_grpc(torch_worker.endpoint, args.batch,
                                                  args.tokens))[0])
    engine.close()
    vllm_worker.process.kill()
    torch_worker.process.kill()
    return [f"Delivery: batch {args.batch}, {args.tokens} tokens each, {args.repeats} "
            "interleaved rounds.", "",
            f"- in-process VllmEngine {statistics.median(local):.0f} tok/s; vLLM worker over "
            f"gRPC {statistics.median(remote):.0f} tok/s; torch worker over gRPC "
            f"{statistics.median(torch_remote):.0f} tok/s",
            f"- vLLM worker / in-process VllmEngine: "
            f"{spread([r / loc for r, loc in zip(remote, local)], 3)}",
            f"- vLLM worker / torch worker: "
            f"{spread([r / t for r, t in zip(remote, torch_remote)], 3)}"]


def steps(stack: LocalStack, ckpt: str, args: argparse.Namespace) -> list[str]:
    flags = ["--model", ckpt, "--max-running", "16", "--max-len", "160", "--log-level",
             "warning"]
    managers = {}
    for job in ("vllm", "torch"):
        port = free_port()
        stack.start("rollout_manager", f"manager-{job}", [
            "--manager-id", f"manager-{job}", "--job", job, "--port", str(port),
            "--log-level", "warning"])
        managers[job] = f"127.0.0.1:{port}"
    start(stack, [(f"{job}-{i}", [*flags, "--job", job, *(VLLM if job == "vllm" else [])])
                  for job in ("vllm", "torch") for i in range(2)])
    for endpoint in managers.values():
        asyncio.run(wait_healthy(endpoint, 2))
    lengths = [args.step_tokens] * args.step_requests
    times: dict[str, list[float]] = {"vllm": [], "torch": []}
    for r in range(args.repeats + 1):  # the first round warms both up and is not counted
        order = ("vllm", "torch") if r % 2 == 0 else ("torch", "vllm")
        for job in order:
            seconds = asyncio.run(run_step(managers[job], step_request(f"{job}{r}-", lengths),
                                           None, lambda: None))
            if r:
                times[job].append(seconds)
    ratios = [t / v for t, v in zip(times["torch"], times["vllm"])]
    return [f"A rollout step: {args.step_requests} requests x {args.step_tokens} tokens "
            f"through a manager onto 2 workers, {args.repeats} interleaved rounds after a "
            "warm-up.", "",
            f"- vLLM job {statistics.median(times['vllm']):.2f} s, torch job "
            f"{statistics.median(times['torch']):.2f} s (medians)",
            f"- torch step time / vLLM step time: {spread(ratios, 3)}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--step-requests", type=int, default=64)
    parser.add_argument("--step-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if (missing := vllm_missing()):
        sys.exit(missing)
    if args.quick:
        args.tokens, args.step_requests, args.step_tokens, args.repeats = 32, 16, 32, 1
    root = Path(tempfile.mkdtemp(prefix="rlh-bench-vllm-"))
    ckpt = str(build_checkpoint(root / "small", size="small"))
    stack = LocalStack(root / "logs")
    stack.start_etcd()
    try:
        lines = delivery(stack, ckpt, args)
        lines += ["", *steps(stack, ckpt, args)]
    finally:
        stack.stop()
    print("\n".join(lines))
    command = "python bench/vllm_workers.py " + " ".join(sys.argv[1:])
    out = results_path("vllm_workers", args.quick)
    out.write_text("\n".join(["# vllm_workers", "", f"`{command}`", "", *lines]) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
