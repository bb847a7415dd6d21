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
           [--managers 1,2] # the manager split into shards (sharding.py): each count a job of
                            # its own (own etcd, the same workers), rounds interleaved

With ``--managers``, each step goes through the trainer's client (JobStepStream; fanned out over
the shards), and the table compares the counts by round: tokens per wall second, tokens per
manager CPU-second summed over the processes, the client's CPU per token, and the added p99.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlharvest.common import delta_batch, rpc  # noqa: E402
from rlharvest.common.local_etcd import free_port, stop_processes  # noqa: E402
from rlharvest.common.pb import common_pb2, rollout_manager_pb2 as mpb  # noqa: E402
from rlharvest.common.pb import rollout_manager_pb2_grpc, rollout_worker_pb2 as wpb  # noqa: E402
from rlharvest.common.pb import rollout_worker_pb2_grpc  # noqa: E402
from rlharvest.cli.launcher import LocalStack  # noqa: E402
from rlharvest.common import registry  # noqa: E402
from rlharvest.services.rollout_manager.client import (  # noqa: E402
    RolloutStreamError, healthy_workers, locate_manager, wait_workers)
from rlharvest.services.rollout_manager.shard_client import JobStepStream  # noqa: E402
from rlharvest.services.rollout_manager.sharding import shard_of  # noqa: E402
from tests.integration.worker_client import WorkerHandle, wait_serving  # noqa: E402

HARNESS = Path(__file__).resolve().parent / "manager_relay_worker.py"
RESULTS = Path(__file__).resolve().parent / "results" / "manager_relay.md"
SHARD_RESULTS = RESULTS.with_name("manager_relay_shards.md")
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
                  extra: Sequence[str] = RELAY_FLAGS,
                  shard: tuple[int, int] = (0, 1)) -> tuple[subprocess.Popen, str]:
    port = free_port()
    assert stack.etcd is not None, "start the stack's etcd first"
    index, shards = shard
    sharding = [] if shards == 1 else ["--shards", str(shards), "--shard-index", str(index),
                                       "--manager-id", f"manager-{index}"]
    flags = [*sharding, "--etcd", stack.etcd.endpoint, "--port", str(port),
             "--log-level", "warning", "--max-new-tokens", "1000000",
             "--stall-timeout-s", "60", *extra]
    module = ["-m", "rlharvest.services.rollout_manager.main"]
    prefix = ["-m", "cProfile", "-o", str(profile_to)] if profile_to else []
    log = open(stack.log_dir / f"manager-{index}.log", "ab")
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
    parser.add_argument("--managers", default="1", help="manager process counts to compare, "
                        "e.g. 1,2 (one shard each, sharding.py)")
    args = parser.parse_args()
    if args.quick:
        args.tokens = 512
    counts = [int(c) for c in args.managers.split(",")]
    if counts != [1]:
        shard_main(args, counts)
        return
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
        stop_processes(procs)  # SIGTERM: the profiled manager writes its profile on exit
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


# ---- the manager split into shards: 1 vs N processes -------------------------------------------


