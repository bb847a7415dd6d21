"""Benchmark harness (not product code): a synthetic rollout worker for bench/manager_relay.py,
and the Session handling every synthetic worker shares (bench/manager_scale_workers.py hosts
many of them per process).

It implements the RolloutWorker Session RPC and registers in etcd like a real worker, but has no
model: for the requests it is given it emits StepOutputs as fast as it can (or one step every
``--step-interval-s``), ``--tokens-per-delta`` tokens per request per step, with the step's
stats (batch size, time since the previous step, tokens) as a real worker reports them. Each
delta's logprobs carry the emission time (seconds since ``--time-base``, float32: ~2 µs
resolution over a minute) so a client can measure delivery latency through the manager or
directly.

    python bench/manager_relay_worker.py --etcd HOST:PORT --worker-id w0 --port P [--capacity 64]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlharvest.common import delta_batch, registry, rpc  # noqa: E402
from rlharvest.common.observability import run_service  # noqa: E402
from rlharvest.common.pb import common_pb2, rollout_worker_pb2 as pb  # noqa: E402
from rlharvest.common.pb import rollout_worker_pb2_grpc  # noqa: E402

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["RolloutWorker"].full_name


@dataclass
class SessionSpec:
    """What one synthetic worker is. ``step_s(batch)``: how long its next engine step takes
    (None: step again as soon as the commands already here are taken, the relay's full rate);
    ``length(request_id, max_tokens)``: where a request stops (it ends "stop" before its cap).
    A request's length must depend on its id only, so a migrated request ends where it would
    have on its first worker."""

    worker_id: str
    capacity: int
    weight_version: int = 0
    token_ids: tuple[int, ...] = (1,)  # emitted per request per step (ids < the tiny vocab)
    time_base: float = 0.0
    admit_quiet_s: float = 0.0
    step_s: Callable[[int], float] | None = None
    length: Callable[[str, int], int] = lambda _request_id, max_tokens: max_tokens


class _Request:
    __slots__ = ("request_id", "position", "max_tokens", "handle")

    def __init__(self, request_id: str, position: int, max_tokens: int, handle: int):
        self.request_id = request_id
        self.position = position
        self.max_tokens = max_tokens
        self.handle = handle


class SyntheticWorker(rollout_worker_pb2_grpc.RolloutWorkerServicer):
    def __init__(self, spec: SessionSpec):
        self.spec = spec
        # Wall times of the AddRequests that carried generated tokens (a migration, a lost
        # worker's request), by request id: when a request ran again here.
        self.resumed_at: dict[str, list[float]] = {}

    async def Session(self, commands, context):
        spec = self.spec
        running: dict[str, _Request] = {}
        queued: dict[str, _Request] = {}
        wake = asyncio.Event()
        aborted: list[int] = []  # handles
        received = [0]
        rows_sent = [0]
        last_add = [0.0]

        async def read() -> None:
            async for command in commands:
                received[0] += 1
                if command.HasField("add"):
                    last_add[0] = time.perf_counter()
                    add = command.add
                    if add.generated_token_ids:
                        self.resumed_at.setdefault(add.request_id, []).append(time.time())
                    cap = spec.length(add.request_id, add.sampling.max_tokens)
                    queued[add.request_id] = _Request(add.request_id, len(add.generated_token_ids),
                                                      cap, add.handle)
                else:
                    for rid in command.abort.request_ids:
                        req = running.pop(rid, None) or queued.pop(rid, None)
                        if req is not None:
                            aborted.append(req.handle)
                wake.set()

        reader = asyncio.create_task(read())
        version, step = spec.weight_version, 0
        stepped_at = time.perf_counter()
        try:
            yield pb.WorkerEvent(load=common_pb2.Load(weight_version=version))
            while True:
                while queued and len(running) < spec.capacity:
                    rid = next(iter(queued))
                    running[rid] = queued.pop(rid)
                if not running and not aborted:
                    wake.clear()
                    await wake.wait()
                    continue
                if time.perf_counter() - last_add[0] < spec.admit_quiet_s:
                    # Adds are still coming: a real engine's step takes milliseconds, in which
                    # a manager's burst of adds all arrive; stepping at this harness's rate with
                    # a part of them would measure the ramp, not the relay.
                    await asyncio.sleep(spec.admit_quiet_s)
                    continue
                if spec.step_s is not None:  # the engine step's time, before its tokens
                    await asyncio.sleep(spec.step_s(len(running)))
                step += 1
                rows_sent[0] += len(running) + len(aborted)
                out, finished = self._step(step, running, aborted)
                now = time.perf_counter()
                out.stats.duration_s = now - stepped_at
                stepped_at = now
                for rid in finished:
                    del running[rid]
                out.load.executing = len(running)
                out.load.pending = len(queued)
                yield pb.WorkerEvent(step=out)
                if spec.step_s is None:
                    # Let the reader take every command already here, as a real worker admits
                    # all pending adds between engine steps (one sleep(0) lets it take one).
                    before = -1
                    while before != received[0]:
                        before = received[0]
                        await asyncio.sleep(0)
        finally:
            reader.cancel()
            print(f"session of {spec.worker_id}: {step} steps, {rows_sent[0]} rows",
                  file=sys.stderr, flush=True)

    def _step(self, step: int, running: dict[str, _Request],
              aborted: list[int]) -> tuple[pb.StepOutputs, list[str]]:
        """One engine step's outputs: a delta per running request (stamped with the emission
        time), an abort row per aborted handle; and the requests it finished."""
        spec, tokens = self.spec, self.spec.token_ids
        out = pb.StepOutputs(step=step)
        rows = delta_batch.RowsBuilder(spec.weight_version)
        stamp = [time.time() - spec.time_base]
        for handle in aborted:
            rows.add(handle, 0, (), (), "abort")
        aborted.clear()
        finished = []
        for req in running.values():
            n = min(len(tokens), req.max_tokens - req.position)
            done = req.position + n >= req.max_tokens
            rows.add(req.handle, req.position, tokens[:n], stamp * n, "length" if done else "")
            req.position += n
            if done:
                finished.append(req.request_id)
        delta_batch.encode(rows.build(), out.batch)
        out.batch.job = "default"  # the manager's job: it drops another job's batches
        out.stats.batch_size = len(running)
        out.stats.decode_tokens = len(running) * len(tokens)
        out.load.weight_version = spec.weight_version
        out.load.tokens_per_second = 1e6
        return out, finished

    async def GetInfo(self, request, context):
        return pb.WorkerInfo(worker_id=self.spec.worker_id, capacity=self.spec.capacity,
                             weight_version=self.spec.weight_version)


def member_record(endpoint: str, spec: SessionSpec) -> dict[str, Any]:
    """The etcd record a dedicated worker of the default job registers."""
    return {"endpoint": endpoint, "kind": "dedicated", "job": "default",
            "capacity": spec.capacity, "max_len": 1 << 20,
            "weight_version": spec.weight_version, "draining": False}


async def start_worker(spec: SessionSpec, port: int = 0) -> tuple[SyntheticWorker, Any]:
    """A synthetic worker serving its own gRPC server (the manager dials one endpoint per
    worker id: the Session carries no worker id)."""
    worker = SyntheticWorker(spec)
    server = await rpc.start_server(
        [lambda s: rollout_worker_pb2_grpc.add_RolloutWorkerServicer_to_server(worker, s)],
        [SERVICE_NAME], "127.0.0.1", port, 64 * 1024 * 1024)
    return worker, server


async def serve(args: argparse.Namespace, stop: asyncio.Event) -> None:
    interval = args.step_interval_s
    spec = SessionSpec(args.worker_id, args.capacity, args.weight_version,
                       tuple(i % 100 + 1 for i in range(args.tokens_per_delta)), args.time_base,
                       args.admit_quiet_s, (lambda _batch: interval) if interval else None)
    _, server = await start_worker(spec, args.port)
    etcd = await registry.connect(args.etcd)
    membership = None
    if args.register:
        membership = await registry.register(
            etcd, "rollout_worker", args.worker_id,
            member_record(f"127.0.0.1:{server.port}", spec), ttl=5)
    await stop.wait()
    await server.stop(0)
    if membership is not None:
        await membership.close()
    await etcd.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--etcd", required=True)
    parser.add_argument("--worker-id", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--capacity", type=int, default=64)
    parser.add_argument("--tokens-per-delta", type=int, default=1)
    parser.add_argument("--step-interval-s", type=float, default=0.0)
    parser.add_argument("--admit-quiet-s", type=float, default=0.002,
                        help="step only once no add came for this long")
    parser.add_argument("--weight-version", type=int, default=0)
    parser.add_argument("--time-base", type=float, default=0.0)
    parser.add_argument("--no-register", dest="register", action="store_false")
    args = parser.parse_args()
    run_service(lambda stop: serve(args, stop))


if __name__ == "__main__":
    main()
