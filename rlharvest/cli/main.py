"""`rlharvest`: run a whole local stack (`up`) and look at a running one (`status`); train your own
checkpoint on your own dataset (`train`), and build both locally (`build-checkpoint`,
`make-dataset`)."""

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

from rlharvest.common import keys, registry, rpc, tls
from rlharvest.common.pb import rollout_worker_pb2, rollout_worker_pb2_grpc
from rlharvest.models.hf_checkpoint import build_checkpoint, build_checkpoint_command
from rlharvest.common.config import ConfigError
from rlharvest.common.tls import LocalCA
from rlharvest.cli import status_view
from rlharvest.cli.prometheus_stack import LocalPrometheus, TlsFiles
from rlharvest.cli.launcher import LocalStack
from rlharvest.services.rollout_manager.client import manager_status
from rlharvest.services.rollout_manager.tp_accounting import parse_plan_record
from rlharvest.cli.spot_replay import SpotReplay, load_trace
from rlharvest.services.placement_scheduler.config import PlacementConfig
from rlharvest.services.placement_scheduler.control import slot_units
from rlharvest.services.placement_scheduler.model import Pool
from rlharvest.cli.train_command import train
from rlharvest.services.trainer.gsm8k import make_dataset

app = typer.Typer(add_completion=False, help=__doc__, no_args_is_help=True)
console = Console()
app.command("train")(train)
app.command("build-checkpoint")(build_checkpoint_command)
app.command("make-dataset")(make_dataset)


