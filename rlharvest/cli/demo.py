"""`make run`: the whole local stack trains the tiny model, with a spot worker preempted mid-step.

etcd, a transfer agent, the rollout manager, rollout workers (one of them spot) and the trainer
run as separate processes, exactly as `rlharvest up` starts them. A schedule SIGKILLs the spot
worker in the middle of a step (the manager migrates its requests, no token lost) and later starts
a new spot process, which joins while a step runs and takes requests once it pulled the current
weight version. A serving co-executor (ROSE) answers a bursty synthetic trace on its
OpenAI-compatible API the whole time, and the job borrows it for rollouts inside that traffic's
SLO slack (``demo_serving.py``). Ends with a table per step — reward, throughput, migrations,
and the serving SLO attainment and rollout tokens harvested on the co-executor in that step —
and a PNG plot of reward and throughput.

    python -m rlharvest.cli.demo [--steps 20] [--workers 3] [--preempt-at 3,14]
                                      [--coexecutor/--no-coexecutor] [--serving-rps 1]
                                      [--tail-batching 1.25] [--seed-role]
                                      [--kill-manager-at 5]

With ``--kill-manager-at STEP`` a standby manager runs beside the job's; the leader is SIGKILLed
mid-rollout in that step, the standby takes over and the step resumes there, and the demo
reports the tokens generated twice (0: the workers hand the dead leader's requests over).

The demo fails (exit 1) if the reward did not rise: the mean of the last few steps must beat the
mean of the first few by ``--min-rise``.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table

import grpc

from rlharvest.common import observability, registry, rpc
from rlharvest.common.local_etcd import free_port
from rlharvest.common.pb import rollout_manager_pb2 as mpb, rollout_manager_pb2_grpc
from rlharvest.common.pb import trainer_pb2 as tpb, trainer_pb2_grpc
from rlharvest.cli import demo_placed
from rlharvest.cli.demo_serving import DemoServing, StepServing
from rlharvest.cli.launcher import LocalStack, ServiceProcess

app = typer.Typer(add_completion=False, help=__doc__)
# Piped (CI logs, `| tee`), rich would squeeze the step table into 80 columns.
console = Console(width=None if sys.stdout.isatty() else 160)
_POLL_S = 0.05
_RISE_WINDOW = 3  # steps averaged at each end: one step's reward is too noisy to compare
_TIME_LIMIT_S = 300.0  # A handful of steps within 5 minutes on 2 cores
# The co-executor's SLOs: what a serving model this small answers well within on 2 busy cores.
_SERVING_SLO_S = (1.5, 0.3)


# ---- the preemption schedule (pure) ---------------------------------------------------------

@dataclass(frozen=True)
class Kill:
    step: int


@dataclass(frozen=True)
class Replace:
    step: int


@dataclass
class PreemptionSchedule:
    """SIGKILL the spot worker mid-step in each of the ``kill_at`` steps (or the first later step
    in which it holds requests: a kill that hits no request shows nothing); ``replace_after``
    steps later start a new spot process, which joins while a step runs."""

    kill_at: tuple[int, ...]
    replace_after: int
    _killed: dict[int, int] = field(default_factory=dict)  # scheduled step -> step killed in
    _replaced: set[int] = field(default_factory=set)

    def decide(self, step: int, spot_assigned: int) -> list[Kill | Replace]:
        """``spot_assigned``: requests the live spot worker holds now (0 when there is none)."""
        actions: list[Kill | Replace] = []
        for k in self.kill_at:
            if k not in self._killed and step >= k and spot_assigned > 0 and \
                    len(self._killed) == len(self._replaced):  # the previous one was replaced
                self._killed[k] = step
                actions.append(Kill(step))
                spot_assigned = 0
            elif k in self._killed and k not in self._replaced and \
                    step >= self._killed[k] + self.replace_after:
                self._replaced.add(k)
                actions.append(Replace(step))
                spot_assigned = 0  # the new process holds nothing yet
        return actions


def parse_steps(text: str) -> tuple[int, ...]:
    try:
        steps = tuple(sorted({int(s) for s in text.split(",") if s.strip()}))
    except ValueError:
        raise typer.BadParameter(f"--preempt-at {text!r}: give step numbers like 4,9") from None
    if any(s < 1 for s in steps):
        raise typer.BadParameter("--preempt-at: steps start at 1")
    return steps


# ---- the run ----------------------------------------------------------------------------------

@dataclass
class Run:
    stack: LocalStack
    trainer_endpoint: str
    manager_endpoints: list[str]  # the leader's, then the standby's (--kill-manager-at)
    spot: ServiceProcess | None
    spot_flags: list[str]  # a replacement spot process starts with these
    serving: DemoServing | None = None  # the co-executor's traffic and per-step report
    events: dict[int, list[str]] = field(default_factory=dict)
    spot_generation: int = 0
    managers: list[ServiceProcess] = field(default_factory=list)
    kill_manager_at: int = 0  # 0: never
    leader: int = 0  # index of the leading manager
    killed_manager: ServiceProcess | None = None

    def note(self, step: int, text: str) -> None:
        self.events.setdefault(step, []).append(text)


def _start_stack(log_dir: Path, args: dict) -> Run:
    """The demo's stack, its services started; stopped again when one fails to start."""
    stack = LocalStack(log_dir)
    with stack.stopped_on_error():
        return _start_services(stack, args)


