"""Benchmark harness (not product code): a synthetic rollout worker for bench/manager_relay.py.

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
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlharvest.common import delta_batch, registry, rpc  # noqa: E402
from rlharvest.common.observability import run_service  # noqa: E402
from rlharvest.common.pb import common_pb2, rollout_worker_pb2 as pb  # noqa: E402
from rlharvest.common.pb import rollout_worker_pb2_grpc  # noqa: E402

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["RolloutWorker"].full_name


class _Request:
    __slots__ = ("request_id", "position", "max_tokens", "handle")

    def __init__(self, request_id: str, position: int, max_tokens: int, handle: int):
        self.request_id = request_id
        self.position = position
        self.max_tokens = max_tokens
        self.handle = handle


class SyntheticWorker(rollout_worker_pb2_grpc.RolloutWorkerServicer):
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.tokens = [i % 100 + 1 for i in range(args.tokens_per_delta)]  # ids < the tiny vocab

    async def Session(self, commands, context):
        running: dict[str, _Request] = {}
        queued: dict[str, _Request] = {}
        wake = asyncio.Event()
        aborted: list[int] = []  # handles

        received = [0]
        rows_sent = [0]

        async def read() -> None:
            async for command in commands:
                received[0] += 1
                if command.HasField("add"):
                    last_add[0] = time.perf_counter()
                    add = command.add
                    queued[add.request_id] = _Request(add.request_id, len(add.generated_token_ids),
                                                      add.sampling.max_tokens, add.handle)
                else:
                    for rid in command.abort.request_ids:
                        req = running.pop(rid, None) or queued.pop(rid, None)
                        if req is not None:
                            aborted.append(req.handle)
                wake.set()

        last_add = [0.0]
        reader = asyncio.create_task(read())
        args, version, step = self.args, self.args.weight_version, 0
        base, tokens = args.time_base, self.tokens
        stepped_at = time.perf_counter()
        try:
            yield pb.WorkerEvent(load=common_pb2.Load(weight_version=version))
            while True:
                while queued and len(running) < args.capacity:
                    rid = next(iter(queued))
                    running[rid] = queued.pop(rid)
                if not running and not aborted:
                    wake.clear()
                    await wake.wait()
                    continue
                if time.perf_counter() - last_add[0] < args.admit_quiet_s:
                    # Adds are still coming: a real engine's step takes milliseconds, in which
                    # a manager's burst of adds all arrive; stepping at this harness's rate with
                    # a part of them would measure the ramp, not the relay.
                    await asyncio.sleep(args.admit_quiet_s)
                    continue
                step += 1
                out = pb.StepOutputs(step=step)
                rows = delta_batch.RowsBuilder(version)
                stamp = [time.time() - base]
                for handle in aborted:
                    rows.add(handle, 0, (), (), "abort")
                aborted.clear()
                finished = []
                for req in running.values():
                    n = min(len(tokens), req.max_tokens - req.position)
                    done = req.position + n >= req.max_tokens
                    rows.add(req.handle, req.position, tokens[:n], stamp * n,
                             "length" if done else "")
                    req.position += n
                    if done:
                        finished.append(req.request_id)
                rows_sent[0] += len(rows)
                delta_batch.encode(rows.build(), out.batch)
                out.batch.job = "default"  # the manager's job: it drops another job's batches
                now = time.perf_counter()
                out.stats.batch_size = len(running)
                out.stats.duration_s = now - stepped_at
                out.stats.decode_tokens = len(running) * len(tokens)
                stepped_at = now
                for rid in finished:
                    del running[rid]
                out.load.executing = len(running)
                out.load.pending = len(queued)
                out.load.weight_version = version
                out.load.tokens_per_second = 1e6
                yield pb.WorkerEvent(step=out)
                if args.step_interval_s:
                    await asyncio.sleep(args.step_interval_s)
                else:
                    # Let the reader take every command already here, as a real worker admits
                    # all pending adds between engine steps (one sleep(0) lets it take one).
                    before = -1
                    while before != received[0]:
                        before = received[0]
                        await asyncio.sleep(0)
        finally:
            reader.cancel()
            print(f"session: {step} steps, {rows_sent[0]} rows", file=sys.stderr, flush=True)

    async def GetInfo(self, request, context):
        return pb.WorkerInfo(worker_id=self.args.worker_id, capacity=self.args.capacity,
                             weight_version=self.args.weight_version)


async def serve(args: argparse.Namespace, stop: asyncio.Event) -> None:
    worker = SyntheticWorker(args)
    server = await rpc.start_server(
        [lambda s: rollout_worker_pb2_grpc.add_RolloutWorkerServicer_to_server(worker, s)],
        [SERVICE_NAME], "127.0.0.1", args.port, 64 * 1024 * 1024)
    etcd = await registry.connect(args.etcd)
    membership = None
    if args.register:
        membership = await registry.register(etcd, "rollout_worker", args.worker_id, {
            "endpoint": f"127.0.0.1:{server.port}", "kind": "dedicated", "job": "default",
            "capacity": args.capacity, "max_len": 1 << 20,
            "weight_version": args.weight_version, "draining": False}, ttl=5)
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
