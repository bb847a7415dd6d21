"""End to end on real processes: the three pipelines RollPacker compares (§6.2), same data.

The whole local stack (etcd, transfer agent, rollout manager, rollout workers, trainer; all
processes) trains the same prompts (``--data-prompts``; tail batching flushes its deferred queue
there) under three configurations:

- veRL-like: synchronous stages — rewards after the last completion, training after the last
  reward (``--pipeline sync``);
- RLHFuse+: rewards as completions arrive and the stream trainer's micro-batches as groups are
  rewarded (``--pipeline stream``, the default);
- RollPacker: the same plus tail batching (``--tail-batching``, eta_P = eta_R = 1.25).

Responses run the long-tailed lengths of the trainer's length model
(``trainer/load_model.py``: per-prompt difficulty x per-response noise, max/median
near 20x), engine steps cost a flat ``--step-delay-s`` (GPU-like: decode time barely depends on
the batch), and each reward takes ``--reward-delay-s`` (a verifier's latency) in a pool of
``--reward-concurrency``. Reported per
configuration, the runs interleaved and repeated: seconds to train the whole data, the ratio of
veRL-like to it (median [spread]), and the per-step breakdown — rollout (stream end), rewards
(last reward), the tail after rollout (step time - rollout) and training compute.

    python bench/e2e_tail_batching.py [--quick] [--repeats 3] [--prompts 40]
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
from rlharvest.common.pb import trainer_pb2 as tpb, trainer_pb2_grpc
from rlharvest.cli.launcher import LocalStack

COMMON = ["--lease-ttl", "2", "--json-logs"]
CONFIGS = {
    "veRL-like": ["--pipeline", "sync"],
    "RLHFuse+": ["--pipeline", "stream"],
    "RollPacker": ["--pipeline", "stream", "--tail-batching", "--eta-prompts", "1.25",
                   "--eta-responses", "1.25"],
}


@dataclass
class Outcome:
    seconds: float  # the steps' wall time, summed: the whole data trained
    steps: int
    rounds: str  # e.g. "6S 2L"
    rollout_s: float  # per step, means
    rewards_s: float
    tail_s: float
    train_s: float
    discarded: int


async def wait_trainer_done(endpoint: str, timeout: float) -> tpb.TrainerStatus:
    """The trainer's status once it is done (its steps trained); raises if it failed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            async with rpc.channel(endpoint) as chan:
                st = await trainer_pb2_grpc.TrainerStub(chan).GetStatus(
                    tpb.TrainerStatusRequest(), timeout=5)
        except Exception:  # noqa: BLE001 - still starting
            await asyncio.sleep(0.5)
            continue
        if st.state == "failed":
            raise RuntimeError(st.error)
        if st.state == "done":
            return st
        await asyncio.sleep(0.2)
    raise TimeoutError(f"not done in {timeout:.0f}s")


def run_case(name: str, flags: list[str], args, log_dir: Path) -> Outcome:
    stack = LocalStack(log_dir)
    stack.start_etcd()
    try:
        stack.start("transfer_agent", "agent", ["--agent-id", "agent-0", *COMMON])
        stack.start("rollout_manager", "manager", ["--port", str(free_port()),
                                                   "--stall-timeout-s", "30", *COMMON])
        for i in range(args.workers):
            stack.start("rollout_worker", f"w{i}", [
                "--worker-id", f"w{i}", "--torch-threads", "1", "--job", "default",
                "--agent-pull", "--max-running", str(args.max_running), "--max-len", "512",
                "--step-delay-s", str(args.step_delay_s), *COMMON])
        port = free_port()
        stack.start("trainer", "trainer", [
            "--port", str(port), "--backend", "torch", "--torch-threads", "1",
            "--prompts-per-step", str(args.p0), "--samples-per-prompt", str(args.r0),
            "--micro-batch-groups", "2", "--data-prompts", str(args.prompts),
            "--max-new-tokens", str(args.max_tokens),
            "--bench-length-median", str(args.length_median),
            "--bench-reward-delay-s", str(args.reward_delay_s), "--reward-concurrency", str(args.reward_concurrency),
            "--no-exit-when-done", *flags, *COMMON])
        st = asyncio.run(wait_trainer_done(f"127.0.0.1:{port}", args.timeout))
    finally:
        stack.stop()
    steps = list(st.steps)
    kinds = [s.round[:1].upper() for s in steps if s.round]
    return Outcome(
        seconds=sum(s.step_time_s for s in steps), steps=len(steps),
        rounds=(f"{kinds.count('S')}S {kinds.count('L')}L" if kinds else f"{len(steps)} plain"),
        rollout_s=statistics.mean(s.rollout_s for s in steps),
        rewards_s=statistics.mean(s.rewards_s for s in steps),
        tail_s=statistics.mean(s.step_time_s - s.rollout_s for s in steps),
        train_s=statistics.mean(s.train_compute_s for s in steps),
        discarded=sum(s.tokens_discarded for s in steps))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="16 prompts, one repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=40, help="the data: prompts trained")
    parser.add_argument("--p0", type=int, default=8)
    parser.add_argument("--r0", type=int, default=4)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--max-running", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=240)
    parser.add_argument("--length-median", type=float, default=16)
    parser.add_argument("--step-delay-s", type=float, default=0.01)
    parser.add_argument("--reward-delay-s", type=float, default=0.3)
    parser.add_argument("--reward-concurrency", type=int, default=8,
                        help="rewards computed at once (a verifier pool's size)")
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args()
    if args.quick:
        args.prompts, args.repeats = 16, 1
    log_root = Path(tempfile.mkdtemp(prefix="rlharvest-e2e-tail-"))
    results: dict[str, list[Outcome]] = {name: [] for name in CONFIGS}
    for repeat in range(args.repeats):  # interleaved: each repeat runs every configuration
        for name, flags in CONFIGS.items():
            outcome = run_case(name, flags, args, log_root / f"{name}-{repeat}")
            results[name].append(outcome)
            print(f"repeat {repeat + 1} {name}: {outcome.seconds:.1f}s over {outcome.steps} "
                  f"steps ({outcome.rounds})", flush=True)
    print(f"\n{args.prompts} prompts, P0={args.p0} x R0={args.r0}, {args.workers} workers, "
          f"length median {args.length_median:g} (cap {args.max_tokens}), step delay "
          f"{args.step_delay_s:g}s, reward delay {args.reward_delay_s:g}s x "
          f"{args.reward_concurrency} at once, {args.repeats} "
          "repeats; per-step means of the last repeat\n")
    print("| configuration | seconds (median) | veRL-like / it | steps | rollout s | rewards s "
          "| tail after rollout s | train compute s | tokens discarded |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    base = results["veRL-like"]
    for name, outcomes in results.items():
        ratios = [b.seconds / o.seconds for b, o in zip(base, outcomes)]
        last = outcomes[-1]
        print(f"| {name} | {statistics.median(o.seconds for o in outcomes):.1f} | "
              f"{statistics.median(ratios):.2f}x [{min(ratios):.2f}-{max(ratios):.2f}] | "
              f"{last.rounds} | {last.rollout_s:.2f} | {last.rewards_s:.2f} | {last.tail_s:.2f} "
              f"| {last.train_s:.2f} | {last.discarded} |")
    print(f"\nlogs in {log_root}")


if __name__ == "__main__":
    main()