def _start_services(stack: LocalStack, args: dict) -> Run:
    stack.start_etcd()
    common = ["--lease-ttl", "2", "--json-logs"]
    model = ["--model", args["model"]]  # the job's model, wherever it rolls out or trains
    stack.start("transfer_agent", "agent", ["--agent-id", "agent-0", *common])
    managers, manager_endpoints = [], []
    for i in range(2 if args["kill_manager_at"] else 1):  # the first leads, a second stands by
        manager_port = free_port()
        managers.append(stack.start("rollout_manager", f"manager-{i}", [
            "--manager-id", f"manager-{i}", "--port", str(manager_port), "--stall-timeout-s",
            "5", "--max-serving-workers", str(int(args["coexecutor"])), *common]))
        manager_endpoints.append(f"127.0.0.1:{manager_port}")
        if i == 0:
            asyncio.run(rpc.wait_healthy(manager_endpoints[0], timeout=60))  # it leads
    serving = _start_coexecutor(stack, args, [*model, *common]) if args["coexecutor"] else None
    # A few slots per worker, so every step's requests spread over all workers in waves.
    def worker_flags(step_delay_s: float) -> list[str]:
        return ["--torch-threads", "1", "--job", "default", "--agent-pull",
                "--max-running", str(args["max_running"]), "--step-delay-s", str(step_delay_s),
                *model, *_engine_flags(args["engine"]), *common]

    for i in range(args["workers"] - 1):
        stack.start("rollout_worker", f"worker-{i}", ["--worker-id", f"worker-{i}",
                                                      *worker_flags(args["step_delay_s"])])
    # The spot worker is slower (an emulated older GPU): by default it holds its share of every
    # step's requests for a second or more (4 tokens at 0.25 s per engine step, a sleep that a
    # busy CPU does not shorten), far longer than the status poll below takes to come round, so
    # the kill lands mid-step in the scheduled step. At the others' speed it held them for a
    # moment the poll could miss for several steps in a row.
    spot_flags = ["--kind", "spot", *worker_flags(args["spot_step_delay_s"])]
    spot = stack.start("rollout_worker", "spot-0", ["--worker-id", "spot-0", *spot_flags])
    port = free_port()
    # Every rollout member, the co-executor included, before the first step: a short run whose
    # steps all ended before the co-executor joined would harvest nothing on it.
    members = args["workers"] + int(args["coexecutor"]) + int(args["seed_role"])
    stack.start("trainer", "trainer", [
        "--trainer-id", "trainer-0", "--port", str(port), "--steps", str(args["steps"]),
        "--prompts-per-step", str(args["prompts"]), "--samples-per-prompt", str(args["samples"]),
        "--micro-batch-groups", "2", "--lr", str(args["lr"]), "--backend", args["backend"],
        "--torch-threads", "1", "--no-exit-when-done", "--instance-cap", "auto",
        "--min-workers", str(members), *_tail_flags(args["tail_batching"]),
        *(["--seed-role", "--seed-window-init-s", "0.5"] if args["seed_role"] else []), *model,
        *common])
    return Run(stack, f"127.0.0.1:{port}", manager_endpoints, spot, spot_flags, serving,
               managers=managers, kill_manager_at=args["kill_manager_at"])


