"""Weight data path over loopback: the agent's dense pull vs a raw-socket send of the same bytes,
with the candidate transports (grpc.aio streaming, aiohttp chunked HTTP, raw asyncio streams)
measured side by side — the measurement the data path was chosen by.

Every server is a separate process; the receiver is this process and writes into preallocated
buffers, as a worker would. Rows:
  raw socket        sendall / recv_into, one TCP connection (the baseline)
  asyncio streams   StreamWriter.write / readexactly
  aiohttp           chunked HTTP response, iter_chunked into a buffer
  grpc.aio          server stream of 16 MB bytes messages
  agent pull        the transfer agent: PlanPull (gRPC) + byte ranges of the buckets over 4
                    parallel HTTP connections into preallocated buffers + one CRC per bucket
  agent pull, 1     the same over one connection
  agent pull, gRPC  the same bytes over the gRPC PullBuckets stream (the previous data path)
  agent pull+decode HTTP, plus per-tensor decode and checksum (what a worker waits for)

    python bench/transfer_data_path.py           # 512 MB
    python bench/transfer_data_path.py --quick   # 96 MB, < 30 s
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import time

import grpc
import torch

from rlharvest.common.local_etcd import free_port

sys.path.insert(0, os.path.dirname(__file__))
from rlharvest.sim.ratios import spread  # noqa: E402
from transfer_harness import local_stack, start_agent, write_results  # noqa: E402

CHUNK = 16 << 20
SERVICE = "bench.Bytes"


def payload(nbytes: int) -> bytes:
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)).numpy().tobytes()


# ---- servers (run as child processes: python transfer_data_path.py --serve KIND PORT BYTES) ----

def serve(kind: str, port: int, nbytes: int) -> None:
    data = payload(nbytes)
    view = memoryview(data)
    if kind == "socket":
        srv = socket.create_server(("127.0.0.1", port))
        while True:
            conn, _ = srv.accept()
            with conn:
                try:
                    if conn.recv(1):  # readiness probes connect and close without asking
                        conn.sendall(view)
                except OSError:
                    pass
    elif kind == "asyncio":
        async def handle(reader, writer):
            await reader.readexactly(1)
            for i in range(0, nbytes, CHUNK):
                writer.write(view[i:i + CHUNK])
                await writer.drain()
            writer.close()

        async def main():
            server = await asyncio.start_server(handle, "127.0.0.1", port)
            await server.serve_forever()
        asyncio.run(main())
    elif kind == "aiohttp":
        from aiohttp import web

        async def get(request):
            resp = web.StreamResponse()
            resp.content_length = nbytes
            await resp.prepare(request)
            for i in range(0, nbytes, CHUNK):
                await resp.write(view[i:i + CHUNK])
            return resp
        app = web.Application()
        app.router.add_get("/", get)
        web.run_app(app, host="127.0.0.1", port=port, print=None)
    elif kind == "grpc":
        async def stream(request, context):
            for i in range(0, nbytes, CHUNK):
                yield bytes(view[i:i + CHUNK])

        async def main():
            server = grpc.aio.server(options=[("grpc.max_send_message_length", 64 << 20)])
            handler = grpc.method_handlers_generic_handler(SERVICE, {
                "Get": grpc.unary_stream_rpc_method_handler(stream, request_deserializer=None,
                                                            response_serializer=None)})
            server.add_generic_rpc_handlers((handler,))
            server.add_insecure_port(f"127.0.0.1:{port}")
            await server.start()
            await server.wait_for_termination()
        asyncio.run(main())


# ---- receivers ---------------------------------------------------------------------------

def recv_socket(port: int, nbytes: int) -> None:
    buf = bytearray(nbytes)
    view = memoryview(buf)
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.sendall(b"x")
        got = 0
        while got < nbytes:
            n = conn.recv_into(view[got:])
            if not n:
                raise ConnectionError("short read")
            got += n


async def recv_asyncio(port: int, nbytes: int) -> None:
    buf = bytearray(nbytes)
    reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=CHUNK)
    writer.write(b"x")
    got = 0
    while got < nbytes:
        data = await reader.read(CHUNK)
        if not data:
            raise ConnectionError("short read")
        buf[got:got + len(data)] = data
        got += len(data)
    writer.close()


async def recv_aiohttp(port: int, nbytes: int) -> None:
    import aiohttp
    buf = bytearray(nbytes)
    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://127.0.0.1:{port}/") as resp:
            got = 0
            async for data in resp.content.iter_chunked(CHUNK):
                buf[got:got + len(data)] = data
                got += len(data)
    assert got == nbytes


async def recv_grpc(port: int, nbytes: int) -> None:
    buf = bytearray(nbytes)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}",
                                         options=[("grpc.max_receive_message_length", 64 << 20)]) as chan:
        call = chan.unary_stream(f"/{SERVICE}/Get", request_serializer=None,
                                 response_deserializer=None)(b"")
        got = 0
        async for data in call:
            buf[got:got + len(data)] = data
            got += len(data)
    assert got == nbytes


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def start_server(kind: str, nbytes: int) -> tuple[subprocess.Popen, int]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, __file__, "--serve", kind, str(port), str(nbytes)])
    for _ in range(600):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.05)
    time.sleep(0.2)
    return proc, port


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--serve", nargs=3, metavar=("KIND", "PORT", "BYTES"))
    parser.add_argument("--rounds", type=int, default=0)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve[0], int(args.serve[1]), int(args.serve[2]))
        return
    mb = 96 if args.quick else 512
    nbytes = mb << 20
    rounds = args.rounds or (2 if args.quick else 3)
    from rlharvest.services.transfer_agent.client import publish, pull
    servers = {kind: start_server(kind, nbytes) for kind in ("socket", "asyncio", "aiohttp", "grpc")}
    stack = local_stack()
    times: dict[str, list[float]] = {}
    try:
        ports = {kind: port for kind, (_, port) in servers.items()}
        endpoint, _ = start_agent(stack, "bench-agent", "--memory-budget-bytes", str(4 * nbytes))
        # A model-like version: 64 tensors of bf16.
        n = nbytes // 2 // 64
        tensors = {f"model.layers.{i}.mlp.up_proj.weight": torch.randn(n).to(torch.bfloat16)
                   for i in range(64)}
        asyncio.run(publish(endpoint, "bench", 1, tensors))
        asyncio.run(pull(endpoint, "bench", version=1, decode=False))  # warm: encode + pack cache
        paths = {
            "socket": lambda: recv_socket(ports["socket"], nbytes),
            "asyncio": lambda: asyncio.run(recv_asyncio(ports["asyncio"], nbytes)),
            "aiohttp": lambda: asyncio.run(recv_aiohttp(ports["aiohttp"], nbytes)),
            "grpc": lambda: asyncio.run(recv_grpc(ports["grpc"], nbytes)),
            "agent": lambda: asyncio.run(pull(endpoint, "bench", version=1, decode=False)),
            "agent-1": lambda: asyncio.run(pull(endpoint, "bench", version=1, decode=False,
                                                streams=1)),
            "agent-grpc": lambda: asyncio.run(pull(endpoint, "bench", version=1, decode=False,
                                                   transport="grpc")),
            "agent+decode": lambda: asyncio.run(pull(endpoint, "bench", version=1))}
        times = {key: [] for key in paths}
        for round_ in range(rounds):  # every path once per round, the order rotating
            keys = list(paths)[round_ % len(paths):] + list(paths)[:round_ % len(paths)]
            for key in keys:
                times[key].append(timed(paths[key]))
    finally:
        stack.stop()
        for proc, _ in servers.values():
            proc.kill()
            proc.wait()

    base = times["socket"]
    names = {"socket": "raw socket (baseline)", "asyncio": "asyncio streams", "aiohttp": "aiohttp",
             "grpc": "grpc.aio stream (16 MB msgs)",
             "agent": "agent pull: HTTP ranges, 4 streams (transport + bucket CRC)",
             "agent-1": "agent pull: HTTP ranges, 1 stream",
             "agent-grpc": "agent pull: gRPC PullBuckets stream (previous path)",
             "agent+decode": "agent pull + decode + tensor CRC"}
    lines = ["# transfer_data_path: dense pull over loopback vs raw socket\n",
             f"`python bench/transfer_data_path.py{' --quick' if args.quick else ''}` — {mb} MB, "
             f"{rounds} rounds, every path once per round (order rotating); servers in separate "
             f"processes; {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} (shared "
             "box).\n",
             "| path | seconds (median) | GB/s | vs raw socket, per round: median [spread] |",
             "|---|---|---|---|"]
    for key, seconds in times.items():
        median = statistics.median(seconds)
        lines.append(f"| {names[key]} | {median:.3f} | {nbytes / median / 1e9:.2f} | "
                     f"{spread([b / t for b, t in zip(base, seconds)])} |")
    lines.append(f"\nagent pull (HTTP, 4 streams) vs raw socket: "
                 f"{spread([b / t for b, t in zip(base, times['agent'])])}; vs the previous "
                 f"gRPC data path: "
                 f"{spread([g / t for g, t in zip(times['agent-grpc'], times['agent'])])}")
    write_results("transfer_data_path", "\n".join(lines) + "\n", args.quick)


if __name__ == "__main__":
    main()
