"""GRPO's math as pure torch functions: advantages, completion logprobs, the clipped loss.

The loss functions take the denominators of the WHOLE STEP rather than of the micro-batch they
are given (RollPacker §4.4, "Preserving On-Policy Semantics"). Summing the gradients of any
partition of the step's samples then gives exactly the gradient of the monolithic batch, which is
what lets ``stream_trainer.StreamingStep`` train on groups in whatever order they arrive.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from rlharvest.services.trainer.device import module_device

Aggregation = Literal["token", "sequence"]


@dataclass(frozen=True)
class LossConfig:
    eps_low: float = 0.2  # ratio floor 1 - eps_low
    eps_high: float = 0.2  # ratio ceiling 1 + eps_high (DAPO's "clip higher" sets it above eps_low)
    beta: float = 0.0  # KL(policy || reference) coefficient; 0 skips the reference model
    aggregation: Aggregation = "token"

    def __post_init__(self) -> None:
        if self.aggregation not in ("token", "sequence"):
            raise ValueError(f"aggregation must be 'token' or 'sequence', got {self.aggregation!r}")
        if self.eps_low < 0 or self.eps_high < 0 or self.beta < 0:
            raise ValueError(
                f"eps_low, eps_high and beta must be >= 0, got {self.eps_low}, {self.eps_high}, "
                f"{self.beta}"
            )


def group_advantages(rewards: torch.Tensor, std_normalize: bool = True,
                     eps: float = 1e-6) -> torch.Tensor:
    """Group-relative advantages (GRPO): reward minus the group mean, optionally over the std.

    ``rewards`` is 1-D (one group) or 2-D (groups x samples); statistics are taken over the last
    dimension. A group whose rewards are all equal gets zero advantages: it carries no signal.
    """
    rewards = rewards.to(torch.float32)
    centred = rewards - rewards.mean(dim=-1, keepdim=True)
    # The float mean of equal values can miss them by an ulp, which the std division below would
    # blow up into a fake signal; equal rewards give exactly zero.
    constant = rewards.amax(dim=-1, keepdim=True) == rewards.amin(dim=-1, keepdim=True)
    centred = torch.where(constant, torch.zeros_like(centred), centred)
    if not std_normalize:
        return centred
    # Unbiased std as in the GRPO reference code (DeepSeekMath); a single sample has none.
    std = rewards.std(dim=-1, keepdim=True) if rewards.shape[-1] > 1 else torch.zeros_like(centred)
    return centred / (std + eps)


def pad_sequences(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
                  pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``prompt + completion`` ids and their attention mask, shape [B, L]."""
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
    rows = [list(p) + list(c) for p, c in zip(prompts, completions)]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = torch.tensor(row, dtype=torch.long)
        mask[i, :len(row)] = 1
    return ids, mask


def completion_logprobs(model: torch.nn.Module, prompts: Sequence[Sequence[int]],
                        completions: Sequence[Sequence[int]],
                        pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token logprobs of each completion given its prompt, in one batched forward.

    Returns ``(logprobs, mask)``, both [B, Tc] where Tc is the longest completion; column t is the
    completion's t-th token, and ``mask`` is 1 where that token exists. Right padding keeps every
    real token at its natural position, so no position ids are needed.
    """
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token (the BOS) to condition on")
    device = module_device(model)  # the batch goes where the model is (--device)
    ids, attention = (t.to(device) for t in pad_sequences(prompts, completions, pad_id))
    logits = model(input_ids=ids, attention_mask=attention).logits.float()
    logp_all = F.log_softmax(logits[:, :-1], dim=-1)  # position j predicts token j + 1
    token_logp = logp_all.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    width = max((len(c) for c in completions), default=0)
    mask = torch.zeros((len(prompts), width), dtype=torch.float32, device=device)
    rows = []
    for i, (p, c) in enumerate(zip(prompts, completions)):
        # token at position len(p) + t is predicted at row position len(p) + t - 1
        rows.append(F.pad(token_logp[i, len(p) - 1:len(p) - 1 + len(c)], (0, width - len(c))))
        mask[i, :len(c)] = 1.0
    out = torch.stack(rows)
    return out, mask


def per_token_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor,
                   advantages: torch.Tensor, config: LossConfig,
                   ref_logprobs: torch.Tensor | None = None) -> torch.Tensor:
    """PPO-clip surrogate (negated, so lower is better) plus beta * k3 KL, per token, [B, T].

    ``old_logprobs`` are the rollout engine's logprobs: the policy that generated the tokens.
    ``advantages`` is [B] (one per sequence, GRPO) and broadcasts over tokens.
    """
    ratio = torch.exp(logprobs - old_logprobs)
    adv = advantages.unsqueeze(-1)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - config.eps_low, 1.0 + config.eps_high) * adv
    loss = -torch.minimum(unclipped, clipped)
    if config.beta > 0:
        if ref_logprobs is None:
            raise ValueError("beta > 0 needs ref_logprobs (a frozen reference model's logprobs)")
        # k3 estimator (Schulman, "Approximating KL divergence"): unbiased and always >= 0.
        log_ratio = ref_logprobs - logprobs
        loss = loss + config.beta * (torch.exp(log_ratio) - log_ratio - 1.0)
    return loss


def aggregate_loss(token_loss: torch.Tensor, mask: torch.Tensor, aggregation: Aggregation,
                   step_denominator: float) -> torch.Tensor:
    """This micro-batch's share of the whole step's loss.

    "token": sum over all real tokens / ``step_denominator`` (the step's total completion tokens).
    "sequence": sum over sequences of their per-token mean / ``step_denominator`` (the step's
    sample count). Shares of disjoint micro-batches add up to the monolithic loss exactly.
    """
    if step_denominator <= 0:
        raise ValueError(f"step_denominator must be > 0, got {step_denominator}")
    masked = token_loss * mask
    if aggregation == "token":
        return masked.sum() / step_denominator
    lengths = mask.sum(dim=-1).clamp(min=1.0)  # an empty completion contributes 0, not NaN
    return (masked.sum(dim=-1) / lengths).sum() / step_denominator
