"""Benchmark harness (not product code): one process hosting many synthetic rollout workers for
bench/manager_scale.py.

Each worker is a ``SyntheticWorker`` (manager_relay_worker.py: the real Session contract, no
model) with its own gRPC server and its own etcd registration, as a real worker has: the manager
dials one endpoint per worker id. Workers are paced by a step-time model, an engine step of a
batch of b requests taking ``a + b * per_request`` seconds, and a request stops at a length drawn
from a log-normal distribution (keyed by its id) capped at its max_tokens. Every token a worker
of this process emits has id ``--host-index + 1``, so a client can tell which process produced a
request's latest tokens (the kill-recovery measurement).

    python bench/manager_scale_workers.py --etcd HOST:PORT --host-index 0 --workers 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.manager_relay_worker import SessionSpec, member_record, start_worker  # noqa: E402
from rlharvest.common import registry  # noqa: E402
from rlharvest.common.observability import run_service  # noqa: E402


class LongTail:
    """Request lengths: log-normal with this median and sigma, capped at the request's max_tokens;
    drawn from the request id, so every worker a request visits agrees on where it ends."""

    def __init__(self, median: float, sigma: float, seed: int = 0):
        self.mu, self.sigma, self.seed = math.log(median), sigma, seed

    def __call__(self, request_id: str, max_tokens: int) -> int:
        rng = random.Random(zlib.crc32(f"{self.seed}:{request_id}".encode()))
        return max(1, min(max_tokens, round(rng.lognormvariate(self.mu, self.sigma))))


def step_time(a: float, per_request: float):
    return lambda batch: a + per_request * batch


def spec_of(args: argparse.Namespace, worker_id: str) -> SessionSpec:
    return SessionSpec(worker_id, args.capacity, 0, (args.host_index + 1,), args.time_base,
                       0.0, step_time(args.step_a_s, args.step_b_s),
                       LongTail(args.median_tokens, args.sigma, args.seed))


async def serve(args: argparse.Namespace, stop: asyncio.Event) -> None:
    etcd = await registry.connect(args.etcd)
    servers, members, workers = [], [], []
    for i in range(args.workers):
        worker_id = f"h{args.host_index}w{i}"
        spec = spec_of(args, worker_id)
        worker, server = await start_worker(spec)
        servers.append(server)
        workers.append(worker)
        members.append(await registry.register(
            etcd, "rollout_worker", worker_id, member_record(f"127.0.0.1:{server.port}", spec),
            ttl=args.lease_ttl))
    if args.direct_port:  # not registered: the direct-read latency baseline's worker
        _, server = await start_worker(spec_of(args, f"h{args.host_index}direct"),
                                       args.direct_port)
        servers.append(server)
    print(f"host {args.host_index}: {args.workers} workers registered", file=sys.stderr,
          flush=True)
    await stop.wait()
    await asyncio.gather(*(server.stop(0) for server in servers))
    if args.resumes_out:  # for the kill-recovery figure: when each request ran again here
        resumed: dict[str, list[float]] = {}
        for worker in workers:
            for request_id, times in worker.resumed_at.items():
                resumed.setdefault(request_id, []).extend(times)
        Path(args.resumes_out).write_text(json.dumps(resumed))
    await asyncio.gather(*(member.close() for member in members))
    await etcd.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--etcd", required=True)
    parser.add_argument("--host-index", type=int, required=True)
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--capacity", type=int, default=64)
    parser.add_argument("--step-a-s", type=float, default=0.02, help="engine step: a + b * batch")
    parser.add_argument("--step-b-s", type=float, default=0.00025)
    parser.add_argument("--median-tokens", type=float, default=64)
    parser.add_argument("--sigma", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--time-base", type=float, default=0.0)
    parser.add_argument("--lease-ttl", type=int, default=5)
    parser.add_argument("--direct-port", type=int, default=0)
    parser.add_argument("--resumes-out", default="", help="write, at exit, the wall times of "
                        "the resumed AddRequests each request id got (JSON)")
    args = parser.parse_args()
    run_service(lambda stop: serve(args, stop))


if __name__ == "__main__":
    main()