def _engine_flags(engine: str) -> list[str]:
    """The rollout workers' engine: vLLM's with a KV cache sized for this small model."""
    return ["--engine", "vllm", "--kv-cache-gib", "0.25"] if engine == "vllm" else []


def demo_model(engine: str, log_dir: Path) -> str:
    """The job's model: the `tiny` preset, or with vLLM (which loads checkpoint directories,
    and whose CPU attention needs head_dim >= 32) a `small` checkpoint built into the log
    directory, which every service then loads."""
    if engine != "vllm":
        return "tiny"
    from rlharvest.models.hf_checkpoint import build_checkpoint

    return str(build_checkpoint(log_dir / "checkpoint", size="small", overwrite=True))


def _tail_flags(eta: float) -> list[str]:
    """RollPacker's tail batching at ``eta`` for prompts and responses (0: off)."""
    return ["--tail-batching", "--eta-prompts", str(eta), "--eta-responses", str(eta)] \
        if eta else []


def _start_coexecutor(stack: LocalStack, args: dict, common: list[str]) -> DemoServing:
    """A serving co-executor the job borrows (not pinned: the manager claims it in etcd)."""
    http, metrics = free_port(), free_port()
    ttft, tpot = _SERVING_SLO_S
    stack.start("coexecutor", "coexec-0", [
        "--coexec-id", "coexec-0", "--agent-pull", "--http-port", str(http), "--metrics-port",
        str(metrics), "--serving-model", "tiny", "--served-model-name", "served",
        "--torch-threads", "1", "--max-running", str(args["max_running"]),
        "--ttft-slo-ms", str(1000 * ttft), "--tpot-slo-ms", str(1000 * tpot), *common])
    return DemoServing(f"http://127.0.0.1:{http}", metrics, "served", slo_s=_SERVING_SLO_S,
                       seconds=_TIME_LIMIT_S, rps=args["serving_rps"])


async def drive(run: Run, schedule: PreemptionSchedule, steps: int,
                 timeout: float) -> tpb.TrainerStatus:
    deadline = time.monotonic() + timeout
    progress = Progress(TextColumn("{task.description}"), BarColumn(),
                        TextColumn("{task.completed:.0f}/{task.total:.0f} completions"),
                        TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=console)
    bars: dict[int, TaskID] = {}
    known_spots: set[str] = set()
    closed: set[int] = set()
    traffic: asyncio.Task | None = None
    async with contextlib.AsyncExitStack() as channels:
        stub = trainer_pb2_grpc.TrainerStub(
            await channels.enter_async_context(rpc.channel(run.trainer_endpoint)))
        managers = [rollout_manager_pb2_grpc.RolloutManagerStub(
            await channels.enter_async_context(rpc.channel(endpoint)))
            for endpoint in run.manager_endpoints]
        killer = asyncio.create_task(kill_manager_in_step(run, managers[0])) \
            if run.kill_manager_at else None
        with progress:
            starting = progress.add_task("starting the stack", total=1, info="")
            while True:
                _check_alive(run)
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the demo did not finish within {timeout:.0f}s; logs "
                                       f"in {run.stack.log_dir}")
                st = await demo_placed.trainer_status(stub)
                if st is None or st.state == "starting":
                    await asyncio.sleep(0.2)
                    continue
                progress.update(starting, visible=False)
                if run.serving is not None and traffic is None:  # traffic from the first step on
                    traffic = asyncio.create_task(run.serving.run(), name="serving traffic")
                cur = st.current
                for done in st.steps:  # close finished steps (a quick one may have no bar)
                    if done.step in closed:
                        continue
                    closed.add(done.step)
                    served = await _close_serving(run, done.step)
                    bar = bars.get(done.step)
                    if bar is not None:
                        progress.update(bar, completed=progress.tasks[bar].total,
                                        info=f"reward {done.mean_reward:.3f}{served}")
                        progress.stop_task(bar)
                if cur.step and cur.step not in bars and st.state == "training":
                    bars[cur.step] = progress.add_task(
                        f"step {cur.step:>3}/{steps} v{cur.weight_version}",
                        total=cur.samples, info="")
                if cur.step in bars and st.state == "training":
                    progress.update(bars[cur.step], completed=cur.completions,
                                    info=f"{cur.phase}, {cur.tokens_generated} tokens")
                await _preempt(run, schedule, cur, managers[run.leader], known_spots)
                if st.state in ("done", "failed"):
                    for task in (traffic, killer):
                        if task is not None:
                            task.cancel()
                    return st
                await asyncio.sleep(_POLL_S)


