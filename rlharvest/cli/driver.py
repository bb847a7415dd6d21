"""The driver the demos and ``rlharvest train`` share: watch a running stack's trainer step by
step with a progress bar per step, and act on the stack while it trains (a spot worker SIGKILLed
mid-step and replaced, the leading manager SIGKILLed mid-rollout).

The preemption schedule is pure; ``drive`` polls the trainer's and the leading manager's status
over gRPC and applies the schedule's actions to the processes of a ``LocalStack``.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from dataclasses import dataclass, field

import grpc
import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from rlharvest.common import observability, registry, rpc
from rlharvest.common.pb import rollout_manager_pb2 as mpb, rollout_manager_pb2_grpc
from rlharvest.common.pb import trainer_pb2 as tpb, trainer_pb2_grpc
from rlharvest.cli.demo_placed import trainer_status
from rlharvest.cli.demo_serving import DemoServing
from rlharvest.cli.launcher import LocalStack, ServiceProcess

# Piped (CI logs, `| tee`), rich would squeeze the step table into 80 columns.
console = Console(width=None if sys.stdout.isatty() else 160)
_POLL_S = 0.05


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


# ---- driving it -------------------------------------------------------------------------------

class _StepBars:
    """A progress bar per step: opened when the trainer starts the step, closed with its reward
    (and the co-executor's share of it) once the step is in the trainer's history."""

    def __init__(self, steps: int) -> None:
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(),
                                 TextColumn("{task.completed:.0f}/{task.total:.0f} completions"),
                                 TextColumn("{task.fields[info]}"), TimeElapsedColumn(),
                                 console=console)
        self._steps = steps
        self._bars: dict[int, TaskID] = {}
        self._closed: set[int] = set()

    async def update(self, run: Run, st: tpb.TrainerStatus) -> None:
        for done in st.steps:  # close finished steps (a quick one may have no bar)
            if done.step in self._closed:
                continue
            self._closed.add(done.step)
            served = await _close_serving(run, done.step)
            bar = self._bars.get(done.step)
            if bar is not None:
                self.progress.update(bar, completed=self.progress.tasks[bar].total,
                                     info=f"reward {done.mean_reward:.3f}{served}")
                self.progress.stop_task(bar)
        cur = st.current
        if st.state != "training" or not cur.step:
            return
        if cur.step not in self._bars:
            self._bars[cur.step] = self.progress.add_task(
                f"step {cur.step:>3}/{self._steps} v{cur.weight_version}", total=cur.samples,
                info="")
        self.progress.update(self._bars[cur.step], completed=cur.completions,
                             info=f"{cur.phase}, {cur.tokens_generated} tokens")


async def drive(run: Run, schedule: PreemptionSchedule, steps: int,
                timeout: float) -> tpb.TrainerStatus:
    """Watch the run until its trainer is done or failed, acting on ``schedule`` meanwhile;
    raises TimeoutError past ``timeout`` and RuntimeError when a service died."""
    deadline = time.monotonic() + timeout
    bars = _StepBars(steps)
    known_spots: set[str] = set()
    background: list[asyncio.Task] = []
    traffic: list[asyncio.Task] = []  # the co-executor's serving traffic, once started
    async with contextlib.AsyncExitStack() as channels:
        stub = trainer_pb2_grpc.TrainerStub(
            await channels.enter_async_context(rpc.channel(run.trainer_endpoint)))
        managers = [rollout_manager_pb2_grpc.RolloutManagerStub(
            await channels.enter_async_context(rpc.channel(endpoint)))
            for endpoint in run.manager_endpoints]
        if run.kill_manager_at:
            background.append(asyncio.create_task(kill_manager_in_step(run, managers[0])))
        try:
            with bars.progress:
                starting = bars.progress.add_task("starting the stack", total=1, info="")
                while True:
                    st = await _poll_trainer(run, stub, deadline, timeout)
                    if st is None:
                        continue
                    bars.progress.update(starting, visible=False)
                    if run.serving is not None and not traffic:  # from the first step on
                        traffic.append(asyncio.create_task(run.serving.run(),
                                                           name="serving traffic"))
                    await bars.update(run, st)
                    await _preempt(run, schedule, st.current, managers[run.leader], known_spots)
                    if st.state in ("done", "failed"):
                        return st
                    await asyncio.sleep(_POLL_S)
        finally:
            for task in (*background, *traffic):
                task.cancel()


async def _poll_trainer(run: Run, stub: trainer_pb2_grpc.TrainerStub, deadline: float,
                        timeout: float) -> tpb.TrainerStatus | None:
    """The trainer's status once it started its steps; None (after a pause) until then."""
    _check_alive(run)
    if time.monotonic() > deadline:
        raise TimeoutError(f"the run did not finish within {timeout:.0f}s; logs in "
                           f"{run.stack.log_dir}")
    st = await trainer_status(stub)
    if st is None or st.state == "starting":
        await asyncio.sleep(0.2)
        return None
    return st


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
