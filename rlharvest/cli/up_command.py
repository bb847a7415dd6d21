"""`rlharvest up`: etcd and every service as local processes, ready for a job; Ctrl-C stops them.

The same stack the demo runs, for a person to use: dedicated, spot and serving rollout members
for the job 'default' (or several jobs placed by the scheduler), transfer agents, managers, an
optional trainer, Prometheus and mutual TLS, and a spot-availability trace to replay.
"""

from __future__ import annotations

import asyncio
import signal
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from rlharvest.common import registry, tls
from rlharvest.common.config import ConfigError
from rlharvest.common.tls import LocalCA
from rlharvest.models.hf_checkpoint import build_checkpoint
from rlharvest.cli.launcher import LocalStack
from rlharvest.cli.prometheus_stack import LocalPrometheus, TlsFiles
from rlharvest.cli.spot_replay import SpotReplay, load_trace
from rlharvest.sim.spot_trace import SpotTrace
from rlharvest.services.placement_scheduler.config import PlacementConfig
from rlharvest.services.placement_scheduler.control import slot_units
from rlharvest.services.placement_scheduler.model import Pool

console = Console()


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
    replay_trace = _load_trace(spot_trace, trace_seconds, trace_seed)
    if replay_trace is not None:
        spot = 0  # the trace decides the spot workers
    _check_options(jobs, placement_scheduler, manager, bool(spot or spot_trace or coexecutors),
                   engine, model)
    stack = LocalStack(log_dir or Path(tempfile.mkdtemp(prefix="rlharvest-")))
    model = _engine_model(stack, engine, model)
    engine_flags = ["--engine", "vllm"] if engine == "vllm" else []
    operator: list[str] = []  # the flags that give `rlharvest status` this process's identity
    if tls:
        stack.ca = LocalCA(stack.log_dir / "pki")
        stack.etcd_roles = True  # each service's certificate writes only its role's keys
        operator = _operator_identity(stack.ca)
    endpoint = stack.start_etcd()  # with the CA: https, a client certificate required
    stack.start_etcd_maintenance()  # this process holds the admin role a defrag needs
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
            _say_where(endpoint, [], scraper)
            _wait_for_signal()
            return
        worker_flags = ["--model", model, *engine_flags,
                        *(["--job", "default", "--agent-pull"] if agents else [])]
        expected = agents + _start_dedicated(
            stack, _Dedicated(workers, spot, coexecutors, coexec_http_port, model, worker_flags,
                              agents, manager, manager_standby, placement_scheduler, trainer))
        asyncio.run(_wait_members(endpoint, expected, ready_timeout, stack))
        managers = f", 1 rollout manager{' + standby' if manager_standby else ''}" \
            if manager else ""
        console.print(f"[bold green]rlharvest is up[/]: etcd at {endpoint}, {workers + spot} "
                      f"rollout workers{managers}, logs in {stack.log_dir}")
        _say_coexecutors(stack, coexecutors, coexec_http_port)
        _say_where(endpoint, operator, scraper)
        if replay_trace is None:
            _wait_for_signal()
            return
        console.print(f"replaying spot availability {spot_trace} over {trace_seconds:g}s "
                      f"(mean {replay_trace.mean_count():.2f} instances, "
                      f"{replay_trace.allocations} allocations, "
                      f"{replay_trace.preemptions} preemptions)")
        asyncio.run(_replay(endpoint, SpotReplay(stack, replay_trace, worker_flags,
                                                 report=console.print)))
    finally:
        console.print("stopping...")
        if scraper is not None:
            scraper.stop()
        stack.stop()
        console.print("stopped")


def _load_trace(spot_trace: str, seconds: float, seed: int) -> SpotTrace | None:
    if not spot_trace:
        return None
    try:
        return load_trace(spot_trace, seconds, seed)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--spot-trace") from None


def _check_options(jobs: int, placement_scheduler: bool, manager: bool, unplaced: bool,
                   engine: str, model: str) -> None:
    """Refuse combinations the stack cannot run, naming the flag; ``unplaced``: spot workers,
    a spot trace or co-executors were asked for."""
    if jobs > 1 and not placement_scheduler:
        raise typer.BadParameter("several jobs share the workers only under the placement "
                                 "scheduler; add --placement-scheduler", param_hint="--jobs")
    if jobs > 1 and not manager:  # each placed job needs its own manager
        raise typer.BadParameter("each job needs a manager: drop --no-manager",
                                 param_hint="--jobs")
    if jobs > 1 and unplaced:
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