@app.command()
def up(workers: int = typer.Option(3, min=0, help="dedicated rollout workers"),
       spot: int = typer.Option(0, min=0, help="spot rollout workers"),
       coexecutors: int = typer.Option(0, min=0, help="serving co-executors (ROSE): an "
                                       "OpenAI-compatible API each; the job 'default' borrows "
                                       "them through etcd"),
       coexec_http_port: int = typer.Option(8000, min=1, max=65535, help="the first "
                                            "co-executor's HTTP port; the next ones count up"),
       model: str = typer.Option("tiny", help="model preset or local checkpoint directory"),
       engine: str = typer.Option("torch", help="the rollout workers' engine: torch, or vllm "
                                  "(vLLM v1, which loads checkpoint directories: a preset "
                                  "--model, `small` or larger, is built into one first)"),
       manager: bool = typer.Option(True, "--manager/--no-manager",
                                    help="start one rollout manager for the job 'default'"),
       manager_standby: bool = typer.Option(
           True, "--manager-standby/--no-manager-standby", help="a second rollout manager per "
           "job standing by (etcd election): it takes over when the leader dies and the step "
           "resumes there with every token"),
       agents: int = typer.Option(1, min=0, help="transfer agents; workers pull job 'default' "
                                                 "weights from them"),
       log_dir: Optional[Path] = typer.Option(None, help="where service logs go (default: a temp dir)"),
       placement_scheduler: bool = typer.Option(False, help="also start a placement scheduler "
                                                "(4 rollout + 2 training nodes; see its --help)"),
       rollout_slots: int = typer.Option(1, min=1, max=64, help="with --jobs: GPU slots per "
                                         "rollout node, a placed worker each (the node's "
                                         "permits, and a long tail's migration, are per slot)"),
       jobs: int = typer.Option(1, min=1, help="RL jobs; more than one needs "
                                "--placement-scheduler: the jobs then share the rollout workers "
                                "(one per rollout node) and one training node by WEAVE's "
                                "permits, each with its own manager (and trainer)"),
       trainer: bool = typer.Option(False, help="also start a trainer for the job 'default' "
                                               "(needs the manager and an agent)"),
       spot_trace: str = typer.Option("", help="replay spot availability instead of --spot: "
                                       "a segment of RLBoost Table 5 (A, B, C) or a "
                                       "time_s,event,instance CSV; at most N_prem run"),
       trace_seconds: float = typer.Option(600.0, min=1.0, help="the trace, compressed to "
                                           "this many seconds of replay"),
       trace_seed: int = typer.Option(0, help="seed of a synthesized segment"),
       prometheus: bool = typer.Option(False, help="also start Prometheus scraping every member "
                                       "(targets follow etcd; the Debian package's binary)"),
       prometheus_port: int = typer.Option(9090, min=1, max=65535),
       tls: bool = typer.Option(False, help="mutual TLS between every service and with "
                                "etcd: a throwaway CA and a certificate per service (its role) "
                                "under LOG_DIR/pki"),
       ready_timeout: float = typer.Option(120.0, help="seconds to wait for every member")) -> None:
    """Start etcd and the services as local processes; Ctrl-C stops them all cleanly."""
    replay_trace = None
    if spot_trace:
        try:
            replay_trace = load_trace(spot_trace, trace_seconds, trace_seed)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--spot-trace") from None
        spot = 0  # the trace decides the spot workers
    if jobs > 1 and not placement_scheduler:
        raise typer.BadParameter("several jobs share the workers only under the placement "
                                 "scheduler; add --placement-scheduler", param_hint="--jobs")
    if jobs > 1 and not manager:  # each placed job needs its own manager
        raise typer.BadParameter("each job needs a manager: drop --no-manager",
                                 param_hint="--jobs")
    if jobs > 1 and (spot or spot_trace or coexecutors):
        raise typer.BadParameter("--jobs runs dedicated workers placed on rollout nodes; drop "
                                 "--spot, --spot-trace and --coexecutors", param_hint="--jobs")
    if engine not in ("torch", "vllm"):
        raise typer.BadParameter(f"{engine!r}: torch or vllm", param_hint="--engine")
    if engine == "vllm" and jobs > 1:
        raise typer.BadParameter("placed workers run the torch engine (they keep each job's "
                                 "weights beside it); drop --engine vllm or --jobs",
                                 param_hint="--engine")
    if engine == "vllm" and model == "tiny":
        raise typer.BadParameter("vLLM's CPU attention needs head_dim >= 32: use --model small "
                                 "or a checkpoint directory", param_hint="--model")
    stack = LocalStack(log_dir or Path(tempfile.mkdtemp(prefix="rlharvest-")))
    if engine == "vllm" and not Path(model).is_dir():
        size, model = model, str(build_checkpoint(stack.log_dir / "checkpoint", size=model,
                                                  overwrite=True))
        console.print(f"built a {size} checkpoint for vLLM at {model}; every service loads it")
    engine_flags = ["--engine", "vllm"] if engine == "vllm" else []
    operator: list[str] = []  # the flags that give `rlharvest status` this process's identity
    if tls:
        stack.ca = LocalCA(stack.log_dir / "pki")
        operator = _operator_identity(stack.ca)
    endpoint = stack.start_etcd()  # with the CA: https, a client certificate required
    scraper: LocalPrometheus | None = None
    try:
        if prometheus:
            scraper = LocalPrometheus(endpoint, stack.log_dir / "prometheus",
                                      port=prometheus_port, tls=_scraper_identity(stack.ca)
                                      ).start()
        for i in range(agents):
            stack.start("transfer_agent", f"agent-{i}", ["--agent-id", f"agent-{i}", "--relay"])
        if jobs > 1:
            expected = agents + _start_placed_jobs(stack, jobs, workers, rollout_slots, model,
                                                   agents, trainer, manager_standby)
            asyncio.run(_wait_members(endpoint, expected, ready_timeout, stack))
            console.print(f"[bold green]rlharvest is up[/]: etcd at {endpoint}, {jobs} jobs "
                          f"sharing {workers * rollout_slots} placed rollout workers "
                          f"({workers} nodes x {rollout_slots} slots) and 1 training node by "
                          f"the placement scheduler's permits, logs in {stack.log_dir}")
            console.print(f"  rlharvest status --etcd {endpoint}")
            if scraper is not None:
                console.print(f"  Prometheus at {scraper.url} (job 'rlharvest', every member)")
            _wait_for_signal()
            return
        for i in range(workers + spot):
            kind = "dedicated" if i < workers else "spot"
            stack.start("rollout_worker", f"worker-{i}",
                        ["--worker-id", f"worker-{i}", "--kind", kind, "--model", model,
                         *engine_flags,
                         *(["--job", "default", "--agent-pull"] if agents else [])])
        for i in range(coexecutors):
            stack.start("coexecutor", f"coexec-{i}",
                        ["--coexec-id", f"coexec-{i}", "--model", model, "--http-port",
                         str(coexec_http_port + i), *(["--agent-pull"] if agents else [])])
        if manager:
            for m in range(2 if manager_standby else 1):  # the first leads
                stack.start("rollout_manager", f"manager-{m}", [
                    "--manager-id", f"manager-{m}", "--max-serving-workers", str(coexecutors)])
        expected = workers + spot + coexecutors + int(manager) * (1 + manager_standby) + agents
        if placement_scheduler:
            stack.start("placement_scheduler", "placement-scheduler",
                        ["--scheduler-id", "scheduler-0"])
            expected += 1
        if trainer:
            if not (manager and agents):
                raise typer.BadParameter("--trainer needs the manager and at least one agent")
            stack.start("trainer", "trainer-0", ["--trainer-id", "trainer-0", "--model", model,
                                                 "--no-exit-when-done"])
            expected += 1
        asyncio.run(_wait_members(endpoint, expected, ready_timeout, stack))
        managers = f", 1 rollout manager{' + standby' if manager_standby else ''}" \
            if manager else ""
        console.print(f"[bold green]rlharvest is up[/]: etcd at {endpoint}, {workers + spot} "
                      f"rollout workers{managers}, logs in {stack.log_dir}")
        scheme = "https" if stack.ca is not None else "http"
        for i in range(coexecutors):
            console.print(f"  co-executor coexec-{i}: OpenAI API at "
                          f"{scheme}://127.0.0.1:{coexec_http_port + i}/v1 (model 'small')")
        if stack.ca is not None:
            console.print(f"  mutual TLS: CA {stack.ca.ca_path}; a client of etcd or of a "
                          "service needs a certificate it signed (the co-executor's OpenAI API "
                          "is HTTPS with a certificate it signed)")
        console.print(f"  rlharvest status --etcd {endpoint} {' '.join(operator)}".rstrip())
        if scraper is not None:
            console.print(f"  Prometheus at {scraper.url} (job 'rlharvest', every member)")
        if replay_trace is None:
            _wait_for_signal()
            return
        console.print(f"replaying spot availability {spot_trace} over {trace_seconds:g}s "
                      f"(mean {replay_trace.mean_count():.2f} instances, "
                      f"{replay_trace.allocations} allocations, "
                      f"{replay_trace.preemptions} preemptions)")
        worker_flags = ["--model", model, *engine_flags,
                        *(["--job", "default", "--agent-pull"] if agents else [])]
        asyncio.run(_replay(endpoint, SpotReplay(stack, replay_trace, worker_flags,
                                                 report=console.print)))
    finally:
        console.print("stopping...")
        if scraper is not None:
            scraper.stop()
        stack.stop()
        console.print("stopped")


