"""Trainer scale-out: tokens trained per second by 2 ranks vs 1 rank, the same RL step.

Every configuration runs the same streamed GRPO steps (``StreamingStep``, the
DeepSpeed backend, the ``small`` preset by default) under ``torchrun``; rank 0 leads and times
whole steps (micro-batches + the one optimizer step), the other rank follows
(``rlharvest/services/trainer/ranks.py``). The configurations, interleaved (the order rotates each round)
and repeated:

- ``1x1``: one rank, one thread — the per-rank compute of the 2-rank run;
- ``1x2``: one rank, two threads — the same cores as the 2-rank run, given to one process;
- ``2x1``: two ranks, one thread each.

Prints tokens/s of each and the median ratio 2x1 / 1x1 (scaling: 2.0 is perfect) and
2x1 / 1x2 (ranks vs threads on the same cores), with the spread over rounds. This box has 2 CPU cores
and gloo; on GPUs (one per rank, NCCL) the same script measures the real scale-out.

    python bench/trainer_scale.py [--quick] [--model tiny|small] [--zero-stage 0|1|2|3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
from rlharvest.sim.ratios import spread  # noqa: E402

CONFIGS = {"1x1": (1, 1), "1x2": (1, 2), "2x1": (2, 1)}


def worker(args: argparse.Namespace) -> None:
    """One configuration's run (under torchrun): warm-up steps, then timed steps."""
    import torch

    from rlharvest.models.tiny_model import build_model
    from rlharvest.models.tokenizer import PAD_ID
    from rlharvest.services.trainer import ranks
    from rlharvest.services.trainer.backend import OptimConfig, make_backend
    from rlharvest.services.trainer.grpo import LossConfig
    from rlharvest.services.trainer.stream_trainer import StreamingStep
    from trainer_stream import make_groups

    torch.set_num_threads(args.threads)
    model = build_model(args.model, seed=0)
    backend = make_backend("deepspeed", model, OptimConfig(
        lr=1e-4, optimizer="adamw", zero_stage=args.zero_stage))
    trainer_ranks: ranks.Ranks = ranks.LocalRanks(backend)
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        group = ranks.control_group()
        if torch.distributed.get_rank() > 0:
            ranks.follow(ranks.LocalRanks(backend), group)  # returns when rank 0 stops it
            return
        trainer_ranks = ranks.LeaderRanks(backend, None, group)
    times, tokens = [], 0
    for i in range(args.warmup + args.steps):
        groups, _ = make_groups(args.groups, args.group_size, args.max_len, seed=i)
        step = StreamingStep(backend, num_groups=args.groups, group_size=args.group_size,
                             micro_batch_groups=args.micro_batch_groups, loss=LossConfig(),
                             pad_id=PAD_ID, ranks=trainer_ranks)
        start = time.perf_counter()
        step.add_groups(groups)
        step.finish()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
            tokens += sum(len(c.completion_ids) for g in groups for c in g.completions)
    gathers = []  # what publishing a version costs rank 0 (ZeRO-3: a gather over every rank)
    for _ in range(5):
        start = time.perf_counter()
        trainer_ranks.weights()
        gathers.append(time.perf_counter() - start)
    trainer_ranks.close()
    Path(args.out).write_text(json.dumps({"tokens": tokens, "seconds": sum(times),
                                          "weights_s": statistics.median(gathers)}))


def launch(config: str, args: argparse.Namespace, out: Path) -> tuple[float, float]:
    """Run one configuration; returns its tokens/s and the median time rank 0 took to get the
    whole model's weights for publishing."""
    nproc, threads = CONFIGS[config]
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
             if k in ("model", "zero_stage", "groups", "group_size", "max_len",
                      "micro_batch_groups", "steps", "warmup")]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                    f"--nproc-per-node={nproc}", __file__, "--worker", f"--threads={threads}",
                    f"--out={out}", *flags], env=env, check=True, capture_output=True)
    result = json.loads(out.read_text())
    return result["tokens"] / result["seconds"], result["weights_s"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--model", default="small", choices=["tiny", "small"])
    parser.add_argument("--zero-stage", type=int, default=2, choices=[0, 1, 2, 3])
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-len", type=int, default=128)
    parser.add_argument("--micro-batch-groups", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.quick:
        args.model, args.groups, args.group_size, args.steps, args.rounds = "tiny", 4, 4, 2, 2
    rounds, quick = args.rounds, args.quick
    for key in ("quick", "worker", "out", "threads", "rounds"):
        delattr(args, key)
    print(f"model={args.model} ZeRO-{args.zero_stage} step={args.groups}x{args.group_size} "
          f"completions (<= {args.max_len} tokens) m_b={args.micro_batch_groups} "
          f"steps={args.steps} rounds={rounds}{' (quick)' if quick else ''}")
    rates: dict[str, list[float]] = {c: [] for c in CONFIGS}
    weights: dict[str, list[float]] = {c: [] for c in CONFIGS}
    order = list(CONFIGS)
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for config in order[r % 3:] + order[:r % 3]:
                rate, weights_s = launch(config, args, Path(tmp) / f"{config}-{r}.json")
                rates[config].append(rate)
                weights[config].append(weights_s)
            print(f"  round {r}: " + "  ".join(f"{c} {rates[c][-1]:,.0f} tok/s" for c in CONFIGS))
    scale = [b / a for a, b in zip(rates["1x1"], rates["2x1"])]
    same_cores = [b / a for a, b in zip(rates["1x2"], rates["2x1"])]
    print(f"2 ranks / 1 rank (1 thread each): {spread(scale)}   "
          f"2 ranks x 1 thread / 1 rank x 2 threads: {spread(same_cores)}")
    print("whole-model weights for publishing on rank 0 (median ms): " + "  ".join(
        f"{c} {1000 * statistics.median(weights[c]):.1f}" for c in CONFIGS))


if __name__ == "__main__":
    main()