def _engine_model(stack: LocalStack, engine: str, model: str) -> str:
    """The model every service loads: vLLM loads checkpoint directories, so a preset is built
    into one under the log directory first."""
    if engine != "vllm" or Path(model).is_dir():
        return model
    path = str(build_checkpoint(stack.log_dir / "checkpoint", size=model, overwrite=True))
    console.print(f"built a {model} checkpoint for vLLM at {path}; every service loads it")
    return path


@dataclass(frozen=True)
class _Dedicated:
    """The unplaced stack of the job 'default': its workers, co-executors and managers."""

    workers: int
    spot: int
    coexecutors: int
    coexec_http_port: int
    model: str
    worker_flags: list[str]
    agents: int
    manager: bool
    manager_standby: bool
    placement_scheduler: bool
    trainer: bool


def _start_dedicated(stack: LocalStack, d: _Dedicated) -> int:
    """Start them; returns how many members that is."""
    for i in range(d.workers + d.spot):
        kind = "dedicated" if i < d.workers else "spot"
        stack.start("rollout_worker", f"worker-{i}",
                    ["--worker-id", f"worker-{i}", "--kind", kind, *d.worker_flags])
    for i in range(d.coexecutors):
        stack.start("coexecutor", f"coexec-{i}",
                    ["--coexec-id", f"coexec-{i}", "--model", d.model, "--http-port",
                     str(d.coexec_http_port + i), *(["--agent-pull"] if d.agents else [])])
    if d.manager:
        for m in range(2 if d.manager_standby else 1):  # the first leads
            stack.start("rollout_manager", f"manager-{m}", [
                "--manager-id", f"manager-{m}", "--max-serving-workers", str(d.coexecutors)])
    expected = d.workers + d.spot + d.coexecutors + int(d.manager) * (1 + d.manager_standby)
    if d.placement_scheduler:
        stack.start("placement_scheduler", "placement-scheduler",
                    ["--scheduler-id", "scheduler-0"])
        expected += 1
    if d.trainer:
        if not (d.manager and d.agents):
            raise typer.BadParameter("--trainer needs the manager and at least one agent")
        stack.start("trainer", "trainer-0", ["--trainer-id", "trainer-0", "--model", d.model,
                                             "--no-exit-when-done"])
        expected += 1
    return expected


def _say_coexecutors(stack: LocalStack, coexecutors: int, http_port: int) -> None:
    scheme = "https" if stack.ca is not None else "http"
    for i in range(coexecutors):
        console.print(f"  co-executor coexec-{i}: OpenAI API at "
                      f"{scheme}://127.0.0.1:{http_port + i}/v1 (model 'small')")
    if stack.ca is not None:
        console.print(f"  mutual TLS: CA {stack.ca.ca_path}; a client of etcd or of a "
                      "service needs a certificate it signed (the co-executor's OpenAI API "
                      "is HTTPS with a certificate it signed)")


def _say_where(endpoint: str, operator: list[str], scraper: LocalPrometheus | None) -> None:
    console.print(f"  rlharvest status --etcd {endpoint} {' '.join(operator)}".rstrip())
    if scraper is not None:
        console.print(f"  Prometheus at {scraper.url} (job 'rlharvest', every member)")


def _operator_identity(ca: LocalCA) -> list[str]:
    """An operator certificate for this process, which reads etcd (over TLS, like the
    services) while the stack comes up and replays a trace; returns the flags that give
    `rlharvest status` the same identity."""
    cert, key = ca.issue("operator", "operator")
    configure_tls(str(cert), str(key), str(ca.ca_path))
    return ca.flags_of(cert, key)


def _scraper_identity(ca: LocalCA | None) -> TlsFiles | None:
    """With --tls: a certificate of the stack's CA for Prometheus (the /metrics endpoints want
    one; it needs no role)."""
    if ca is None:
        return None
    cert, key = ca.issue("prometheus", "metrics")
    return TlsFiles(cert, key, ca.ca_path)


def configure_tls(cert: str, key: str, ca: str) -> None:
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