def shard_ids(prefix: str, count: int, shards: int) -> list[str]:
    """``count`` worker ids spread evenly over the shards (crc32(id) mod shards)."""
    per = [[] for _ in range(shards)]  # type: list[list[str]]
    i = 0
    while sum(map(len, per)) < count:
        wid = f"{prefix}{i}"
        i += 1
        bucket = per[shard_of(wid, shards)]
        if len(bucket) < -(-count // shards):
            bucket.append(wid)
    return [w for bucket in per for w in bucket][:count]


class Deployment:
    """One job whose manager is ``shards`` processes, on an etcd of its own, with the bench's
    synthetic workers spread over the shards."""

    def __init__(self, shards: int, args) -> None:
        self.shards = shards
        self.stack = LocalStack(Path(tempfile.mkdtemp(prefix=f"rlh-relay-{shards}-")))
        self.stack.start_etcd()
        self.procs: list[subprocess.Popen] = []
        full = [start_harness(self.stack, w, FULL_RATE, args, 0.0)
                for w in shard_ids("full", args.workers, shards)]
        self.paced = [start_harness(self.stack, w, PACED, args, args.paced_interval_s)
                      for w in shard_ids("paced", max(2, shards), shards)]
        managers = [start_manager(self.stack, None, shard=(i, shards))
                    for i in range(shards)]
        self.managers = [p for p, _ in managers]
        self.procs += [p for p, _ in full + self.paced] + self.managers
        self.workers = len(full) + len(self.paced)
        for proc, endpoint in managers:
            wait_serving(WorkerHandle(_Alive(proc), endpoint, 0), 60)
        asyncio.run(self._wait_workers([e for _, e in managers]))

    async def _wait_workers(self, endpoints: list[str]) -> None:
        """Until every worker joined its shard (a step splits by the shards' capacities)."""
        deadline = time.monotonic() + 240
        while True:
            statuses = [await wait_workers(e, 1, timeout=240) for e in endpoints]
            if sum(len(healthy_workers(s)) for s in statuses) == self.workers:
                return
            assert time.monotonic() < deadline, "workers did not join their shards"
            await asyncio.sleep(0.2)

    def cpu(self) -> float:
        return sum(cpu_seconds(p.pid) for p in self.managers)

    async def step(self, request: mpb.SubmitStepRequest, tally: Tally) -> None:
        assert self.stack.etcd is not None  # started in __init__
        etcd = await registry.connect(self.stack.etcd.endpoint)
        try:
            stream = JobStepStream(etcd, "default", await locate_manager(etcd, "default"),
                                   max_message_bytes=1 << 30, resume_wait_s=0.0)
            await stream.run(request, tally)
        finally:
            await etcd.close()

    def stop(self) -> None:
        stop_processes(self.procs)
        self.stack.stop()


class Tally:
    """The client's reader: tokens by completion, events, and (paced) each row's latency."""

    def __init__(self, latencies: list[float] | None = None) -> None:
        self.tokens = self.events = 0
        self.latencies = latencies

    def take(self, event: mpb.StepEvent, request_ids: list[str]) -> None:
        self.events += 1
        if self.latencies is not None:
            latencies_of(event.batch, time.time(), self.latencies)
        for c in event.completions:
            assert not c.failed, c.finish_reason
            self.tokens += len(c.token_ids)

    def resume(self, of: mpb.SubmitStepRequest | None = None) -> mpb.SubmitStepRequest:
        raise RolloutStreamError("a manager of the bench died; see its log")

    def failed_over(self, successor) -> None:
        raise AssertionError("no failover in the bench")


def sharded_throughput(dep: Deployment, request: mpb.SubmitStepRequest) -> dict:
    tally = Tally()
    cpu0, client0, start = dep.cpu(), time.process_time(), time.perf_counter()
    asyncio.run(dep.step(request, tally))
    wall = time.perf_counter() - start
    return {"tokens": tally.tokens, "wall": wall, "cpu": dep.cpu() - cpu0,
            "client_cpu": time.process_time() - client0, "events": tally.events}


def sharded_added_p99(dep: Deployment, args, k: int) -> float:
    """Added p99 delivery latency through the shards and the client's merge vs a client
    reading one paced worker's own stream, in the same round."""
    length = 200 if args.quick else 500
    through: list[float] = []
    asyncio.run(dep.step(step(f"lat{k}-", args.capacity, length, PACED), Tally(through)))
    alone = asyncio.run(direct_latency(dep.paced[0][1], step(f"dlat{k}-", args.capacity,
                                                             length, PACED)))
    return pct(through, 99) - pct(alone, 99)


def shard_main(args, counts: list[int]) -> None:
    requests = args.workers * args.capacity
    rounds = args.repeats or (1 if args.quick else 3)
    deps: dict[int, Deployment] = {}
    runs: dict[int, list[dict]] = {c: [] for c in counts}
    added: dict[int, list[float]] = {c: [] for c in counts}
    try:
        for c in counts:
            deps[c] = Deployment(c, args)
            sharded_throughput(deps[c], step("warm", requests, 64, FULL_RATE))
        for k in range(rounds):  # interleaved: every count once a round
            for c in counts:
                runs[c].append(sharded_throughput(deps[c], step(f"t{k}-", requests, args.tokens,
                                                                FULL_RATE)))
                added[c].append(sharded_added_p99(deps[c], args, k))
    finally:
        for dep in deps.values():
            dep.stop()
    lines = shard_table(args, counts, runs, added)
    print("\n".join(lines))
    if not args.no_write and not args.quick:
        SHARD_RESULTS.write_text(
            "# Rollout manager relay: one manager vs its shards\n\n"
            f"`python bench/manager_relay.py --managers {args.managers} --workers {args.workers} "
            f"--capacity {args.capacity} --tokens-per-delta {args.tokens_per_delta}`\n\n"
            + "\n".join(lines) + "\n")


def _spread(values: list[float], fmt: str) -> str:
    return f"{format(statistics.median(values), fmt)} [{format(min(values), fmt)} – " \
           f"{format(max(values), fmt)}]"


def shard_table(args, counts: list[int], runs: dict[int, list[dict]],
                added: dict[int, list[float]]) -> list[str]:
    base = counts[0]
    lines = [
        f"{args.workers} synthetic workers x {args.capacity} requests, {args.tokens} tokens "
        f"each, spread over the shards; each count a job of its own, {len(runs[base])} "
        f"interleaved rounds (median [spread]); machine: {os.cpu_count()} cores shared by the "
        "managers, the workers, the client (and other work on the box)",
        "",
        "| managers | tokens / wall s | tokens / manager CPU-s (summed) | relay capacity "
        "(CPU-s rate x managers) | client CPU µs / token | added p99 ms |",
        "| --- | --- | --- | --- | --- | --- |"]
    for c in counts:
        wall = [r["tokens"] / r["wall"] for r in runs[c]]
        per_cpu = [r["tokens"] / r["cpu"] for r in runs[c]]
        capacity = [c * r["tokens"] / r["cpu"] for r in runs[c]]
        client = [1e6 * r["client_cpu"] / r["tokens"] for r in runs[c]]
        lines.append(f"| {c} | {_spread(wall, ',.0f')} | {_spread(per_cpu, ',.0f')} | "
                     f"{_spread(capacity, ',.0f')} | {_spread(client, '.2f')} | "
                     f"{_spread(added[c], '.2f')} |")
    lines.append("")
    for c in counts[1:]:
        wall = [b["tokens"] / b["wall"] / (a["tokens"] / a["wall"])
                for a, b in zip(runs[base], runs[c])]
        cap = [(c * b["tokens"] / b["cpu"]) / (base * a["tokens"] / a["cpu"])
               for a, b in zip(runs[base], runs[c])]
        lines.append(f"ratio {c} vs {base} managers, per round: relay capacity "
                     f"{_spread(cap, '.2f')} (linear: {c / base:.2f}); tokens per wall second "
                     f"{_spread(wall, '.2f')} (bounded by this box's cores)")
    return lines


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
