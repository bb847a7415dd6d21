"""RLBoost's seeding window end to end on real processes: the trainer's seed role vs none.

The whole local stack (etcd, transfer agent, rollout manager, remote spot workers, trainer; all
processes) trains the same steps under three configurations, interleaved and repeated:

- full: the trainer's seed role with Algorithm 1 (``--seed-role``; its engine rolls out during
  [0, T_seed], then hands its requests with their tokens to the remote workers; T_seed adapts)
  and ``--remote`` spot workers;
- no seeding: the same remote workers, the trainer only trains (T_seed = 0);
- co-located only: the seed role and no remote worker (the veRL analogue: the training
  cluster rolls out everything itself).

Responses run the trainer's length model (long-tailed, ``trainer/load_model.py``); every engine
step — the remote workers' and the seed engine's alike — costs ``--step-delay-s`` more
(GPU-like: one engine is one GPU's worth of rollout, whoever owns it).
Reported: tokens trained per second of step time (the first step excluded as warm-up), the
ratio full / configuration (median [spread]), the mean T_seed and the requests handed over.

``--env frozen_lake``: agentic steps instead. Each sample is a multi-turn trajectory,
one ``Generate`` per turn over the whole history; the trainer holds the step's seeding window
open on the manager (``HoldSeedWindow``) while the turns play, so the seed engine takes turns
during [0, T_seed] and its running turns move to the remote workers with their tokens at
T_seed. Every engine keeps a prefix cache (turn k+1 re-reads turn k's history).

    python bench/seeding_e2e.py [--quick] [--repeats 3] [--steps 6]
    python bench/seeding_e2e.py --env frozen_lake [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path

import sys

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.e2e_tail_batching import wait_trainer_done  # noqa: E402
from rlharvest.common.local_etcd import free_port  # noqa: E402
from rlharvest.cli.launcher import LocalStack  # noqa: E402
from tests.integration.test_manager import scrape  # noqa: E402

COMMON = ["--lease-ttl", "2", "--json-logs"]
SEED = ["--seed-role", "--seed-window-init-s", "0.5", "--seed-max-running", "16"]
CONFIGS = {"full": (SEED, True), "no seeding": ([], True), "co-located only": (SEED, False)}


@dataclass
class Outcome:
    rate: float  # tokens trained / s of step time
    t_seed: float  # mean window of the measured steps
    handed: float  # requests handed from the seed worker to remote workers
    seed_hits: float  # requests the seed engine started after a cached prefix (agentic)


def run_case(flags: list[str], remote: bool, args, log_dir: Path) -> Outcome:
    stack = LocalStack(log_dir)
    stack.start_etcd()
    try:
        stack.start("transfer_agent", "agent", ["--agent-id", "agent-0", *COMMON])
        manager_metrics = free_port()
        stack.start("rollout_manager", "manager", ["--port", str(free_port()), "--metrics-port",
                                                   str(manager_metrics), *COMMON])
        agentic = ["--kv-pages", "2048", "--prefix-cache"] if args.env else []
        for i in range(args.remote if remote else 0):
            stack.start("rollout_worker", f"spot-{i}", [
                "--worker-id", f"spot-{i}", "--kind", "spot", "--torch-threads", "1",
                "--job", "default", "--agent-pull", "--max-running", str(args.remote_max_running),
                "--step-delay-s", str(args.step_delay_s), *agentic, *COMMON])
        port, trainer_metrics = free_port(), free_port()
        task = ["--env", args.env, "--env-max-turns", str(args.env_max_turns),
                "--max-new-tokens", "4"] if args.env else [
            "--max-new-tokens", str(args.max_tokens), "--bench-length-median",
            str(args.length_median)]
        stack.start("trainer", "trainer", [
            "--port", str(port), "--metrics-port", str(trainer_metrics), "--backend", "torch",
            "--torch-threads", "1",
            "--steps", str(args.steps), "--prompts-per-step", "8", "--samples-per-prompt", "4",
            *task, "--instance-cap", "auto", "--no-exit-when-done",
            "--bench-seed-step-delay-s", str(args.step_delay_s),
            *flags, *COMMON])
        st = asyncio.run(wait_trainer_done(f"127.0.0.1:{port}", args.timeout))
        handed = scrape(manager_metrics).get("rlh_manager_seed_handoffs_total", 0.0)
        seed_hits = scrape(trainer_metrics).get("rlh_worker_prefix_cache_hits_total", 0.0)
    finally:
        stack.stop()
    measured = [s for s in st.steps if s.step > 1]
    # t_seed_s is the next step's window: the window of step k is the summary of step k-1.
    windows = [s.t_seed_s for s in st.steps if s.step < len(st.steps)][1:]
    return Outcome(sum(s.tokens for s in measured) / sum(s.step_time_s for s in measured),
                   statistics.mean(windows) if windows else 0.0, handed, seed_hits)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="3 steps, one repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--remote", type=int, default=2, help="remote spot workers")
    parser.add_argument("--remote-max-running", type=int, default=8,
                        help="requests a remote worker runs at once (the seed engine: 16)")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--length-median", type=float, default=24)
    parser.add_argument("--step-delay-s", type=float, default=0.02)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--env", default="", help="agentic steps in this environment "
                        "(e.g. frozen_lake) instead of single-turn responses")
    parser.add_argument("--env-max-turns", type=int, default=6)
    args = parser.parse_args()
    if args.quick:
        args.steps, args.repeats = 3, 1
    log_root = Path(tempfile.mkdtemp(prefix="rlharvest-seeding-e2e-"))
    results: dict[str, list[Outcome]] = {name: [] for name in CONFIGS}
    for repeat in range(args.repeats):  # interleaved
        for name, (flags, remote) in CONFIGS.items():
            outcome = run_case(flags, remote, args, log_root / f"{name}-{repeat}".replace(" ", "-"))
            results[name].append(outcome)
            print(f"repeat {repeat + 1} {name}: {outcome.rate:.0f} tokens/s, mean T_seed "
                  f"{outcome.t_seed:.2f}s, {outcome.handed:.0f} requests handed over, "
                  f"{outcome.seed_hits:.0f} seed-engine prefix hits",
                  flush=True)
    task = (f"{args.env} trajectories of at most {args.env_max_turns} turns" if args.env else
            f"length median {args.length_median:g} (cap {args.max_tokens})")
    print(f"\n{args.steps} steps of 8x4 (first excluded), {args.remote} remote spot workers x "
          f"{args.remote_max_running} slots "
          f"(every engine +{args.step_delay_s:g}s per step), {task}, {args.repeats} repeats\n")
    print("| configuration | tokens trained/s (median) | full / it | mean T_seed s | handed over |")
    print("| --- | --- | --- | --- | --- |")
    full = results["full"]
    for name, outcomes in results.items():
        ratios = [f.rate / o.rate for f, o in zip(full, outcomes)]
        print(f"| {name} | {statistics.median(o.rate for o in outcomes):.0f} | "
              f"{statistics.median(ratios):.2f}x [{min(ratios):.2f}-{max(ratios):.2f}] | "
              f"{statistics.mean(o.t_seed for o in outcomes):.2f} | "
              f"{statistics.mean(o.handed for o in outcomes):.0f} |")
    print(f"\nlogs in {log_root}")


if __name__ == "__main__":
    main()
