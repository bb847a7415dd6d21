"""Does the tiny model learn the built-in task with GRPO on a CPU? Rollout included.

A standalone loop: model.generate sampling (rollout), the task's rule-based reward, and
StreamingStep (torch backend) for the update. Baseline: the same model's reward before training.
Prints, per configuration over seeds (interleaved), the mean reward of the last 3 steps and its
ratio to the first step's: median [spread].

With ``--publish-dtype bfloat16`` the rollout runs on the trainer's weights rounded to bf16 (what
workers serve when the trainer publishes in the serving dtype), and each step prints the fraction
of bf16 elements that changed since the last version: the sparsity delta transfer rides on
(ROSE Fig. 11), measured against the learning it must not hurt.

    python bench/trainer_learnability.py [--quick] [--steps N] [--seeds N] [--lr LR]
        [--publish-dtype model|bfloat16|both]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "2")

import torch  # noqa: E402

from rlharvest.sim.ratios import spread  # noqa: E402

from rlharvest.models.tiny_model import build_model  # noqa: E402
from rlharvest.models.tokenizer import EOS_ID, PAD_ID, CharTokenizer  # noqa: E402
from rlharvest.services.trainer.backend import OptimConfig, make_backend  # noqa: E402
from rlharvest.services.trainer.grpo import LossConfig  # noqa: E402
from rlharvest.services.trainer.stream_trainer import (  # noqa: E402
    Completion,
    RewardedGroup,
    StreamingStep,
)
from rlharvest.services.trainer.tasks import AdditionTask, TaskDataset  # noqa: E402
from rlharvest.services.transfer_agent.delta_publish import changed_positions  # noqa: E402


class Bf16Rollout:
    """The workers' copy: the trainer's weights rounded to bf16, and how many bits changed."""

    def __init__(self, seed: int) -> None:
        self.model = build_model("tiny", seed=seed)
        self.model.generation_config.top_k = None
        self.published: dict[str, torch.Tensor] = {}

    def publish(self, trainer: torch.nn.Module) -> float:
        """Load the trainer's weights as bf16; returns the changed fraction (1.0 the first time)."""
        new = {k: v.detach().to(torch.bfloat16) for k, v in trainer.state_dict().items()
               if v.is_floating_point()}
        changed = sum(changed_positions(self.published[k], t).size if k in self.published
                      else t.numel() for k, t in new.items())
        self.published = new
        self.model.load_state_dict({k: v.float() for k, v in new.items()}, strict=False)
        return changed / sum(t.numel() for t in new.values())


def rollout(model: torch.nn.Module, prompts: list[list[int]], group_size: int,
            max_tokens: int) -> list[list[list[int]]]:
    """group_size sampled completions per prompt (all prompts have equal length here)."""
    ids = torch.tensor(prompts).repeat_interleave(group_size, dim=0)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                             temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=max_tokens,
                             eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    completions = []
    for row in out[:, ids.shape[1]:].tolist():
        cut = row.index(EOS_ID) + 1 if EOS_ID in row else len(row)
        completions.append([t for t in row[:cut] if t != PAD_ID])
    return [completions[i:i + group_size] for i in range(0, len(completions), group_size)]


def train(args: argparse.Namespace, seed: int, dtype: str, steps: int) -> tuple[list, list]:
    """One run: the reward curve, and (bf16) the changed fraction of each published version."""
    torch.manual_seed(seed)
    tok = CharTokenizer()
    model = build_model("tiny", seed=seed)
    model.generation_config.top_k = None
    backend = make_backend("torch", model, OptimConfig(lr=args.lr, grad_clip=1.0))
    data = TaskDataset(seed=seed)
    curve, changes = [], []
    workers = Bf16Rollout(seed) if dtype == "bfloat16" else None
    for step in range(steps):
        items = data.next_batch(args.prompts)
        prompts = [tok.encode(it.prompt) for it in items]
        model.eval()
        if workers is not None:
            changes.append(workers.publish(model))
        groups_ids = rollout(model if workers is None else workers.model, prompts,
                             args.group_size, max_tokens=4)
        model.train()
        train = StreamingStep(backend, num_groups=len(items), group_size=args.group_size,
                              micro_batch_groups=4, loss=LossConfig(), pad_id=PAD_ID)
        for g, (item, prompt, comps) in enumerate(zip(items, prompts, groups_ids)):
            rewards = [AdditionTask.reward(tok.decode(c), item.answer) for c in comps]
            train.add_group(RewardedGroup(g, [Completion(prompt, c) for c in comps], rewards))
        curve.append(train.finish().mean_reward)
        if args.verbose:
            changed = f"  bf16 changed {changes[-1]:.2%}" if changes else ""
            print(f"seed {seed} {dtype} step {step:3d}  reward {curve[-1]:.3f}{changed}")
    return curve, changes


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="10 steps, 2 seeds")
    parser.add_argument("--steps", type=int, default=0)
    parser.add_argument("--seeds", type=int, default=0, help="runs per configuration (3)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--publish-dtype", choices=["model", "bfloat16", "both"], default="model")
    parser.add_argument("--verbose", action="store_true", help="print every step")
    args = parser.parse_args()
    steps = args.steps or (10 if args.quick else 20)
    seeds = args.seeds or (2 if args.quick else 3)
    dtypes = ["model", "bfloat16"] if args.publish_dtype == "both" else [args.publish_dtype]
    torch.set_num_threads(2)
    started = time.perf_counter()
    ratios: dict[str, list[float]] = {d: [] for d in dtypes}
    afters: dict[str, list[float]] = {d: [] for d in dtypes}
    changed: list[float] = []
    for seed in range(seeds):  # the configurations interleaved, seed by seed
        for dtype in dtypes:
            curve, changes = train(args, seed, dtype, steps)
            after = sum(curve[-3:]) / len(curve[-3:])
            ratios[dtype].append(after / max(curve[0], 1e-9))
            afters[dtype].append(after)
            changed += changes[1:]
            print(f"seed {seed} {dtype}: reward {curve[0]:.3f} -> {after:.3f} (mean of the "
                  f"last 3)", flush=True)
    print(f"\nlr {args.lr:g}, {steps} steps, {args.prompts}x{args.group_size} samples/step, "
          f"{seeds} seeds, {time.perf_counter() - started:.0f}s")
    for dtype in dtypes:
        print(f"  {dtype:9s} reward after: median {statistics.median(afters[dtype]):.3f} "
              f"[{min(afters[dtype]):.3f}-{max(afters[dtype]):.3f}]; after / before "
              f"{spread(ratios[dtype])}")
    if changed:
        print(f"  bf16 elements changed per published version: median "
              f"{statistics.median(changed):.2%} [{min(changed):.2%}-{max(changed):.2%}]")


if __name__ == "__main__":
    main()
