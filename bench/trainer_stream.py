"""Streaming micro-batches vs train-after-rollout on a long-tail arrival distribution.

RollPacker §4.4 / RLBoost §4.1. Group completion times are simulated (long-tail lognormal
response lengths x a per-token decode time); every forward/backward/step is real and timed.
A step's time is found by replaying the measured compute against the simulated arrivals:
- baseline: training starts when the last group arrives, then runs m_b-group micro-batches;
- streaming m_b: a micro-batch starts once m_b groups have arrived and the trainer is free; only
  the micro-batch of the last groups and the optimizer step remain after the last arrival;
- streaming merged (what the trainer does): as streaming m_b, but when the trainer comes free
  every group that arrived meanwhile joins one micro-batch (RLBoost §4.1).
The decode time per token is calibrated so that rollout and training take similar time
(``--rollout-ratio``, the balanced case where the paper reports its largest gain).
All runs start from the same weights; the script checks their updates are equal.

    python bench/trainer_stream.py [--quick] [--backend torch|deepspeed] [--model tiny|small]
"""

from __future__ import annotations

import argparse
import copy
import os
import random
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "2")

import torch  # noqa: E402

from rlharvest.models.tiny_model import build_model  # noqa: E402
from rlharvest.models.tokenizer import PAD_ID  # noqa: E402
from rlharvest.services.trainer.backend import OptimConfig, make_backend  # noqa: E402
from rlharvest.services.trainer.grpo import LossConfig  # noqa: E402
from rlharvest.services.trainer.stream_trainer import (  # noqa: E402
    Completion,
    RewardedGroup,
    StreamingStep,
)


def make_groups(num_groups: int, group_size: int, max_len: int,
                seed: int) -> tuple[list[RewardedGroup], list[int]]:
    """Groups plus each group's longest response (what its arrival time scales with)."""
    rng = random.Random(seed)
    groups, longest = [], []
    for g in range(num_groups):
        comps, rewards = [], []
        for _ in range(group_size):
            length = min(max_len, max(4, int(rng.lognormvariate(3.0, 0.9))))
            prompt = [1] + [rng.randrange(3, 100) for _ in range(16)]
            tokens = [rng.randrange(3, 100) for _ in range(length)]
            comps.append(Completion(prompt, tokens, [-4.0] * length))
            rewards.append(float(rng.random() < 0.5))
        groups.append(RewardedGroup(g, comps, rewards))
        longest.append(max(len(c.completion_ids) for c in comps))
    return groups, longest


MODES = ("after", "fixed", "merged")


def run(backend_name: str, model: torch.nn.Module, groups: list[RewardedGroup],
        arrivals: list[float], m_b: int, mode: str) -> tuple[float, float, tuple[int, ...]]:
    """Returns (step time on the simulated timeline, total measured compute, groups per
    micro-batch). The trainer waits for the next group, then takes it, or in ``merged`` mode
    every group that has arrived by then, as the trainer loop does."""
    backend = make_backend(backend_name, model, OptimConfig(lr=0.1, optimizer="sgd"))
    step = StreamingStep(backend, num_groups=len(groups), group_size=len(groups[0].completions),
                         micro_batch_groups=m_b, loss=LossConfig(), pad_id=PAD_ID)
    order = sorted(range(len(groups)), key=lambda i: arrivals[i])
    last_arrival = arrivals[order[-1]]
    ready_at = [last_arrival if mode == "after" else a for a in arrivals]
    trainer_free, compute, taken = 0.0, 0.0, 0
    while taken < len(order):
        now = max(trainer_free, ready_at[order[taken]])
        burst = [i for i in order[taken:] if ready_at[i] <= now] if mode == "merged" \
            else [order[taken]]
        start = time.perf_counter()
        step.add_groups([groups[i] for i in burst])  # runs a micro-batch when m_b are ready
        took = time.perf_counter() - start
        compute += took
        trainer_free = now + took
        taken += len(burst)
    start = time.perf_counter()
    stats = step.finish()
    took = time.perf_counter() - start
    return max(last_arrival, trainer_free) + took, compute + took, stats.micro_batch_groups


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--backend", default="torch", choices=["torch", "deepspeed"])
    parser.add_argument("--model", default="tiny", choices=["tiny", "small"])
    parser.add_argument("--rollout-ratio", type=float, default=1.0,
                        help="rollout duration / training compute")
    parser.add_argument("--micro-batch-groups", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(2)
    num_groups, group_size, max_len, repeats = (8, 4, 96, 1) if args.quick else (16, 8, 256, 3)
    base = build_model(args.model, seed=0)
    print(f"model={args.model} backend={args.backend} groups={num_groups}x{group_size} "
          f"m_b={args.micro_batch_groups} rollout/train={args.rollout_ratio}")
    rows = []
    for rep in range(repeats):
        groups, longest = make_groups(num_groups, group_size, max_len, seed=rep)
        # Calibrate: one untimed warm-up run measures the training compute of this step.
        _, train_s, _ = run(args.backend, copy.deepcopy(base), groups, [0.0] * num_groups,
                            args.micro_batch_groups, "fixed")
        per_token = args.rollout_ratio * train_s / max(longest)
        arrivals = [per_token * n for n in longest]
        models = {mode: copy.deepcopy(base) for mode in MODES}
        times, cuts = {}, {}
        for mode in MODES:
            times[mode], _, cuts[mode] = run(args.backend, models[mode], groups, arrivals,
                                             args.micro_batch_groups, mode)
        diff = max((a - b).abs().max().item() for mode in MODES[1:]
                   for a, b in zip(models["after"].parameters(), models[mode].parameters()))
        rows.append((times, diff))
        print(f"  step {rep}: rollout {max(arrivals):.2f}s  train-after-rollout "
              f"{times['after']:.2f}s  streaming m_b {times['fixed']:.2f}s  streaming merged "
              f"{times['merged']:.2f}s (micro-batches of {list(cuts['merged'])} groups)  "
              f"max |param diff| {diff:.1e}")
    mean = {mode: sum(r[0][mode] for r in rows) / len(rows) for mode in MODES}
    speedup = {mode: sorted(r[0]["after"] / r[0][mode] for r in rows) for mode in MODES[1:]}
    print(f"mean step time: train-after-rollout {mean['after']:.2f}s, streaming m_b "
          f"{mean['fixed']:.2f}s, streaming merged {mean['merged']:.2f}s (updates identical: "
          f"max diff {max(r[1] for r in rows):.1e})")
    for mode, label in (("fixed", "streaming m_b"), ("merged", "streaming merged")):
        r = speedup[mode]
        print(f"train-after-rollout / {label}, per step: median {statistics.median(r):.2f}x "
              f"[{r[0]:.2f}-{r[-1]:.2f}] over {len(r)} steps (each step runs every mode)")

if __name__ == "__main__":
    main()
