"""End-to-end tokens trained/s with spot preemptions: migrate-on-loss vs none vs recompute.

Three runs of the whole local stack (etcd, transfer agent, rollout manager, 3 rollout workers,
trainer; all processes), each measured over the same steps after a warm-up step:

- none preempted (the baseline rate),
- one of the three workers (the spot one) SIGKILLed mid-step in every step in which a spot worker
  is up and holds requests, a replacement process started at once (it joins steps later: a
  process start costs seconds on this box) — the manager migrates the lost requests, tokens kept,
- the same schedule with the manager's ``--recompute-on-loss`` baseline (lost requests restart
  from the prompt).

Rollout dominates on purpose (32-token completions, engine steps slowed by ``--step-delay-s`` to
emulate slower accelerators), so lost work shows. Target: preempted >= 0.8 x unpreempted.

    python bench/e2e_preemption.py [--quick] [--steps N]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from rlharvest.common import rpc
from rlharvest.common.local_etcd import free_port
from rlharvest.common.pb import rollout_manager_pb2 as mpb, rollout_manager_pb2_grpc
from rlharvest.common.pb import trainer_pb2 as tpb, trainer_pb2_grpc
from rlharvest.services.launcher import LocalStack
from rlharvest.services.rollout_manager.config import ManagerConfig

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


async def run_case(name: str, args, preempt: bool, recompute: bool, log_root: Path) -> Outcome:
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
                    spot = stack.start("rollout_worker", f"spot-{generation}", [
                        "--worker-id", f"spot-{generation}", "--kind", "spot", *worker_flags])
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
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--step-delay-s", type=float, default=0.03)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" /
                        "e2e_preemption.md")
    args = parser.parse_args()
    args.steps = args.steps or (3 if args.quick else 10)
    log_root = Path(tempfile.mkdtemp(prefix="rlharvest-e2e-"))
    cases = [("none preempted", False, False), ("spot preempted, migrate", True, False)]
    if "recompute_on_loss" in ManagerConfig.model_fields:
        cases.append(("spot preempted, recompute (baseline)", True, True))
    else:
        print("SKIPPED recompute baseline: the manager has no recompute_on_loss option here")
    results = [asyncio.run(run_case(n.split(",")[0].replace(" ", "-") + str(i), args, p, r,
                                    log_root)) for i, (n, p, r) in enumerate(cases)]
    for (label, _, _), result in zip(cases, results):
        result.name = label
    base = results[0].rate
    lines = [
        "| run | steps | kills | migrations | tokens regenerated | tokens trained/s | ratio |",
        "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        lines.append(f"| {r.name} | {args.steps} | {r.kills} | {r.migrations} | {r.regenerated} "
                     f"| {r.rate:.0f} | {r.rate / base:.2f}x |")
    table = "\n".join(lines)
    print(table)
    print(f"\npreempted / unpreempted: {results[1].rate / base:.2f} (target >= 0.8); logs in "
          f"{log_root}")
    if not args.quick:
        args.out.write_text(
            "# e2e_preemption — tokens trained/s with a spot worker SIGKILLed mid-step\n\n"
            f"`python bench/e2e_preemption.py --steps {args.steps}` (2-core shared CPU box; "
            f"3 workers, 8x8 samples x {args.max_new_tokens} tokens, step delay "
            f"{args.step_delay_s}s, DeepSpeed trainer; first step excluded as warm-up).\n\n"
            f"{table}\n")


if __name__ == "__main__":
    main()
