"""Does the tiny model learn the built-in task with GRPO on a CPU? Rollout included.

A standalone loop: model.generate sampling (rollout), the task's rule-based reward, and
StreamingStep (torch backend) for the update. Baseline: the same model's reward before training.
Prints mean reward per step and the ratio of the last 3 steps' mean to the first step's.

With ``--publish-dtype bfloat16`` the rollout runs on the trainer's weights rounded to bf16 (what
workers serve when the trainer publishes in the serving dtype), and each step prints the fraction
of bf16 elements that changed since the last version: the sparsity delta transfer rides on
(ROSE Fig. 11), measured against the learning it must not hurt.

    python bench/trainer_learnability.py [--quick] [--steps N] [--publish-dtype bfloat16]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "2")

import torch  # noqa: E402

from rlharvest.common.tiny_model import build_model  # noqa: E402
from rlharvest.common.tokenizer import EOS_ID, PAD_ID, CharTokenizer  # noqa: E402
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="10 steps instead of 20")
    parser.add_argument("--steps", type=int, default=0)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--publish-dtype", choices=["model", "bfloat16"], default="model")
    args = parser.parse_args()
    steps = args.steps or (10 if args.quick else 20)
    torch.manual_seed(args.seed)
    torch.set_num_threads(2)
    tok = CharTokenizer()
    model = build_model("tiny", seed=args.seed)
    model.generation_config.top_k = None
    backend = make_backend("torch", model, OptimConfig(lr=args.lr, grad_clip=1.0))
    data = TaskDataset(seed=args.seed)
    curve, changes = [], []
    workers = Bf16Rollout(args.seed) if args.publish_dtype == "bfloat16" else None
    start = time.perf_counter()
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
        stats = train.finish()
        curve.append(stats.mean_reward)
        sample = tok.decode(groups_ids[0][0])
        changed = f"  bf16 changed {changes[-1]:.2%}" if changes else ""
        print(f"step {step:2d}  reward {stats.mean_reward:.3f}  loss {stats.loss:+.4f}  "
              f"e.g. {items[0].prompt}{sample!r}{changed}  t={time.perf_counter() - start:.1f}s")
    elapsed = time.perf_counter() - start
    before, after = curve[0], sum(curve[-3:]) / len(curve[-3:])
    print(f"\nreward before {before:.3f} -> after (mean of last 3) {after:.3f}  "
          f"ratio {after / max(before, 1e-9):.2f}x  in {elapsed:.1f}s for {steps} steps "
          f"({args.prompts}x{args.group_size} samples/step, rollout included)")
    if len(changes) > 1:
        later = sorted(changes[1:])
        print(f"bf16 elements changed per published version (lr {args.lr:g}): median "
              f"{later[len(later) // 2]:.2%} [{later[0]:.2%}-{later[-1]:.2%}]")


if __name__ == "__main__":
    main()
