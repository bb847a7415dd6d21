"""Async rewards with RollPacker's adaptive timeout vs a synchronous reward stage with a fixed
timeout, on a code task where some candidates hang (RollPacker §4.3, Figure 14c).

Timeouts are scaled down 10x from the paper so the run is short: fixed timeout / T_max 3 s
(paper: 30 s), lambda 1.5 as in the paper, T_min 0.5 s (paper 2 s; 0.2 s would be the exact
10x scale, but Python start-up on a loaded 2-core box can take that long for a correct run).
Rollout is simulated: candidates arrive over ``--rollout-s`` seconds with a long tail. Every
candidate really runs in the sandbox. Hanging candidates sleep rather than spin, to spare the
shared CPUs; to the timeout they look the same. Anchors carry over between steps as in training.

    python bench/trainer_rewards.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

from rlharvest.services.trainer.rewards.adaptive_timeout import AdaptiveTimeout, TimeoutPolicy
from rlharvest.services.trainer.rewards.pool import RewardPool, RewardRequest
from rlharvest.services.trainer.rewards.sandbox import SandboxLimits, StdioCase, run_case

CORRECT = "import time, sys\nn = int(sys.stdin.read())\ntime.sleep({work})\nprint(n * (n + 1) // 2)\n"
WRONG = "import sys\nn = int(sys.stdin.read())\nprint(n * n)\n"
HANG = "import time\ntime.sleep(3600)\n"
FIXED_TIMEOUT_S = 3.0
POLICY = TimeoutPolicy(t_min_s=0.5, t_max_s=FIXED_TIMEOUT_S, slack=1.5)


def make_candidates(count: int, hang_fraction: float, rollout_s: float,
                    seed: int) -> list[tuple[float, RewardRequest]]:
    """(arrival time, request) pairs; prompts are test-case ids shared across candidates."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        case = f"case-{i % 4}"
        kind = rng.random()
        if kind < hang_fraction:
            code = HANG
        elif kind < hang_fraction + 0.2:
            code = WRONG
        else:
            code = CORRECT.format(work=round(rng.uniform(0.02, 0.15), 3))
        arrival = min(rollout_s, rng.expovariate(3.0 / rollout_s))  # long tail, capped
        out.append((arrival, RewardRequest(f"s{i}", case, code, str(10 * 11 // 2))))
    out.sort(key=lambda pair: pair[0])
    out[-1] = (rollout_s, out[-1][1])  # the rollout ends with its slowest response
    return out


def code_reward(timeouts: AdaptiveTimeout | None):
    def reward(prompt: str, completion: str, reference: str) -> float:
        wall = timeouts.timeout_for(prompt) if timeouts else FIXED_TIMEOUT_S
        result = run_case(completion, StdioCase(prompt, "10", reference),
                          SandboxLimits(wall_s=wall, cpu_s=wall + 1))
        if timeouts:
            timeouts.observe(prompt, result.elapsed_s, result.passed)
        return 1.0 if result.passed else 0.0
    return reward


async def one_step(candidates: list[tuple[float, RewardRequest]], asynchronous: bool,
                   timeouts: AdaptiveTimeout | None, concurrency: int) -> tuple[float, float]:
    """Seconds from rollout start until every reward is known, and the total reward."""
    pool = RewardPool(code_reward(timeouts), max_concurrency=concurrency,
                      timeout_s=FIXED_TIMEOUT_S + 5)
    start = time.perf_counter()

    async def arrive_then_score(arrival: float, request: RewardRequest):
        await asyncio.sleep(max(0.0, start + arrival - time.perf_counter()))
        return await pool.score(request)

    if asynchronous:
        outcomes = await asyncio.gather(*(arrive_then_score(a, r) for a, r in candidates))
    else:
        await asyncio.sleep(candidates[-1][0])  # the reward stage waits for the whole rollout
        outcomes = await pool.score_all([r for _, r in candidates])
    return time.perf_counter() - start, sum(o.reward for o in outcomes)


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--hang-fraction", type=float, default=0.15)
    args = parser.parse_args()
    count, steps, rollout_s = (16, 1, 2.0) if args.quick else (32, 3, 4.0)
    print(f"{count} candidates/step, {args.hang_fraction:.0%} hang, rollout {rollout_s}s, "
          f"{args.concurrency} sandboxes, fixed timeout {FIXED_TIMEOUT_S}s (paper: 30s)")
    configs = [("sync + fixed timeout (baseline)", False, False),
               ("async + fixed timeout", True, False),
               ("async + adaptive timeout", True, True)]
    # One controller per configuration for the whole run: its anchors carry across steps.
    timeouts = {name: AdaptiveTimeout(POLICY) if adaptive else None
                for name, _, adaptive in configs}
    times: dict[str, list[float]] = {name: [] for name, *_ in configs}
    for step in range(steps):  # every configuration runs each step: noise hits all alike
        candidates = make_candidates(count, args.hang_fraction, rollout_s, seed=step)
        for name, asynchronous, _ in configs:
            elapsed, reward = await one_step(candidates, asynchronous, timeouts[name],
                                             args.concurrency)
            times[name].append(elapsed)
            print(f"  {name:34s} step {step}: rollout+reward {elapsed:5.2f}s  "
                  f"total reward {reward:.0f}")
    base = times[configs[0][0]]
    for name, *_ in configs:
        speedups = sorted(b / t for b, t in zip(base, times[name]))
        print(f"{name:34s} {sum(times[name]):6.2f}s  speedup per step: median "
              f"{statistics.median(speedups):.2f}x [{speedups[0]:.2f}-{speedups[-1]:.2f}]")

if __name__ == "__main__":
    asyncio.run(main())
