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

from rlharvest.common import registry, rpc  # noqa: E402
from rlharvest.common.observability import run_service  # noqa: E402
from rlharvest.common.pb import common_pb2, rollout_worker_pb2 as pb  # noqa: E402
from rlharvest.common.pb import rollout_worker_pb2_grpc  # noqa: E402

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["RolloutWorker"].full_name


class _Request:
    __slots__ = ("request_id", "position", "max_tokens")

    def __init__(self, request_id: str, position: int, max_tokens: int):
        self.request_id = request_id
        self.position = position
        self.max_tokens = max_tokens


class SyntheticWorker(rollout_worker_pb2_grpc.RolloutWorkerServicer):
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.tokens = [i % 100 + 1 for i in range(args.tokens_per_delta)]  # ids < the tiny vocab

    async def Session(self, commands, context):
        running: dict[str, _Request] = {}
        queued: dict[str, _Request] = {}
        wake = asyncio.Event()
        aborted: list[str] = []

        async def read() -> None:
            async for command in commands:
                if command.HasField("add"):
                    add = command.add
                    queued[add.request_id] = _Request(add.request_id, len(add.generated_token_ids),
                                                      add.sampling.max_tokens)
                else:
                    for rid in command.abort.request_ids:
                        if running.pop(rid, None) or queued.pop(rid, None):
                            aborted.append(rid)
                wake.set()

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
                step += 1
                out = pb.StepOutputs(step=step)
                deltas = out.deltas
                stamp = [time.time() - base]
                for rid in aborted:
                    deltas.add(request_id=rid, finished=True, finish_reason="abort",
                               weight_version=version)
                aborted.clear()
                finished = []
                for req in running.values():
                    n = min(len(tokens), req.max_tokens - req.position)
                    done = req.position + n >= req.max_tokens
                    deltas.add(request_id=req.request_id, position=req.position,
                               token_ids=tokens[:n], logprobs=stamp * n, weight_version=version,
                               finished=done, finish_reason="length" if done else "")
                    req.position += n
                    if done:
                        finished.append(req.request_id)
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
                elif step % 8 == 0:
                    await asyncio.sleep(0)  # let the reader take new commands
        finally:
            reader.cancel()

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
            "endpoint": f"127.0.0.1:{server.port}", "kind": "dedicated",
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
    parser.add_argument("--weight-version", type=int, default=0)
    parser.add_argument("--time-base", type=float, default=0.0)
    parser.add_argument("--no-register", dest="register", action="store_false")
    args = parser.parse_args()
    run_service(lambda stop: serve(args, stop))


if __name__ == "__main__":
    main()
