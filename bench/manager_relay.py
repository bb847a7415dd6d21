"""Relay capacity of one rollout manager: tokens/s it carries from many workers to one client.

Synthetic workers (bench/manager_relay_worker.py: the RolloutWorker Session RPC, no model) emit
StepOutputs as fast as they can; one real manager process (`rlharvest-rollout-manager`) tracks
every token and streams them to one SubmitStep client. Reported:

* throughput: tokens delivered per wall second, and per second of the manager's own CPU time
  (the "one core" figure, which the machine's other processes cannot inflate or deflate);
* latency: at a paced load, per-delta delivery latency (worker emission -> client) through the
  manager vs a client reading a worker's Session stream directly (the baseline): the added p99.

    python bench/manager_relay.py [--quick] [--workers 4] [--capacity 256] [--tokens-per-delta 1]
           [--profile]      # also run the manager under cProfile and print its top functions
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pstats
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlharvest.common import delta_batch, rpc  # noqa: E402
from rlharvest.common.local_etcd import free_port  # noqa: E402
from rlharvest.common.pb import common_pb2, rollout_manager_pb2 as mpb  # noqa: E402
from rlharvest.common.pb import rollout_manager_pb2_grpc, rollout_worker_pb2 as wpb  # noqa: E402
from rlharvest.common.pb import rollout_worker_pb2_grpc  # noqa: E402
from rlharvest.cli.launcher import LocalStack  # noqa: E402
from rlharvest.services.rollout_manager.client import wait_workers  # noqa: E402
from tests.integration.worker_client import WorkerHandle, wait_serving  # noqa: E402

HARNESS = Path(__file__).resolve().parent / "manager_relay_worker.py"
RESULTS = Path(__file__).resolve().parent / "results" / "manager_relay.md"
FULL_RATE, PACED = 0, 1  # weight versions: the manager routes each step to one set of workers
TIME_BASE = time.time()


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_harness(stack: LocalStack, worker_id: str, version: int, args,
                  interval: float) -> tuple[subprocess.Popen, str]:
    port = free_port()
    assert stack.etcd is not None, "start the stack's etcd first"
    log = open(stack.log_dir / f"{worker_id}.log", "ab")
    proc = subprocess.Popen(
        [sys.executable, str(HARNESS), "--etcd", stack.etcd.endpoint, "--worker-id", worker_id,
         "--port", str(port), "--capacity", str(args.capacity), "--weight-version", str(version),
         "--tokens-per-delta", str(args.tokens_per_delta), "--step-interval-s", str(interval),
         "--time-base", repr(TIME_BASE)],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, f"127.0.0.1:{port}"


# Every request on a worker at once: full engine batches, the relay's case (Algorithm 2 would cap
# a synthetic worker, whose steps cost per row, at a few requests).
RELAY_FLAGS = ("--balancer", "jsq")


def start_manager(stack: LocalStack, profile_to: Path | None,
                  extra: Sequence[str] = RELAY_FLAGS) -> tuple[subprocess.Popen, str]:
    port = free_port()
    assert stack.etcd is not None, "start the stack's etcd first"
    flags = ["--etcd", stack.etcd.endpoint, "--port", str(port), "--log-level", "warning",
             "--max-new-tokens", "1000000", "--stall-timeout-s", "60", *extra]
    module = ["-m", "rlharvest.services.rollout_manager.main"]
    prefix = ["-m", "cProfile", "-o", str(profile_to)] if profile_to else []
    log = open(stack.log_dir / "manager.log", "ab")
    proc = subprocess.Popen([sys.executable, *prefix, *module, *flags], stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return proc, f"127.0.0.1:{port}"


def step(prefix: str, requests: int, tokens: int, version: int) -> mpb.SubmitStepRequest:
    return mpb.SubmitStepRequest(step_id=prefix, weight_version=version, requests=[
        mpb.RolloutRequest(request_id=f"{prefix}{i}", group_id="g", prompt_token_ids=[1, 2, 3],
                           sampling=common_pb2.SamplingParams(max_tokens=tokens))
        for i in range(requests)])


async def relay_throughput(endpoint: str, request: mpb.SubmitStepRequest, pid: int) -> dict:
    async with rpc.channel(endpoint) as chan:
        stub = rollout_manager_pb2_grpc.RolloutManagerStub(chan)
        cpu0, start = cpu_seconds(pid), time.perf_counter()
        tokens = events = 0
        async for event in stub.SubmitStep(request, timeout=600):
            events += 1
            for c in event.completions:  # deltas were counted by the completion they add up to
                assert not c.failed, c.finish_reason
                tokens += len(c.token_ids)
        wall, cpu = time.perf_counter() - start, cpu_seconds(pid) - cpu0
    return {"tokens": tokens, "wall": wall, "cpu": cpu, "events": events}


def latencies_of(batch: common_pb2.DeltaBatch, now: float, into: list[float]) -> None:
    """Each row's first logprob is its emission time (manager_relay_worker.py)."""
    rows = delta_batch.decode(batch)
    grew = rows.counts > 0
    stamps = rows.logprobs[rows.starts()[grew]]
    into.extend((now - (TIME_BASE + stamps.astype(float))).tolist())


