"""`rlharvest`: run a whole local stack (`up`) and look at a running one (`status`)."""

from __future__ import annotations

import asyncio
import signal
import tempfile
import time
from pathlib import Path
from typing import Optional

import grpc
import typer
from rich.console import Console
from rich.table import Table

from rlharvest.common import registry, rpc
from rlharvest.common.pb import rollout_worker_pb2, rollout_worker_pb2_grpc
from rlharvest.services.launcher import LocalStack

app = typer.Typer(add_completion=False, help=__doc__, no_args_is_help=True)
console = Console()


@app.command()
def up(workers: int = typer.Option(3, min=0, help="dedicated rollout workers"),
       spot: int = typer.Option(0, min=0, help="spot rollout workers"),
       model: str = typer.Option("tiny", help="model preset or local checkpoint directory"),
       log_dir: Optional[Path] = typer.Option(None, help="where service logs go (default: a temp dir)"),
       ready_timeout: float = typer.Option(120.0, help="seconds to wait for every member")) -> None:
    """Start etcd and the services as local processes; Ctrl-C stops them all cleanly."""
    stack = LocalStack(log_dir or Path(tempfile.mkdtemp(prefix="rlharvest-")))
    endpoint = stack.start_etcd()
    try:
        for i in range(workers + spot):
            kind = "dedicated" if i < workers else "spot"
            stack.start("rollout_worker", f"worker-{i}",
                        ["--worker-id", f"worker-{i}", "--kind", kind, "--model", model])
        expected = workers + spot
        asyncio.run(_wait_members(endpoint, expected, ready_timeout, stack))
        console.print(f"[bold green]rlharvest is up[/]: etcd at {endpoint}, {expected} rollout "
                      f"workers, logs in {stack.log_dir}")
        console.print(f"  rlharvest status --etcd {endpoint}")
        _wait_for_signal()
    finally:
        console.print("stopping...")
        stack.stop()
        console.print("stopped")


async def _wait_members(endpoint: str, expected: int, timeout: float, stack: LocalStack) -> None:
    etcd = await registry.connect(endpoint)
    try:
        deadline = time.monotonic() + timeout
        while len(await registry.list_members(etcd)) < expected:
            dead = [p.name for p in stack.processes if not p.alive()]
            if dead:
                raise typer.BadParameter(f"{', '.join(dead)} exited; see logs in {stack.log_dir}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"not all {expected} members registered within {timeout}s")
            await asyncio.sleep(0.2)
    finally:
        await etcd.close()


def _wait_for_signal() -> None:
    got = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda s, _f: got.append(s))
    while not got:
        time.sleep(0.2)


@app.command()
def status(etcd: str = typer.Option("127.0.0.1:2379", help="etcd host:port"),
           timeout: float = typer.Option(2.0, help="seconds to wait for each member's answer")) -> None:
    """List registered members, their weight versions and load."""
    rows = asyncio.run(_collect(etcd, timeout))
    table = Table(title=f"rlharvest members (etcd {etcd})")
    for column in ("service", "member", "endpoint", "kind", "version", "pending", "executing",
                   "tokens/s", "state"):
        table.add_column(column)
    for row in rows:
        table.add_row(*row)
    console.print(table if rows else "no members registered")


async def _collect(endpoint: str, timeout: float) -> list[tuple[str, ...]]:
    client = await registry.connect(endpoint)
    try:
        members = await registry.list_members(client)
    finally:
        await client.close()
    rows = []
    for key, info in sorted(members.items()):
        service, member = key.rsplit("/", 2)[-2:]
        load = await _worker_load(info["endpoint"], timeout) if service == "rollout_worker" else None
        state = "draining" if info.get("draining") else "up"
        rows.append((service, member, info.get("endpoint", ""), info.get("kind", ""),
                     str(info.get("weight_version", "")),
                     str(load.pending) if load else "", str(load.executing) if load else "",
                     f"{load.tokens_per_second:.0f}" if load else "",
                     state if load or service != "rollout_worker" else "unreachable"))
    return rows


async def _worker_load(endpoint: str, timeout: float):
    async with rpc.channel(endpoint) as chan:
        try:
            info = await rollout_worker_pb2_grpc.RolloutWorkerStub(chan).GetInfo(
                rollout_worker_pb2.GetInfoRequest(), timeout=timeout)
            return info.load
        except grpc.aio.AioRpcError:
            return None


if __name__ == "__main__":
    app()
