"""GRPO math: group-relative advantages, completion logprobs, PPO-clip + k3 KL, aggregation."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlharvest.models.tiny_model import build_model
from rlharvest.models.tokenizer import PAD_ID
from rlharvest.services.trainer.grpo import (
    LossConfig,
    aggregate_loss,
    completion_logprobs,
    group_advantages,
    per_token_loss,
)

rewards_lists = st.lists(st.floats(-10, 10, allow_nan=False), min_size=2, max_size=16)


@given(rewards_lists)
def test_advantages_are_relative_to_the_group_mean(rewards: list[float]) -> None:
    adv = group_advantages(torch.tensor(rewards), std_normalize=False)
    expected = torch.tensor(rewards) - torch.tensor(rewards).mean()
    assert torch.allclose(adv, expected, atol=1e-4)


@given(rewards_lists)
def test_std_normalised_advantages_have_unit_spread(rewards: list[float]) -> None:
    r = torch.tensor(rewards, dtype=torch.float32)
    adv = group_advantages(r)
    if r.std() < 1e-3:
        return  # (near-)constant groups are covered by the zero-signal test
    assert abs(float(adv.mean())) < 1e-4
    assert math.isclose(float(adv.std()), 1.0, rel_tol=1e-3)


def test_a_group_with_equal_rewards_carries_no_signal() -> None:
    assert torch.equal(group_advantages(torch.full((8,), 0.7)), torch.zeros(8))


def test_advantages_of_a_hand_built_group() -> None:
    adv = group_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]]), eps=0.0)
    std = torch.tensor([1.0, 0.0, 0.0, 1.0]).std()
    assert torch.allclose(adv, torch.tensor([[0.5, -0.5, -0.5, 0.5]]) / std)


def test_completion_logprobs_do_not_depend_on_batch_padding() -> None:
    model = build_model("tiny", seed=0)
    prompts = [[1, 10, 11], [1, 12], [1, 13, 14, 15, 16]]
    completions = [[20, 21, 22, 2], [30], [40, 41]]
    batched, mask = completion_logprobs(model, prompts, completions, PAD_ID)
    assert mask.tolist() == [[1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0]]
    for i, (p, c) in enumerate(zip(prompts, completions)):
        alone, _ = completion_logprobs(model, [p], [c], PAD_ID)
        assert torch.allclose(batched[i, :len(c)], alone[0], atol=1e-5)


def test_completion_logprobs_score_the_completion_tokens_given_the_prompt() -> None:
    model = build_model("tiny", seed=1)
    prompt, completion = [1, 10, 11], [20, 21]
    logp, _ = completion_logprobs(model, [prompt], [completion], PAD_ID)
    logits = model(input_ids=torch.tensor([prompt + completion])).logits[0].log_softmax(-1)
    expected = torch.stack([logits[2, 20], logits[3, 21]])
    assert torch.allclose(logp[0], expected, atol=1e-5)


def test_on_policy_loss_is_minus_the_advantage_per_token() -> None:
    logp = torch.tensor([[-1.0, -2.0]])
    loss = per_token_loss(logp, logp.clone(), torch.tensor([0.5]), LossConfig())
    assert torch.allclose(loss, torch.tensor([[-0.5, -0.5]]))


def test_ratio_is_clipped_at_one_plus_eps_high_for_positive_advantage() -> None:
    old = torch.tensor([[0.0]])
    new = torch.log(torch.tensor([[1.5]]))
    loss = per_token_loss(new, old, torch.tensor([1.0]), LossConfig(eps_low=0.2, eps_high=0.28))
    assert torch.allclose(loss, torch.tensor([[-1.28]]))


def test_ratio_is_clipped_at_one_minus_eps_low_for_negative_advantage() -> None:
    old = torch.tensor([[0.0]])
    new = torch.log(torch.tensor([[0.5]]))
    loss = per_token_loss(new, old, torch.tensor([-1.0]), LossConfig(eps_low=0.2, eps_high=0.28))
    assert torch.allclose(loss, torch.tensor([[0.8]]))


def test_clipping_never_hides_a_worsening_ratio() -> None:
    # Pessimistic bound: a ratio that moved the wrong way (A < 0, ratio up) is not clipped.
    old = torch.tensor([[0.0]])
    new = torch.log(torch.tensor([[2.0]]))
    loss = per_token_loss(new, old, torch.tensor([-1.0]), LossConfig())
    assert torch.allclose(loss, torch.tensor([[2.0]]))


def test_k3_kl_term_matches_its_closed_form_and_vanishes_at_the_reference() -> None:
    cfg = LossConfig(beta=0.1)
    logp, ref = torch.tensor([[-1.0]]), torch.tensor([[-1.5]])
    zero_adv = torch.tensor([0.0])
    loss = per_token_loss(logp, logp, zero_adv, cfg, ref_logprobs=ref)
    d = -0.5
    assert torch.allclose(loss, torch.tensor([[0.1 * (math.exp(d) - d - 1)]]))
    assert float(per_token_loss(logp, logp, zero_adv, cfg, ref_logprobs=logp)) == 0.0


def test_kl_without_reference_logprobs_is_refused() -> None:
    with pytest.raises(ValueError, match="ref_logprobs"):
        per_token_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1), LossConfig(beta=0.1))


def test_token_and_sequence_aggregation_on_a_hand_built_batch() -> None:
    token_loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    # token: (1 + 2 + 3 + 4) / 4 tokens; sequence: (mean 2 + mean 4) / 2 sequences
    assert float(aggregate_loss(token_loss, mask, "token", 4)) == pytest.approx(2.5)
    assert float(aggregate_loss(token_loss, mask, "sequence", 2)) == pytest.approx(3.0)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 7), st.sampled_from(["token", "sequence"]), st.integers(0, 2**16))
def test_micro_batch_shares_sum_to_the_whole_step_loss(cut: int, aggregation: str,
                                                       seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    token_loss = torch.randn(8, 5, generator=gen)
    lengths = torch.randint(1, 6, (8,), generator=gen)
    mask = (torch.arange(5) < lengths.unsqueeze(-1)).float()
    denominator = float(mask.sum()) if aggregation == "token" else 8.0
    whole = aggregate_loss(token_loss, mask, aggregation, denominator)
    parts = (aggregate_loss(token_loss[:cut], mask[:cut], aggregation, denominator)
             + aggregate_loss(token_loss[cut:], mask[cut:], aggregation, denominator))
    assert torch.allclose(whole, parts, atol=1e-5)