async def _close_serving(run: Run, step: int) -> str:
    """Record the co-executor's share of ``step``; the progress bar's note about it."""
    if run.serving is None:
        return ""
    served = await run.serving.close_step(step)
    attained = "-" if served.attainment is None else f"{served.attainment:.0%}"
    return f", serving SLO {attained}, harvested {served.harvested_tokens} tokens"


async def _preempt(run: Run, schedule: PreemptionSchedule, cur: tpb.StepProgress, manager,
                   known_spots: set[str]) -> None:
    try:
        workers = (await manager.GetStatus(mpb.GetStatusRequest(), timeout=2)).workers
    except grpc.aio.AioRpcError:
        return
    spot = run.spot.name if run.spot is not None and run.spot.alive() else ""
    assigned = next((w.assigned for w in workers if w.worker_id == spot and w.state == "healthy"),
                    0)
    for action in schedule.decide(cur.step, assigned):
        if isinstance(action, Kill) and run.spot is not None:
            run.spot.kill()
            run.note(action.step, f"SIGKILL {run.spot.name} ({assigned} held)")
            console.log(f"[red]preempted[/] {run.spot.name} (SIGKILL) in step {action.step}, "
                        f"holding {assigned} requests, {cur.completions}/{cur.samples} done")
        elif isinstance(action, Replace):
            run.spot_generation += 1
            name = f"spot-{run.spot_generation}"
            run.spot = run.stack.start("rollout_worker", name, ["--worker-id", name,
                                                                 *run.spot_flags])
            run.note(action.step, f"start {name}")
            console.log(f"[green]replacement[/] {name} starting during step {action.step}")
    for w in workers:  # a replacement joins the manager once it pulled the current version
        if w.worker_id.startswith("spot-") and w.worker_id != "spot-0" and \
                w.worker_id not in known_spots and w.weight_version == cur.weight_version:
            known_spots.add(w.worker_id)
            run.note(cur.step, f"{w.worker_id} joined at {cur.completions}/{cur.samples}")
            console.log(f"{w.worker_id} joined on version {w.weight_version} during step "
                        f"{cur.step} ({cur.phase}, {cur.completions}/{cur.samples} completions)")


async def kill_manager_in_step(run: Run, leader) -> None:
    """``--kill-manager-at``: SIGKILL the leading manager while it holds requests of that step.
    The manager's requests in flight mark each step's rollout (the k-th stretch with some is
    step k's; a missed one moves the kill to a later step), polled every 10 ms: the trainer
    may come up and run the demo's tiny steps within a second."""
    stretches, busy = 0, False
    while True:
        try:
            held = (await leader.GetStatus(mpb.GetStatusRequest(), timeout=1)).in_flight
        except grpc.aio.AioRpcError:
            held = 0
        stretches += bool(held and not busy)
        busy = bool(held)
        if busy and stretches >= run.kill_manager_at:
            run.killed_manager = run.managers[run.leader]
            run.killed_manager.kill()
            run.leader = 1
            run.note(stretches, f"SIGKILL the leading manager ({held} requests in flight)")
            console.log(f"[red]SIGKILL[/] the leading rollout manager in step {stretches} with "
                        f"{held} requests in flight; the standby takes over")
            return
        await asyncio.sleep(0.01)


async def manager_death_report(run: Run) -> str:
    """After ``--kill-manager-at``: what the standby and the workers made of the dead leader's
    requests, and the tokens generated twice (the new leader's regenerated positions plus the
    workers' kept tokens nobody adopted)."""
    assert run.stack.etcd is not None  # started with the stack
    etcd = await registry.connect(run.stack.etcd.endpoint)
    try:
        members = {**await registry.list_members(etcd, "rollout_worker"),
                   **await registry.list_members(etcd, "coexecutor")}
    finally:
        await etcd.close()
    adopted = adopted_tokens = dropped_tokens = 0.0
    for info in members.values():
        text = observability.scrape(info["metrics"])
        adopted += observability.sample(
            text, 'rlh_worker_kept_request_outcomes_total{outcome="adopted"}')
        adopted_tokens += observability.sample(text, "rlh_worker_kept_tokens_adopted_total")
        dropped_tokens += observability.sample(text, "rlh_worker_kept_tokens_dropped_total")
    async with rpc.channel(run.manager_endpoints[run.leader]) as chan:
        status = await rollout_manager_pb2_grpc.RolloutManagerStub(chan).GetStatus(
            mpb.GetStatusRequest(), timeout=5)
    twice = status.tokens_regenerated + int(dropped_tokens)
    return (f"manager failover: the standby adopted {adopted:.0f} requests from the workers "
            f"with {adopted_tokens:.0f} tokens they generated meanwhile; tokens generated "
            f"twice: {twice}")