def _operator_identity(ca: LocalCA) -> list[str]:
    """An operator certificate for this process, which reads etcd (over TLS, like the
    services) while the stack comes up and replays a trace; returns the flags that give
    `rlharvest status` the same identity."""
    cert, key = ca.issue("operator", "operator")
    _configure_tls(str(cert), str(key), str(ca.ca_path))
    return ca.flags_of(cert, key)


def _scraper_identity(ca: LocalCA | None) -> TlsFiles | None:
    """With --tls: a certificate of the stack's CA for Prometheus (the /metrics endpoints want
    one; it needs no role)."""
    if ca is None:
        return None
    cert, key = ca.issue("prometheus", "metrics")
    return TlsFiles(cert, key, ca.ca_path)


def _configure_tls(cert: str, key: str, ca: str) -> None:
    """This process's TLS material (every channel and etcd client after this), or a bad
    parameter naming the missing key or unreadable file."""
    try:
        tls.configure(cert, key, ca)
    except ConfigError as exc:
        raise typer.BadParameter(str(exc)) from None


def placed_units(nodes: int, slots: int) -> tuple[str, ...]:
    """Where ``up --jobs`` places a worker each: the scheduler's own names for its rollout
    nodes, or their GPU slots (``rollout-<i>.gpu<k>``)."""
    names = PlacementConfig.model_validate(
        {"rollout_nodes": nodes, "rollout_slots": slots}).node_names(Pool.ROLLOUT)
    return slot_units(names, slots)


def _start_placed_jobs(stack: LocalStack, jobs: int, workers: int, slots: int, model: str,
                       agents: int, trainer: bool, standby: bool) -> int:
    """WEAVE on the local stack: a scheduler with ``workers`` rollout nodes of ``slots`` GPU
    slots and one training node, a worker placed on each slot, a manager (and a trainer) per
    job. Returns how many members that is."""
    if workers < 1:
        raise typer.BadParameter("--jobs needs at least one rollout worker", param_hint="--workers")
    stack.start("placement_scheduler", "placement-scheduler", [
        "--scheduler-id", "scheduler-0", "--rollout-nodes", str(workers), "--rollout-slots",
        str(slots), "--train-nodes", "1"])
    nodes = placed_units(workers, slots)
    for i, node in enumerate(nodes, start=1):
        stack.start("rollout_worker", f"worker-{i}", [
            "--worker-id", f"worker-{i}", "--model", model, "--placement-node", node,
            *(["--agent-pull"] if agents else [])])
    for j in range(1, jobs + 1):
        job = f"job-{j}"
        for m in ("", "-standby") if standby else ("",):
            stack.start("rollout_manager", f"manager-{job}{m}",
                        ["--manager-id", f"manager-{job}{m}", "--job", job])
        if trainer:
            # Worst-case phase estimates for the tiny preset on a CPU, and an SLO loose enough
            # for every job to share the one group.
            stack.start("trainer", f"trainer-{job}", [
                "--trainer-id", f"trainer-{job}", "--job", job, "--model", model,
                "--no-exit-when-done", *([] if agents else ["--no-publish"]),
                "--placement-scheduler", "--placement-t-roll-s", "30",
                "--placement-t-train-s", "30", "--placement-slo", str(jobs + 1)])
    return 1 + len(nodes) + jobs * (1 + trainer + standby)


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


async def _replay(endpoint: str, replay: SpotReplay) -> None:
    stopped = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stopped.set)
    etcd = await registry.connect(endpoint)
    try:
        await replay.run(etcd, stopped)
    finally:
        await etcd.close()


def _wait_for_signal() -> None:
    got = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda s, _f: got.append(s))
    while not got:
        time.sleep(0.2)


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
    _configure_tls(tls_cert, tls_key, tls_ca)  # every status call dials with it, etcd too
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