async def relay_latency(endpoint: str, request: mpb.SubmitStepRequest) -> list[float]:
    out: list[float] = []
    async with rpc.channel(endpoint) as chan:
        async for event in rollout_manager_pb2_grpc.RolloutManagerStub(chan).SubmitStep(
                request, timeout=600):
            latencies_of(event.batch, time.time(), out)
    return out


async def direct_latency(worker: str, request: mpb.SubmitStepRequest) -> list[float]:
    out: list[float] = []
    left = {r.request_id for r in request.requests}
    async with rpc.channel(worker) as chan:
        call = rollout_worker_pb2_grpc.RolloutWorkerStub(chan).Session()
        for handle, r in enumerate(request.requests):
            await call.write(wpb.WorkerCommand(add=wpb.AddRequest(
                request_id=r.request_id, prompt_token_ids=r.prompt_token_ids,
                sampling=r.sampling, weight_version=request.weight_version, handle=handle)))
        while left:
            event = await call.read()
            if event.WhichOneof("event") != "step":
                continue
            latencies_of(event.step.batch, time.time(), out)
            rows = delta_batch.decode(event.step.batch)
            left -= {request.requests[int(rows.requests[r])].request_id for r in rows.ends}
        call.cancel()
    return out


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=1000)[int(q * 10) - 1] * 1000 if len(values) > 1 else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--workers", type=int, default=4)
    # Requests per worker, i.e. rows per step message: a GPU engine's decode batch (vLLM's
    # default max_num_seqs is 256). --capacity 64 is the small-batch case.
    parser.add_argument("--capacity", type=int, default=256)
    parser.add_argument("--tokens-per-delta", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per request")
    parser.add_argument("--paced-interval-s", type=float, default=0.01)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--repeats", type=int, default=0, help="measured steps (0: 3, quick 1)")
    parser.add_argument("--no-write", action="store_true", help="do not write bench/results")
    args = parser.parse_args()
    if args.quick:
        args.tokens = 512
    requests = args.workers * args.capacity

    stack = LocalStack(Path(tempfile.mkdtemp(prefix="rlh-relay-")))
    stack.start_etcd()
    procs: list[subprocess.Popen] = []
    profile_to = stack.log_dir / "manager.prof" if args.profile else None
    try:
        full = [start_harness(stack, f"full{i}", FULL_RATE, args, 0.0) for i in range(args.workers)]
        paced = [start_harness(stack, f"paced{i}", PACED, args, args.paced_interval_s)
                 for i in range(2)]
        manager, endpoint = start_manager(stack, profile_to)
        procs += [p for p, _ in full + paced] + [manager]
        wait_serving(WorkerHandle(_Alive(manager), endpoint, 0), 60)
        asyncio.run(wait_workers(endpoint, args.workers + 2, timeout=240))
        asyncio.run(relay_throughput(endpoint, step("warm", requests, 64, FULL_RATE), manager.pid))
        runs = [asyncio.run(relay_throughput(endpoint, step(f"t{k}-", requests, args.tokens,
                                                            FULL_RATE), manager.pid))
                for k in range(args.repeats or (1 if args.quick else 3))]
        relayed, direct, added = [], [], []
        for k in range(len(runs)):  # interleaved: through the manager, then direct
            length = 200 if args.quick else 500
            through = asyncio.run(relay_latency(endpoint, step(f"lat{k}-", args.capacity, length,
                                                               PACED)))
            alone = asyncio.run(direct_latency(paced[0][1], step(f"dlat{k}-", args.capacity,
                                                                 length, PACED)))
            relayed += through
            direct += alone
            added.append(pct(through, 99) - pct(alone, 99))
    finally:
        for proc in procs:  # SIGTERM: the profiled manager writes its profile on a clean exit
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        stack.stop()

    rates = sorted(r["tokens"] / r["cpu"] for r in runs)
    per_cpu = statistics.median(rates)
    best = min(runs, key=lambda r: abs(r["tokens"] / r["cpu"] - per_cpu))  # the median run
    per_wall = best["tokens"] / best["wall"]
    r50, r99, d50, d99 = pct(relayed, 50), pct(relayed, 99), pct(direct, 50), pct(direct, 99)
    lines = [
        f"{args.workers} synthetic workers x {args.capacity} requests, {args.tokens} tokens each, "
        f"{args.tokens_per_delta} token(s) per delta (one delta per request per worker step); "
        f"machine: {os.cpu_count()} cores shared with the harness and the client",
        "",
        "| measure | value |", "| --- | --- |",
        f"| tokens relayed per manager CPU-second (one core) | {per_cpu:,.0f} |",
        f"| same, spread over {len(rates)} steps | {rates[0]:,.0f} – {rates[-1]:,.0f} |",
        f"| tokens relayed per wall second | {per_wall:,.0f} |",
        f"| manager CPU share during the run | {best['cpu'] / best['wall']:.2f} cores |",
        f"| client events / step (coalesced) | {best['events']} for {best['tokens']:,} tokens |",
        f"| delivery latency p50 / p99, direct worker stream | {d50:.2f} / {d99:.2f} ms |",
        f"| delivery latency p50 / p99, through the manager | {r50:.2f} / {r99:.2f} ms |",
        f"| added p99 latency, per round: median [spread] | {statistics.median(added):.2f} ms "
        f"[{min(added):.2f} – {max(added):.2f}] |",
        "",
        f"ratio: one-core relay capacity / target 1,000,000 tokens/s = {per_cpu / 1e6:.2f} "
        f"[{rates[0] / 1e6:.2f}–{rates[-1] / 1e6:.2f}]",
    ]
    print("\n".join(lines))
    if profile_to is not None and profile_to.exists():
        print("\nmanager profile (top 25 by own time):")
        pstats.Stats(str(profile_to)).sort_stats("tottime").print_stats(25)
    if not args.no_write and not args.quick and not args.profile:
        RESULTS.write_text("# Rollout manager relay capacity\n\n"
                           f"`python bench/manager_relay.py "
                           f"--workers {args.workers} --capacity {args.capacity} "
                           f"--tokens-per-delta {args.tokens_per_delta}`\n\n"
                           + "\n".join(lines) + "\n")


class _Alive:
    """Adapts a Popen to what wait_serving expects of a ServiceProcess."""

    def __init__(self, proc: subprocess.Popen):
        self.process = proc

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self) -> str:
        return "(see the manager log in the bench's temp dir)"


if __name__ == "__main__":
    main()
