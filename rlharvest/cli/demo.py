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
import tempfile
import time
from pathlib import Path
from typing import Optional

import typer

from rlharvest.common import rpc
from rlharvest.common.local_etcd import free_port
from rlharvest.common.pb import trainer_pb2 as tpb
from rlharvest.cli import demo_placed
from rlharvest.cli.demo_serving import DemoServing, StepServing
from rlharvest.cli.driver import PreemptionSchedule, Run, console, drive, manager_death_report, \
    parse_steps
from rlharvest.cli.launcher import LocalStack
from rlharvest.cli.report import reward_ends, rise_failure, step_table, write_report

app = typer.Typer(add_completion=False, help=__doc__)
_TIME_LIMIT_S = 300.0  # a handful of steps within 5 minutes on 2 cores
# The co-executor's SLOs: what a serving model this small answers well within on 2 busy cores.
_SERVING_SLO_S = (1.5, 0.3)


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
    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="rlharvest-demo-"))
    if placement_jobs:
        _fail_on_error(lambda: demo_placed.run(placement_jobs, steps, step_delay_s, log_dir,
                                               timeout))
        return
    _check_options(tail_batching, engine)
    schedule = PreemptionSchedule(parse_steps(preempt_at), replace_after)
    console.print(f"[bold]rlharvest demo[/]: {steps} steps of {prompts}x{samples} samples, "
                  f"{workers} workers (1 spot), spot preempted in steps {preempt_at or 'none'}; "
                  f"logs in {log_dir}")
    started = time.monotonic()
    args = dict(workers=workers, steps=steps, prompts=prompts, samples=samples, lr=lr,
                backend=backend, max_running=max_running, step_delay_s=step_delay_s,
                spot_step_delay_s=spot_step_delay_s, coexecutor=coexecutor,
                serving_rps=serving_rps, tail_batching=tail_batching, seed_role=seed_role,
                kill_manager_at=kill_manager_at, engine=engine,
                model=demo_model(engine, log_dir))
    # A service that never came up: the stack is stopped already.
    run = _fail_on_error(lambda: _start_stack(log_dir, args), f"; logs in {log_dir}")
    status, failover = _fail_on_error(lambda: _drive_to_end(run, schedule, steps, timeout))
    if status.state == "failed":
        console.print(f"[bold red]training failed[/]: {status.error}; logs in {log_dir}")
        raise typer.Exit(1)
    _summarize(run, status, out, failover, kill_manager_at, time.monotonic() - started)
    failure = rise_failure([s.mean_reward for s in status.steps], min_rise)
    if failure is not None:
        console.print(f"[bold red]demo failed[/]: {failure}")
        raise typer.Exit(1)


def _fail_on_error(call, where: str = ""):
    """``call()``; a timeout or a dead service ends the demo with exit 1 and says which."""
    try:
        return call()
    except (TimeoutError, RuntimeError) as exc:
        console.print(f"[bold red]demo failed[/]: {exc}{where}")
        raise typer.Exit(1) from None


def _check_options(tail_batching: float, engine: str) -> None:
    if 0 < tail_batching < 1:
        raise typer.BadParameter(f"--tail-batching {tail_batching:g}: eta launches at least "
                                 "what trains, so give 1 or more (or 0 for off)")
    if engine not in ("torch", "vllm"):
        raise typer.BadParameter(f"--engine {engine!r}: torch or vllm", param_hint="--engine")


def _drive_to_end(run: Run, schedule: PreemptionSchedule, steps: int,
                  timeout: float) -> tuple[tpb.TrainerStatus, str]:
    """The trainer's final status and, after ``--kill-manager-at``, the failover's report; the
    stack is stopped either way."""
    try:
        status = asyncio.run(drive(run, schedule, steps, timeout))
        failover = asyncio.run(manager_death_report(run)) if run.killed_manager else ""
        return status, failover
    finally:
        run.stack.stop()


def _summarize(run: Run, status: tpb.TrainerStatus, out: Path, failover: str,
               kill_manager_at: int, seconds: float) -> None:
    serving = run.serving.steps if run.serving is not None else None
    console.print(step_table(status, run.events, serving=serving))
    report = write_report(status, run.events, out, "demo.png", serving=serving)
    rewards = [s.mean_reward for s in status.steps]
    if len(rewards) >= 2:
        first, last, k = reward_ends(rewards)
        console.print(f"reward {first:.3f} (first {k} steps) -> {last:.3f} (last {k}); "
                      f"{sum(s.migrations for s in status.steps)} migrations; "
                      f"{seconds:.0f}s in all; {report}")
    if failover:
        console.print(failover)
    elif kill_manager_at:
        console.print(f"[yellow]the manager was not killed[/]: the run ended before the "
                      f"manager was seen holding step {kill_manager_at}'s requests")
    if serving:
        console.print(_serving_summary(serving))


def _serving_summary(serving: dict[int, StepServing]) -> str:
    requests = sum(x.requests for x in serving.values())
    attained = sum(x.attained for x in serving.values())
    return (f"co-executor: {requests} serving requests finished during the steps, "
            f"{attained / max(requests, 1):.0%} within the SLOs (TTFT "
            f"{_SERVING_SLO_S[0] * 1000:.0f} ms, TPOT {_SERVING_SLO_S[1] * 1000:.0f} ms); "
            f"{sum(x.harvested_tokens for x in serving.values())} rollout tokens harvested "
            "on it")


if __name__ == "__main__":
    app()