def _check_alive(run: Run) -> None:
    for proc in run.stack.processes:
        if not proc.alive() and proc is not run.spot and not proc.name.startswith("spot-") \
                and proc is not run.killed_manager:
            raise RuntimeError(f"{proc.name} exited unexpectedly:\n{proc.log_tail(30)}")


# ---- did it learn? (pure) ---------------------------------------------------------------------

def reward_ends(rewards: list[float], window: int = _RISE_WINDOW) -> tuple[float, float, int]:
    """Mean reward of the first and of the last ``k`` steps, ``k`` = min(window, half the run),
    so the two ends never share a step; returns (first, last, k)."""
    k = min(window, len(rewards) // 2)
    if k < 1:
        raise ValueError(f"need at least 2 steps to compare, got {len(rewards)}")
    return sum(rewards[:k]) / k, sum(rewards[-k:]) / k, k


def rise_failure(rewards: list[float], min_rise: float,
                 window: int = _RISE_WINDOW) -> str | None:
    """Why the run does not show learning, or None when the reward rose by ``min_rise``."""
    if len(rewards) < 2:
        return f"only {len(rewards)} step(s) finished: too few to tell whether reward rose"
    first, last, k = reward_ends(rewards, window)
    if last - first >= min_rise:
        return None
    return (f"reward did not rise: mean of the last {k} steps {last:.3f} vs the first {k} "
            f"{first:.3f} (needed +{min_rise:g}); try more --steps or a higher --lr")


# ---- the report -------------------------------------------------------------------------------

def step_table(status: tpb.TrainerStatus, events: dict[int, list[str]],
               title: str = "rlharvest demo: one GRPO step per row",
               serving: dict[int, StepServing] | None = None) -> Table:
    """One row per step; with ``serving``, the co-executor's columns: SLO attainment of the
    serving requests finished in the step (of how many) and rollout tokens harvested there."""
    table = Table(title=title)
    columns = ["step", "version", "reward", "time s", "tokens/s", "micro", "migr", "N_prem",
               "T_seed", "Δ changed"]
    if serving is not None:
        columns += ["serving SLO", "harvested"]
    tail = any(s.round for s in status.steps)
    if tail:
        columns += ["round", "deferred", "discarded"]
    for column in [*columns, "events"]:
        table.add_column(column, justify="right" if column != "events" else "left")
    for s in status.steps:
        row = [str(s.step), str(s.weight_version), f"{s.mean_reward:.3f}", f"{s.step_time_s:.2f}",
               f"{s.tokens_per_second:.0f}", str(s.micro_batches), str(s.migrations),
               str(s.n_prem or "-"), f"{s.t_seed_s:.1f}",
               f"{s.published_changed:.1%}" if s.published_version else "-"]
        if serving is not None:
            served = serving.get(s.step)
            row += ["-" if served is None or served.attainment is None
                    else f"{served.attainment:.0%} of {served.requests}",
                    "-" if served is None else str(served.harvested_tokens)]
        if tail:
            row += [f"{s.round} {s.prompts_launched}", str(s.prompts_deferred),
                    str(s.tokens_discarded)]
        table.add_row(*row, "; ".join(events.get(s.step, [])))
    return table


def plot_run(status: tpb.TrainerStatus, events: dict[int, list[str]], path: Path,
             title: str = "GRPO on the addition task (tiny Qwen3, CPU)") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [s.step for s in status.steps]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    top.plot(steps, [s.mean_reward for s in status.steps], marker="o")
    top.set_ylabel("mean reward")
    top.set_title(title)
    bottom.bar(steps, [s.tokens_per_second for s in status.steps], color="tab:green")
    bottom.set_ylabel("tokens trained / s")
    bottom.set_xlabel("step")
    for step, texts in events.items():
        if any("SIGKILL" in t for t in texts):
            for ax in (top, bottom):
                ax.axvline(step, color="tab:red", linestyle="--", linewidth=1)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_report(status: tpb.TrainerStatus, events: dict[int, list[str]], out: Path,
                 plot_name: str, title: str | None = None,
                 serving: dict[int, StepServing] | None = None) -> str:
    """``steps.json`` (one object per step) and the plot under ``out``; says where they are.
    The plot needs matplotlib (the ``dev`` extra): a plain install writes the steps alone."""
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for s in status.steps:
        row = {"step": s.step, "weight_version": s.weight_version, "reward": s.mean_reward,
               "step_time_s": s.step_time_s, "tokens_per_second": s.tokens_per_second,
               "migrations": s.migrations, "n_prem": s.n_prem, "t_seed_s": s.t_seed_s,
               "events": events.get(s.step, [])}
        if s.round:
            row.update(round=s.round, prompts_launched=s.prompts_launched,
                       prompts_deferred=s.prompts_deferred, tokens_discarded=s.tokens_discarded)
        if serving is not None and (served := serving.get(s.step)) is not None:
            row.update(serving_requests=served.requests, serving_attained=served.attained,
                       harvested_tokens=served.harvested_tokens)
        rows.append(row)
    (out / "steps.json").write_text(json.dumps(rows, indent=1))
    if importlib.util.find_spec("matplotlib") is None:
        return f"steps in {out / 'steps.json'} (no plot: matplotlib is not installed)"
    plot_run(status, events, out / plot_name, *([title] if title else []))
    return f"plot {out / plot_name}, steps in {out / 'steps.json'}"


@app.command()
def main(steps: int = typer.Option(20, min=2, help="RL steps to train"),
         workers: int = typer.Option(3, min=2, help="rollout workers, the spot worker included"),
         prompts: int = typer.Option(8, min=1, help="P0: prompts per step"),
         samples: int = typer.Option(8, min=2, help="R0: samples per prompt"),
         lr: float = typer.Option(1e-2, help="learning rate"),
         preempt_at: str = typer.Option("3,14", help="steps in which the spot worker is "
                                                     "SIGKILLed mid-step; '' for none"),
         replace_after: int = typer.Option(1, min=1, help="steps after a kill until a new spot "
                                                          "process starts"),
         max_running: int = typer.Option(8, min=1, help="requests a worker runs at once"),
         step_delay_s: float = typer.Option(0.05, min=0.0, help="emulate slower accelerators: "
                                                                "seconds each engine step sleeps"),
         spot_step_delay_s: float = typer.Option(0.25, min=0.0, help="the same for the spot "
                                                 "worker, slower so the kill lands mid-step"),
         backend: str = typer.Option("deepspeed", help="trainer backend: deepspeed or torch"),
         coexecutor: bool = typer.Option(True, "--coexecutor/--no-coexecutor",
                                         help="a serving co-executor under a bursty trace, "
                                              "borrowed by the job for rollouts (ROSE)"),
         serving_rps: float = typer.Option(3.0, min=0.01, help="the co-executor's mean serving "
                                           "requests per second"),
         tail_batching: float = typer.Option(0.0, min=0.0, help="RollPacker's tail batching "
                                             "with eta_P = eta_R = this (e.g. 1.25; 0 = off): "
                                             "the table shows short and long rounds"),
         seed_role: bool = typer.Option(False, help="RLBoost's seed role: the trainer's own "
                                        "engine rolls out in each step's window T_seed, then "
                                        "hands its requests to the workers (the T_seed column)"),
         kill_manager_at: int = typer.Option(0, min=0, help="SIGKILL the leading rollout "
                                             "manager mid-rollout in this step (0: never); a "
                                             "standby takes over, the step resumes there, and "
                                             "the tokens generated twice are reported"),
         out: Path = typer.Option(Path("demo-out"), help="where the plot and step table go"),
         log_dir: Optional[Path] = typer.Option(None, help="service logs (default: a temp dir)"),
         min_rise: float = typer.Option(0.1, help="fail unless the mean reward of the last 3 "
                                                  "steps beats the first 3 by this much"),
         timeout: float = typer.Option(_TIME_LIMIT_S, help="give up after this many seconds "
                                                           "(the spec: 5 minutes on 2 cores)"),
         placement_jobs: int = typer.Option(0, min=0, help="WEAVE instead: this many GRPO jobs "
                                            "share one rollout worker and one training node "
                                            "under the placement scheduler (--steps each)"),
         engine: str = typer.Option("torch", help="the rollout workers' engine: torch, or vllm "
                                    "(vLLM v1; the demo then trains a `small` checkpoint it "
                                    "builds, since vLLM loads checkpoint directories)")
         ) -> None:
    """Run the demo and print a table per step; the plot goes to OUT/demo.png."""
    if placement_jobs:
        try:
            demo_placed.run(placement_jobs, steps, step_delay_s,
                            log_dir or Path(tempfile.mkdtemp(prefix="rlharvest-demo-")), timeout)
        except (TimeoutError, RuntimeError) as exc:
            console.print(f"[bold red]demo failed[/]: {exc}")
            raise typer.Exit(1) from None
        return
    if 0 < tail_batching < 1:
        raise typer.BadParameter(f"--tail-batching {tail_batching:g}: eta launches at least "
                                 "what trains, so give 1 or more (or 0 for off)")
    if engine not in ("torch", "vllm"):
        raise typer.BadParameter(f"--engine {engine!r}: torch or vllm", param_hint="--engine")
    schedule = PreemptionSchedule(parse_steps(preempt_at), replace_after)
    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="rlharvest-demo-"))
    model = demo_model(engine, log_dir)
    console.print(f"[bold]rlharvest demo[/]: {steps} steps of {prompts}x{samples} samples, "
                  f"{workers} workers (1 spot), spot preempted in steps {preempt_at or 'none'}; "
                  f"logs in {log_dir}")
    started = time.monotonic()
    try:
        run = _start_stack(log_dir, dict(
            workers=workers, steps=steps, prompts=prompts, samples=samples, lr=lr,
            backend=backend, max_running=max_running, step_delay_s=step_delay_s,
            spot_step_delay_s=spot_step_delay_s, coexecutor=coexecutor, serving_rps=serving_rps,
            tail_batching=tail_batching, seed_role=seed_role, kill_manager_at=kill_manager_at,
            engine=engine, model=model))
    except (TimeoutError, RuntimeError) as exc:  # a service never came up: stopped already
        console.print(f"[bold red]demo failed[/]: {exc}; logs in {log_dir}")
        raise typer.Exit(1) from None
    failover = ""
    try:
        status = asyncio.run(drive(run, schedule, steps, timeout))
        if run.killed_manager is not None:
            failover = asyncio.run(manager_death_report(run))
    except (TimeoutError, RuntimeError) as exc:  # over time, or a service died: say which
        console.print(f"[bold red]demo failed[/]: {exc}")
        raise typer.Exit(1) from None
    finally:
        run.stack.stop()
    if status.state == "failed":
        console.print(f"[bold red]training failed[/]: {status.error}; logs in {log_dir}")
        raise typer.Exit(1)
    serving = run.serving.steps if run.serving is not None else None
    console.print(step_table(status, run.events, serving=serving))
    report = write_report(status, run.events, out, "demo.png", serving=serving)
    rewards = [s.mean_reward for s in status.steps]
    failure = rise_failure(rewards, min_rise)
    if len(rewards) >= 2:
        first, last, k = reward_ends(rewards)
        console.print(f"reward {first:.3f} (first {k} steps) -> {last:.3f} (last {k}); "
                      f"{sum(s.migrations for s in status.steps)} migrations; "
                      f"{time.monotonic() - started:.0f}s in all; {report}")
    if failover:
        console.print(failover)
    elif kill_manager_at:
        console.print(f"[yellow]the manager was not killed[/]: the run ended before the "
                      f"manager was seen holding step {kill_manager_at}'s requests")
    if serving:
        requests = sum(x.requests for x in serving.values())
        attained = sum(x.attained for x in serving.values())
        console.print(f"co-executor: {requests} serving requests finished during the steps, "
                      f"{attained / max(requests, 1):.0%} within the SLOs (TTFT "
                      f"{_SERVING_SLO_S[0] * 1000:.0f} ms, TPOT {_SERVING_SLO_S[1] * 1000:.0f} "
                      f"ms); {sum(x.harvested_tokens for x in serving.values())} rollout tokens "
                      "harvested on it")
    if failure is not None:
        console.print(f"[bold red]demo failed[/]: {failure}")
        raise typer.Exit(1)


if __name__ == "__main__":
    app()
