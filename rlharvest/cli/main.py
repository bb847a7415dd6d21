"""`rlharvest`: run a whole local stack (`up`) and look at a running one (`status`); train your own
checkpoint on your own dataset (`train`), and build both locally (`build-checkpoint`,
`make-dataset`)."""

from __future__ import annotations

import asyncio

import grpc
import typer
from rich.console import Console
from rich.table import Table

from rlharvest.common import keys, registry, rpc
from rlharvest.common.pb import rollout_worker_pb2, rollout_worker_pb2_grpc
from rlharvest.models.hf_checkpoint import build_checkpoint_command
from rlharvest.common.config import ConfigError
from rlharvest.cli import status_view
from rlharvest.services.rollout_manager.client import manager_status
from rlharvest.services.rollout_manager.tp_accounting import parse_plan_record
from rlharvest.cli.train_command import train
from rlharvest.cli.up_command import configure_tls, up
from rlharvest.cli.etcd_maintain_command import etcd_maintain_command
from rlharvest.cli.etcd_roles_command import etcd_roles_command
from rlharvest.services.trainer.gsm8k import make_dataset

app = typer.Typer(add_completion=False, help=__doc__, no_args_is_help=True)
console = Console()
app.command("up")(up)
app.command("etcd-roles")(etcd_roles_command)
app.command("etcd-maintain")(etcd_maintain_command)
app.command("train")(train)
app.command("build-checkpoint")(build_checkpoint_command)
app.command("make-dataset")(make_dataset)


@app.command()
def status(etcd: str = typer.Option("127.0.0.1:2379", help="etcd host:port "
                                    "(https://host:port: over TLS with --tls-*)"),
           timeout: float = typer.Option(2.0, help="seconds to wait for each member's answer"),
           watch: bool = typer.Option(False, "--watch", help="a live view, refreshed every "
                                      "--interval until Ctrl-C: members, weight versions, worker "
                                      "load, the trainer's step in progress and recent steps"),
           interval: float = typer.Option(1.0, min=0.05, help="seconds between refreshes "
                                          "(with --watch)"),
           max_refreshes: int = typer.Option(0, min=0, help="with --watch: stop after this many "
                                             "refreshes (0: until Ctrl-C); exits 1 when etcd "
                                             "did not answer the last one"),
           last_steps: int = typer.Option(5, min=1, help="with --watch: finished steps shown "
                                          "per trainer"),
           tls_cert: str = typer.Option("", help="a stack with mutual TLS: this client's "
                                        "certificate (e.g. LOG_DIR/pki/... of `up --tls`)"),
           tls_key: str = typer.Option("", help="its private key"),
           tls_ca: str = typer.Option("", help="the stack's CA"),
           etcd_username: str = typer.Option("", envvar="RLH_ETCD_USERNAME",
                                             help="etcd user, when etcd's auth is enabled"),
           etcd_password: str = typer.Option("", envvar="RLH_ETCD_PASSWORD",
                                             help="its password (best from the environment)")
           ) -> None:
    """List registered members, their weight versions and load (--watch: live)."""
    configure_tls(tls_cert, tls_key, tls_ca)  # every status call dials with it, etcd too
    try:
        registry.check_endpoint(etcd)  # an https etcd without --tls-*: say so, before dialing
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--etcd") from None
    registry.use_credentials(etcd_username, etcd_password)
    if watch:
        last = asyncio.run(status_view.watch(etcd, console, interval=interval, timeout=timeout,
                                             last_steps=last_steps,
                                             max_refreshes=max_refreshes))
        if last is not None and last.etcd_error:
            raise typer.Exit(1)
        return
    try:
        rows = asyncio.run(_collect(etcd, timeout))
    except (ConnectionError, ConfigError) as exc:  # unreachable, or refused our credentials
        console.print(f"[red]rlharvest status:[/] {exc}; is the stack up (`rlharvest up`)?")
        raise typer.Exit(1) from None
    table = Table(title=f"rlharvest members (etcd {etcd})")
    for column in ("service", "member", "endpoint", "kind", "version", "pending", "executing",
                   "tokens/s", "state"):
        table.add_column(column)
    for row in rows:
        table.add_row(*row)
    console.print(table if rows else "no members registered")
    managers = asyncio.run(_collect_managers(etcd, timeout))
    if managers:
        table = Table(title="rollout managers")
        for column in ("manager", "job", "workers", "in flight", "waiting", "tokens",
                       "migrations", "tokens regenerated", "completions", "failures",
                       "TP plan"):
            table.add_column(column)
        for row in managers:
            table.add_row(*row)
        console.print(table)


async def _collect(endpoint: str, timeout: float) -> list[tuple[str, ...]]:
    client = await registry.connect(endpoint)
    try:
        members = await registry.list_members(client)
    finally:
        await client.close()
    rows: list[tuple[str, ...]] = []
    for key, info in sorted(members.items()):
        service, member = key.rsplit("/", 2)[-2:]
        worker_like = service in ("rollout_worker", "coexecutor")  # the same Session contract
        load = await _worker_load(info["endpoint"], timeout) if worker_like else None
        # A manager or scheduler says whether it leads or stands by.
        state = "draining" if info.get("draining") else str(info.get("role") or "up")
        if service == "coexecutor" and not info.get("draining"):
            state = f"lent to {info['job']}" if info.get("job") else "not lent"
        rows.append((service, member, info.get("endpoint", ""), info.get("kind", ""),
                     str(info.get("weight_version", "")),
                     str(load.pending) if load else "", str(load.executing) if load else "",
                     f"{load.tokens_per_second:.0f}" if load else "",
                     state if load or not worker_like else "unreachable"))
    return rows


async def _collect_managers(endpoint: str, timeout: float) -> list[tuple[str, ...]]:
    client = await registry.connect(endpoint)
    try:
        members = await registry.list_members(client, "rollout_manager")
        plans = {job: await _tp_plan(client, job)
                 for job in {str(info.get("job", "")) for info in members.values()}}
    finally:
        await client.close()
    rows = []
    for key, info in sorted(members.items()):
        st = await manager_status(info["endpoint"], timeout)
        name = key.rsplit("/", 1)[-1]
        plan = plans.get(str(info.get("job", "")), "")
        if st is None:
            rows.append((name, info.get("job", ""), "unreachable", *[""] * 7, plan))
            continue
        healthy = sum(w.state == "healthy" for w in st.workers)
        rows.append((name, info.get("job", ""), f"{healthy}/{len(st.workers)}", str(st.in_flight),
                     str(st.waiting), str(st.tokens_generated), str(st.migrations),
                     str(st.tokens_regenerated), str(st.completions), str(st.failures), plan))
    return rows


async def _tp_plan(client, job: str) -> str:
    """The job's advisory TP plan (a manager with --tp-planner writes it), as "short 1 / long
    2"; "" when there is none."""
    if not job or "/" in job:
        return ""
    found = await client.get(keys.tp_plan_key(job).encode())
    try:
        record = parse_plan_record(None if found is None else found.value)
    except ValueError:
        return "malformed"
    return "" if record is None else f"short {record.plan.short_tp} / long {record.plan.long_tp}"


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
