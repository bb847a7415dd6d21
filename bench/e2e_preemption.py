"""End-to-end tokens trained/s with spot preemptions: migrate-on-loss vs none vs recompute.

Three runs of the whole local stack (etcd, transfer agent, rollout manager, 3 rollout workers,
trainer; all processes), each measured over the same steps after a warm-up step:

- none preempted (the baseline rate),
- one of the three workers (the spot one) SIGKILLed mid-step in every step in which a spot worker
  is up and holds requests, a replacement process started at once (it joins steps later: a
  process start costs seconds on this box) — the manager migrates the lost requests, tokens kept,
- the same, the replacement a warm standby (``--standby``: a worker process already running,
  its engine built and the job's versions pulled, that joins on SIGUSR1; a pool of them is
  started before the trainer, as standbys on other nodes would be), so the capacity is back at
  once,
- the same schedule with the manager's ``--recompute-on-loss`` baseline (lost requests restart
  from the prompt).

The cases run one after another in each round, rounds repeat, and each preempted case's ratio
to the unpreempted rate of its own round is printed as median [spread].

Rollout dominates on purpose (32-token completions, engine steps slowed by ``--step-delay-s`` to
emulate slower accelerators), so lost work shows. Target: preempted >= 0.9 x
unpreempted.

    python bench/e2e_preemption.py [--quick] [--steps N]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from rlharvest.common import rpc
from rlharvest.common.local_etcd import free_port
from rlharvest.common.pb import rollout_manager_pb2 as mpb, rollout_manager_pb2_grpc
from rlharvest.common.pb import trainer_pb2 as tpb, trainer_pb2_grpc
from rlharvest.cli.launcher import LocalStack

from rlharvest.sim.ratios import spread  # noqa: E402

COMMON = ["--lease-ttl", "2", "--json-logs"]


@dataclass
class Outcome:
    name: str
    tokens: int
    seconds: float
    kills: int
    migrations: int
    regenerated: int

    @property
    def rate(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)


async def _poll(trainer: str, manager: str):
    async with rpc.channel(trainer) as t, rpc.channel(manager) as m:
        st = await trainer_pb2_grpc.TrainerStub(t).GetStatus(tpb.TrainerStatusRequest(), timeout=5)
        ms = await rollout_manager_pb2_grpc.RolloutManagerStub(m).GetStatus(
            mpb.GetStatusRequest(), timeout=5)
        return st, ms


async def _standing_by(processes: list, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for proc in processes:
        while "standing by" not in proc.log_tail(200):
            assert proc.alive(), f"standby {proc.name} exited:\n{proc.log_tail()}"
            assert time.monotonic() < deadline, f"standby {proc.name} never stood by"
            await asyncio.sleep(0.2)


@dataclass(frozen=True)
class Case:
    label: str
    preempt: bool = False
    recompute: bool = False
    standby: bool = False


CASES = (Case("none preempted"), Case("spot preempted, migrate", preempt=True),
         Case("spot preempted, migrate, warm standby", preempt=True, standby=True),
         Case("spot preempted, recompute (baseline)", preempt=True, recompute=True))


async def run_case(name: str, args, case: Case, log_root: Path) -> Outcome:
    preempt, recompute = case.preempt, case.recompute
    stack = LocalStack(log_root / name)
    stack.start_etcd()
    try:
        stack.start("transfer_agent", "agent", ["--agent-id", "agent-0", *COMMON])
        manager_port, trainer_port = free_port(), free_port()
        stack.start("rollout_manager", "manager", [
            "--port", str(manager_port), "--stall-timeout-s", "5", *COMMON,
            *(["--recompute-on-loss"] if recompute else [])])
        worker_flags = ["--torch-threads", "1", "--job", "default", "--agent-pull",
                        "--max-running", "8", "--step-delay-s", str(args.step_delay_s), *COMMON]
        for i in range(2):
            stack.start("rollout_worker", f"w{i}", ["--worker-id", f"w{i}", *worker_flags])
        spot = stack.start("rollout_worker", "spot-0", ["--worker-id", "spot-0", "--kind", "spot",
                                                        *worker_flags])

        def spot_worker(generation: int):
            return stack.start("rollout_worker", f"spot-{generation}", [
                "--worker-id", f"spot-{generation}", "--kind", "spot", *worker_flags,
                *(["--standby"] if case.standby else [])])

        # Warm standbys run elsewhere in a real cluster: here they are all started, and have
        # built their engines, before the trainer starts, so no process start competes with
        # the measured steps for this box's two cores.
        standbys = [spot_worker(g) for g in range(1, args.steps + 1)] if case.standby else []
        await _standing_by(standbys, args.timeout)
        total_steps = args.steps + 1  # step 1 warms up (all processes up, caches hot)
        stack.start("trainer", "trainer", [
            "--port", str(trainer_port), "--steps", str(total_steps), "--backend", "deepspeed",
            "--max-new-tokens", str(args.max_new_tokens), "--torch-threads", "1",
            "--no-exit-when-done", *COMMON])
        trainer, manager = f"127.0.0.1:{trainer_port}", f"127.0.0.1:{manager_port}"
        kills, killed_in, generation = 0, set(), 0
        deadline = time.monotonic() + args.timeout
        while True:
            assert time.monotonic() < deadline, f"{name}: not done in {args.timeout}s"
            try:
                st, ms = await _poll(trainer, manager)
            except Exception:  # noqa: BLE001 - still starting
                await asyncio.sleep(0.5)
                continue
            assert st.state != "failed", st.error
            if st.state == "done":
                break
            cur = st.current
            if preempt and cur.step >= 2 and cur.step not in killed_in and spot.alive() and \
                    cur.phase == "rollout":
                held = next((w.assigned for w in ms.workers
                             if w.worker_id == spot.name and w.state == "healthy"), 0)
                if held:
                    spot.kill()  # SIGKILL mid-step, holding requests
                    kills += 1
                    killed_in.add(cur.step)
                    generation += 1
                    if standbys:  # warm: it joins now
                        spot = standbys.pop(0)
                        spot.activate()
                    else:
                        spot = spot_worker(generation)
            await asyncio.sleep(0.05)
        measured = [s for s in st.steps if s.step >= 2]
        return Outcome(name, sum(s.tokens for s in measured),
                       sum(s.step_time_s for s in measured), kills,
                       sum(s.migrations for s in measured), ms.tokens_regenerated)
    finally:
        stack.stop()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="3 measured steps per case")
    parser.add_argument("--steps", type=int, default=0, help="measured steps per case")
    parser.add_argument("--rounds", type=int, default=0, help="rounds of every case")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--step-delay-s", type=float, default=0.03)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" /
                        "e2e_preemption.md")
    args = parser.parse_args()
    args.steps = args.steps or (3 if args.quick else 6)
    args.rounds = args.rounds or (1 if args.quick else 3)
    log_root = Path(tempfile.mkdtemp(prefix="rlharvest-e2e-"))
    runs: dict[str, list[Outcome]] = {case.label: [] for case in CASES}
    for round_ in range(args.rounds):
        for i, case in enumerate(CASES):
            name = f"r{round_}-{i}-{case.label.split(',')[0].replace(' ', '-')}"
            runs[case.label].append(asyncio.run(run_case(name, args, case, log_root)))
            print(f"round {round_}: {case.label}: {runs[case.label][-1].rate:.0f} tokens/s",
                  flush=True)
    base = runs[CASES[0].label]
    lines = [
        "| run | steps x rounds | kills | migrations | tokens regenerated | tokens trained/s "
        "(median) | ratio to none, median [spread] |",
        "| --- | --- | --- | --- | --- | --- | --- |"]
    for case in CASES:
        mine = runs[case.label]
        ratios = [r.rate / b.rate for r, b in zip(mine, base)]
        lines.append(f"| {case.label} | {args.steps} x {args.rounds} | "
                     f"{sum(r.kills for r in mine)} | {sum(r.migrations for r in mine)} | "
                     f"{sum(r.regenerated for r in mine)} | "
                     f"{statistics.median(r.rate for r in mine):.0f} | {spread(ratios)} |")
    table = "\n".join(lines)
    print(table)
    print(f"\ntarget: preempted >= 0.9x unpreempted; logs in {log_root}")
    if not args.quick:
        args.out.write_text(
            "# e2e_preemption — tokens trained/s with a spot worker SIGKILLed mid-step\n\n"
            f"`python bench/e2e_preemption.py` (2-core shared CPU box; 3 workers, 8x8 samples x "
            f"{args.max_new_tokens} tokens, step delay {args.step_delay_s}s, DeepSpeed trainer; "
            f"first step excluded as warm-up; {args.rounds} rounds, cases in turn).\n\n"
            f"{table}\n")


if __name__ == "__main__":
    main()
