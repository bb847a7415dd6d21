"""How one micro-batch spreads over the trainer's ranks: contiguous shares that lose and repeat
no sample, whose losses (over the step's denominator) sum to the whole batch's loss and whose
gradients sum to its gradient; an empty share still runs a backward that touches every
parameter with exactly zero; and launches the trainer cannot serve are refused, by name."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rlharvest.models.tiny_model import build_model
from rlharvest.models.tokenizer import PAD_ID
from rlharvest.services.trainer.backend import OptimConfig, make_backend
from rlharvest.services.trainer.grpo import LossConfig
from rlharvest.services.trainer.ranks import (
    LocalRanks,
    MicroBatch,
    Sample,
    check_world,
    micro_batch_loss,
    zero_loss,
)


def sample(i: int, rollout: bool = False) -> Sample:
    completion = [5 + (i * 7 + k) % 40 for k in range(2 + i % 4)]
    return Sample(prompt_ids=[3, 4 + i % 9], completion_ids=completion,
                  rollout_logprobs=[-1.0 - 0.1 * k for k in range(len(completion))]
                  if rollout else None, advantage=(i % 5) - 2.0)


@given(n=st.integers(0, 40), parts=st.integers(1, 9))
def test_split_gives_contiguous_shares_that_lose_and_repeat_no_sample(n, parts):
    batch = MicroBatch(tuple(sample(i) for i in range(n)), LossConfig(), PAD_ID, 17.0)
    shares = batch.split(parts)
    assert len(shares) == parts
    assert tuple(s for share in shares for s in share.samples) == batch.samples
    sizes = [len(share.samples) for share in shares]
    assert max(sizes) - min(sizes) <= 1
    assert all(share.denominator == 17.0 and share.loss == batch.loss for share in shares)


def grads(module: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p)
            for p in module.parameters()]


@pytest.mark.parametrize("parts", [2, 3, 7])
@pytest.mark.parametrize("loss", [LossConfig(), LossConfig(aggregation="sequence", beta=0.1)])
def test_the_shares_losses_and_gradients_sum_to_the_whole_batchs(parts, loss):
    torch.manual_seed(0)
    model = build_model("tiny", seed=1)
    ref = build_model("tiny", seed=2)
    batch = MicroBatch(tuple(sample(i, rollout=i % 2 == 0) for i in range(5)), loss, PAD_ID,
                       denominator=31.0)
    ranks = LocalRanks(make_backend("torch", model, OptimConfig(optimizer="sgd")), ref)
    whole_loss = ranks.backward(batch)
    whole = grads(model)
    model.zero_grad(set_to_none=True)
    share_loss = sum(ranks.backward(share) for share in batch.split(parts))
    assert share_loss == pytest.approx(whole_loss, rel=1e-5, abs=1e-7)
    for summed, expected in zip(grads(model), whole, strict=True):
        torch.testing.assert_close(summed, expected, rtol=1e-5, atol=1e-7)
    assert any(g.abs().sum() > 0 for g in whole)  # the check can fail: gradients are not all 0


@pytest.mark.parametrize("loss_config", [LossConfig(), LossConfig(beta=0.1)])
def test_an_empty_share_backwards_exactly_zero_into_every_parameter(loss_config):
    model = build_model("tiny", seed=1)
    empty = MicroBatch((), loss_config, PAD_ID, 9.0)
    loss = zero_loss(model, empty, build_model("tiny", seed=2))
    loss.backward()
    assert float(loss.detach()) == 0.0
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert torch.count_nonzero(p.grad) == 0, name


def test_a_share_refuses_beta_without_a_reference_model():
    batch = MicroBatch((sample(0),), LossConfig(beta=0.1), PAD_ID, 3.0)
    with pytest.raises(ValueError, match="ref_model"):
        micro_batch_loss(build_model("tiny", seed=1), batch, None)


def test_a_multi_rank_launch_of_the_torch_backend_is_refused(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="2 ranks but backend 'torch'.*--backend deepspeed"):
        check_world("torch")
    assert check_world("deepspeed") == (0, 2)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert check_world("torch") == (0, 1)


def test_a_service_that_runs_as_one_process_refuses_a_rank_above_0():
    env = {**os.environ, "RANK": "1", "WORLD_SIZE": "2"}
    done = subprocess.run(
        [sys.executable, "-m", "rlharvest.services.rollout_manager.main", "--etcd",
         "127.0.0.1:1"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "runs as one process, but was launched as rank 1 of 2" in done.stderr


def test_a_loss_mask_trains_the_models_tokens_and_leaves_observations_out():
    """An agentic trajectory: turns of the model with the environment's observations between.
    Masked tokens add nothing to the loss and their logprobs do not matter; the trained tokens
    give exactly the loss of a sample whose other tokens are ignored; all masked trains nothing."""
    model = build_model("tiny", seed=1)
    completion = [10, 11, 40, 41, 42, 12, 13]  # turn, observation (3 tokens), turn
    trained = [True, True, False, False, False, True, True]
    rollout = [-1.0, -1.2, 0.0, 0.0, 0.0, -0.8, -0.9]

    def loss_of(mask, logprobs) -> torch.Tensor:
        batch = MicroBatch((Sample([3, 4], completion, logprobs, 1.5, mask),), LossConfig(),
                           PAD_ID, 4.0)
        return micro_batch_loss(model, batch, None)

    masked = loss_of(trained, rollout)
    other_obs_logprobs = [lp if own else -7.0 for lp, own in zip(rollout, trained)]
    assert torch.equal(masked, loss_of(trained, other_obs_logprobs))
    assert not torch.equal(masked, loss_of(None, rollout))
    model.zero_grad()
    loss_of([False] * len(completion), rollout).backward()
    assert all(float(g.abs().sum()) == 0 for g in grads(model))
