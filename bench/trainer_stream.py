"""Streaming micro-batches vs train-after-rollout on a long-tail arrival distribution.

RollPacker §4.4 / RLBoost §4.1. Group completion times are simulated (long-tail lognormal
response lengths x a per-token decode time); every forward/backward/step is real and timed.
A step's time is found by replaying the measured compute against the simulated arrivals:
- baseline: training starts when the last group arrives, then runs all micro-batches;
- streaming: a micro-batch starts once m_b groups have arrived and the trainer is free; only
  the micro-batch of the last groups and the optimizer step remain after the last arrival.
The decode time per token is calibrated so that rollout and training take similar time
(``--rollout-ratio``, the balanced case where the paper reports its largest gain).
Both runs start from the same weights; the script checks their updates are equal.

    python bench/trainer_stream.py [--quick] [--backend torch|deepspeed] [--model tiny|small]
"""

from __future__ import annotations

import argparse
import copy
import os
import random
import time

os.environ.setdefault("OMP_NUM_THREADS", "2")

import torch  # noqa: E402

from rlharvest.common.tiny_model import build_model  # noqa: E402
from rlharvest.common.tokenizer import PAD_ID  # noqa: E402
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


def run(backend_name: str, model: torch.nn.Module, groups: list[RewardedGroup],
        arrivals: list[float], m_b: int, streaming: bool) -> tuple[float, float]:
    """Returns (step time on the simulated timeline, total measured compute)."""
    backend = make_backend(backend_name, model, OptimConfig(lr=0.1, optimizer="sgd"))
    step = StreamingStep(backend, num_groups=len(groups), group_size=len(groups[0].completions),
                         micro_batch_groups=m_b, loss=LossConfig(), pad_id=PAD_ID)
    order = sorted(range(len(groups)), key=lambda i: arrivals[i])
    last_arrival = arrivals[order[-1]]
    trainer_free, compute = 0.0, 0.0
    for i in order:
        ready_at = arrivals[i] if streaming else last_arrival
        start = time.perf_counter()
        step.add_group(groups[i])  # runs a micro-batch when m_b groups are ready
        took = time.perf_counter() - start
        compute += took
        trainer_free = max(ready_at, trainer_free) + took
    start = time.perf_counter()
    step.finish()
    took = time.perf_counter() - start
    return max(last_arrival, trainer_free) + took, compute + took


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
        _, train_s = run(args.backend, copy.deepcopy(base), groups, [0.0] * num_groups,
                         args.micro_batch_groups, streaming=False)
        per_token = args.rollout_ratio * train_s / max(longest)
        arrivals = [per_token * n for n in longest]
        after_model, stream_model = copy.deepcopy(base), copy.deepcopy(base)
        after, _ = run(args.backend, after_model, groups, arrivals, args.micro_batch_groups,
                       streaming=False)
        stream, _ = run(args.backend, stream_model, groups, arrivals, args.micro_batch_groups,
                        streaming=True)
        diff = max((a - b).abs().max().item()
                   for a, b in zip(after_model.parameters(), stream_model.parameters()))
        rows.append((max(arrivals), after, stream, diff))
        print(f"  step {rep}: rollout {max(arrivals):.2f}s  train-after-rollout {after:.2f}s  "
              f"streaming {stream:.2f}s  speedup {after / stream:.2f}x  "
              f"max |param diff| {diff:.1e}")
    after_mean = sum(r[1] for r in rows) / len(rows)
    stream_mean = sum(r[2] for r in rows) / len(rows)
    print(f"mean step time: train-after-rollout {after_mean:.2f}s, streaming {stream_mean:.2f}s "
          f"-> speedup {after_mean / stream_mean:.2f}x (update identical: max diff "
          f"{max(r[3] for r in rows):.1e})")


if __name__ == "__main__":
    main()
