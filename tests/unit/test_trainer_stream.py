"""Stream trainer (RollPacker §4.4, RLBoost §4.1): streamed micro-batches that merge what is
ready at once, one deferred step, and an update equal to the monolithic batch's for any arrival
order, burst of arrivals and micro-batch size."""

from __future__ import annotations

import copy
import functools
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlharvest.models.tiny_model import build_model
from rlharvest.models.tokenizer import PAD_ID
from rlharvest.services.trainer.backend import OptimConfig, make_backend
from rlharvest.services.trainer.grpo import (
    LossConfig,
    aggregate_loss,
    completion_logprobs,
    group_advantages,
    per_token_loss,
)
from rlharvest.services.trainer.stream_trainer import (
    Completion,
    RewardedGroup,
    StepInputError,
    StepStats,
    StreamingStep,
)
from tests.builders import rewarded_groups

NUM_GROUPS, GROUP_SIZE = 5, 3
SGD = OptimConfig(lr=0.5, optimizer="sgd", grad_clip=0.0)


@functools.cache
def seeded_model(seed: int) -> torch.nn.Module:
    """Built once per seed (construction dominates these tests); callers get a deep copy."""
    return build_model("tiny", seed=seed)


def fresh_model(seed: int) -> torch.nn.Module:
    return copy.deepcopy(seeded_model(seed))


def monolithic_update(model: torch.nn.Module, groups: list[RewardedGroup], loss: LossConfig,
                      ref_model: torch.nn.Module | None, lr: float) -> None:
    """The reference: one batch holding every sample, one backward, one SGD step. A sample's
    loss mask masks its tokens; a sample without a prompt (a failed reset, all masked) reads a
    stand-in BOS, as the one batched forward needs a token to condition on."""
    comps = [c for g in groups for c in g.completions]
    adv = torch.cat([group_advantages(torch.tensor(g.rewards)) for g in groups])
    prompts = [c.prompt_ids or [1] for c in comps]
    outputs = [c.completion_ids for c in comps]
    logp, mask = completion_logprobs(model, prompts, outputs, PAD_ID)
    for i, c in enumerate(comps):
        if c.loss_mask is not None:
            mask[i, :len(c.loss_mask)] *= torch.tensor(c.loss_mask, dtype=mask.dtype)
    old = torch.zeros_like(logp)
    for i, c in enumerate(comps):
        old[i, :len(c.rollout_logprobs)] = torch.tensor(c.rollout_logprobs)
    ref = None
    if loss.beta > 0:
        with torch.no_grad():
            ref, _ = completion_logprobs(ref_model, prompts, outputs, PAD_ID)
    denominator = float(mask.sum()) if loss.aggregation == "token" else float(len(comps))
    value = aggregate_loss(per_token_loss(logp, old, adv, loss, ref), mask, loss.aggregation,
                           denominator)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    value.backward()
    optimizer.step()


def bursts(groups: list[RewardedGroup], max_burst: int, seed: int) -> list[list[RewardedGroup]]:
    """The groups cut into consecutive bursts of 1..max_burst: groups that became ready at once."""
    rng, out, i = random.Random(seed), [], 0
    while i < len(groups):
        size = rng.randint(1, max_burst)
        out.append(groups[i:i + size])
        i += size
    return out


def streamed_update(backend_name: str, model: torch.nn.Module, arrivals: list[list[RewardedGroup]],
                    loss: LossConfig, ref_model: torch.nn.Module | None, micro_batch_groups: int,
                    optim: OptimConfig = SGD, total_tokens: int | None = None) -> StepStats:
    backend = make_backend(backend_name, model, optim)
    step = StreamingStep(backend, num_groups=sum(map(len, arrivals)), group_size=GROUP_SIZE,
                         micro_batch_groups=micro_batch_groups, loss=loss, pad_id=PAD_ID,
                         ref_model=ref_model, total_tokens=total_tokens)
    for ready_at_once in arrivals:
        step.add_groups(ready_at_once)
    return step.finish()


def assert_same_parameters(a: torch.nn.Module, b: torch.nn.Module, atol: float = 1e-6) -> None:
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.allclose(pa, pb, atol=atol, rtol=0), f"{name} differs by " \
            f"{(pa - pb).abs().max().item():.3g}"


def check_equivalence(backend: str, seed: int, micro_batch_groups: int, aggregation: str,
                      beta: float, zero_stage: int = 0, known_tokens: bool = False,
                      max_burst: int = 1) -> StepStats:
    groups = rewarded_groups(seed)
    base = fresh_model(seed % 3)
    ref_model = seeded_model(99) if beta > 0 else None
    loss = LossConfig(beta=beta, aggregation=aggregation)
    expected = copy.deepcopy(base)
    monolithic_update(expected, groups, loss, ref_model, SGD.lr)
    arrivals = groups[:]
    random.Random(seed + 1).shuffle(arrivals)
    total = sum(len(c.completion_ids) for g in groups for c in g.completions)
    streamed = copy.deepcopy(base)
    optim = OptimConfig(lr=SGD.lr, optimizer="sgd", grad_clip=0.0, zero_stage=zero_stage)
    stats = streamed_update(backend, streamed, bursts(arrivals, max_burst, seed + 2), loss,
                            ref_model, micro_batch_groups, optim,
                            total_tokens=total if known_tokens else None)
    assert_same_parameters(streamed, expected)
    assert not torch.equal(next(streamed.parameters()), next(base.parameters())), "no update"
    return stats


@settings(max_examples=16, deadline=None)
@given(seed=st.integers(0, 10_000), micro_batch_groups=st.integers(1, NUM_GROUPS + 1),
       aggregation=st.sampled_from(["token", "sequence"]), beta=st.sampled_from([0.0, 0.05]),
       known_tokens=st.booleans(), max_burst=st.integers(1, NUM_GROUPS))
def test_streamed_update_equals_monolithic_update_for_any_arrival_order_burst_and_micro_batch_size(
        seed: int, micro_batch_groups: int, aggregation: str, beta: float,
        known_tokens: bool, max_burst: int) -> None:
    check_equivalence("torch", seed, micro_batch_groups, aggregation, beta,
                      known_tokens=known_tokens, max_burst=max_burst)


def test_the_update_equals_the_monolithic_one_when_micro_batches_merge() -> None:
    # Pinned, so a merged micro-batch is certainly among the cases (the property draws them).
    stats = check_equivalence("torch", 11, 2, "token", 0.05, max_burst=4)
    assert max(stats.micro_batch_groups) > 2, stats.micro_batch_groups


@pytest.mark.parametrize("zero_stage,aggregation,beta,micro_batch_groups,max_burst", [
    (0, "token", 0.0, 2, 1),
    (0, "sequence", 0.05, 1, 1),
    (1, "token", 0.05, 3, 1),
    (2, "token", 0.0, 2, 1),
    (2, "sequence", 0.05, 4, 1),
    (0, "token", 0.05, 2, NUM_GROUPS),
    (2, "token", 0.0, 1, 3),
])
def test_deepspeed_streamed_update_equals_monolithic_update(
        zero_stage: int, aggregation: str, beta: float, micro_batch_groups: int,
        max_burst: int) -> None:
    check_equivalence("deepspeed", 17 + zero_stage, micro_batch_groups, aggregation, beta,
                      zero_stage=zero_stage, max_burst=max_burst)


def test_parameters_do_not_move_until_finish() -> None:
    model = fresh_model(0)
    before = copy.deepcopy(model)
    step = StreamingStep(make_backend("torch", model, SGD), num_groups=NUM_GROUPS,
                         group_size=GROUP_SIZE, micro_batch_groups=1, loss=LossConfig(),
                         pad_id=PAD_ID)
    for g in rewarded_groups(3):
        step.add_group(g)
    assert step.micro_batches_run == NUM_GROUPS
    assert_same_parameters(model, before, atol=0.0)
    step.finish()
    assert not torch.equal(next(model.parameters()), next(before.parameters()))


def test_a_micro_batch_runs_as_soon_as_m_b_groups_are_ready() -> None:
    step = StreamingStep(make_backend("torch", fresh_model(0), SGD), num_groups=NUM_GROUPS,
                         group_size=GROUP_SIZE, micro_batch_groups=2, loss=LossConfig(),
                         pad_id=PAD_ID)
    ran = [step.add_group(g) for g in rewarded_groups(4)]
    assert ran == [False, True, False, True, False]
    stats = step.finish()  # the fifth group trains in the final micro-batch
    assert stats.micro_batches == 3 and stats.num_samples == NUM_GROUPS * GROUP_SIZE


def m_b_step(micro_batch_groups: int) -> StreamingStep:
    return StreamingStep(make_backend("torch", fresh_model(0), SGD), num_groups=NUM_GROUPS,
                         group_size=GROUP_SIZE, micro_batch_groups=micro_batch_groups,
                         loss=LossConfig(), pad_id=PAD_ID)


def test_more_than_m_b_groups_ready_at_once_form_one_micro_batch() -> None:
    step, groups = m_b_step(2), rewarded_groups(4)
    assert step.add_groups(groups[:3])  # three ready at once: one micro-batch, not 2 + a wait
    assert not step.add_groups(groups[3:4])
    assert step.add_groups(groups[4:])
    assert step.finish().micro_batch_groups == (3, 2)


def test_groups_left_waiting_merge_with_the_burst_that_completes_m_b() -> None:
    step, groups = m_b_step(3), rewarded_groups(4)
    assert not step.add_groups(groups[:1])
    assert step.add_groups(groups[1:4])  # the waiting group and all three of the burst
    assert not step.add_groups(groups[4:])
    assert step.finish().micro_batch_groups == (4, 1)


def test_exactly_m_b_groups_ready_form_a_micro_batch_of_m_b() -> None:
    step, groups = m_b_step(2), rewarded_groups(4)
    assert [step.add_groups(groups[i:i + 2]) for i in (0, 2)] == [True, True]
    assert step.add_groups(groups[4:]) is False
    assert step.finish().micro_batch_groups == (2, 2, 1)


def test_the_tail_of_the_step_trains_in_finish_even_below_m_b() -> None:
    step, groups = m_b_step(4), rewarded_groups(4)
    assert step.add_groups(groups[:4])
    assert not step.add_groups(groups[4:])
    stats = step.finish()
    assert stats.micro_batch_groups == (4, 1) and stats.num_groups == NUM_GROUPS


def test_a_refused_group_refuses_its_whole_burst_and_keeps_the_step_usable() -> None:
    step, groups = m_b_step(2), rewarded_groups(4)
    with pytest.raises(StepInputError, match="twice"):
        step.add_groups([groups[0], groups[1], groups[0]])
    assert step.groups_received == 0
    for g in groups:
        step.add_group(g)
    assert step.finish().num_groups == NUM_GROUPS


@pytest.mark.parametrize("failed", [False, True])
def test_a_step_whose_groups_all_tie_still_steps_like_the_monolithic_batch(failed: bool) -> None:
    # All advantages zero: the gradient is zero, but AdamW's weight decay must still apply once.
    # The step backpropagates the first group's tie to have a gradient (of zeros) to step on;
    # with ``failed`` that group holds a failed reset (a trajectory that trains nothing).
    made = rewarded_groups(5)
    groups = [RewardedGroup(g.group_id, g.completions, [1.0] * GROUP_SIZE)
              for g in (with_failed_trajectories(made) if failed else made)]
    model = fresh_model(0)
    before = copy.deepcopy(model)
    optim = OptimConfig(lr=0.1, optimizer="adamw", weight_decay=0.5)
    streamed_update("torch", model, [[g] for g in groups], LossConfig(), None, 2, optim)
    decayed = next(before.parameters()) * (1 - 0.1 * 0.5)
    assert torch.allclose(next(model.parameters()), decayed, atol=1e-6)


def test_finish_refuses_a_step_with_missing_groups() -> None:
    step = StreamingStep(make_backend("torch", fresh_model(0), SGD), num_groups=NUM_GROUPS,
                         group_size=GROUP_SIZE, micro_batch_groups=2, loss=LossConfig(),
                         pad_id=PAD_ID)
    step.add_group(rewarded_groups(6)[0])
    with pytest.raises(RuntimeError, match="have not arrived"):
        step.finish()


def test_duplicate_and_malformed_groups_are_refused_without_breaking_the_step() -> None:
    groups = rewarded_groups(7)
    step = StreamingStep(make_backend("torch", fresh_model(0), SGD), num_groups=NUM_GROUPS,
                         group_size=GROUP_SIZE, micro_batch_groups=2, loss=LossConfig(),
                         pad_id=PAD_ID)
    step.add_group(groups[0])
    with pytest.raises(StepInputError, match="twice"):
        step.add_group(groups[0])
    short = RewardedGroup(99, groups[1].completions[:1], groups[1].rewards[:1])
    with pytest.raises(StepInputError, match="group size"):
        step.add_group(short)
    bad = Completion([1, 5], [6, 7], [-1.0])
    with pytest.raises(StepInputError, match="one logprob per generated token"):
        step.add_group(RewardedGroup(98, [bad] * GROUP_SIZE, [0.0, 1.0, 0.0]))
    for g in groups[1:]:
        step.add_group(g)
    assert step.finish().num_groups == NUM_GROUPS


def with_failed_trajectories(groups: list[RewardedGroup]) -> list[RewardedGroup]:
    """``groups`` where the environment failed some trajectories, as ``rewarded_group`` hands
    them on: a failed reset (no prompt, no tokens) and a failure mid-episode (tokens, none
    trained), each scored 0. Group 0 is tied; its failed trajectory must not break the tie's
    KL-only backward either."""
    reset_failed = Completion([], [], [], [])
    out = []
    for g in groups:
        comps, rewards = list(g.completions), list(g.rewards)
        if g.group_id in (0, 1, 3):
            comps[0], rewards[0] = reset_failed, 0.0
        if g.group_id in (2, 3):
            c = comps[1]
            comps[1] = Completion(c.prompt_ids, c.completion_ids, c.rollout_logprobs,
                                  [False] * len(c.completion_ids))
            rewards[1] = 0.0
        out.append(RewardedGroup(g.group_id, comps, rewards))
    return out


@pytest.mark.parametrize("aggregation", ["token", "sequence"])
@pytest.mark.parametrize("beta", [0.0, 0.05])
@pytest.mark.parametrize("micro_batch_groups", [1, 2, NUM_GROUPS])
def test_failed_trajectories_train_nothing_and_the_update_equals_the_monolithic_one(
        aggregation: str, beta: float, micro_batch_groups: int) -> None:
    groups = with_failed_trajectories(rewarded_groups(3))
    base = fresh_model(1)
    ref_model = seeded_model(99) if beta > 0 else None
    loss = LossConfig(beta=beta, aggregation=aggregation)  # type: ignore[arg-type]
    expected = copy.deepcopy(base)
    monolithic_update(expected, groups, loss, ref_model, SGD.lr)
    streamed = copy.deepcopy(base)
    arrivals = [groups[i:i + 2] for i in range(0, NUM_GROUPS, 2)]
    stats = streamed_update("torch", streamed, arrivals, loss, ref_model, micro_batch_groups)
    assert_same_parameters(streamed, expected)
    assert not torch.equal(next(streamed.parameters()), next(base.parameters())), "no update"
    # The failed ones count as samples scored 0 (GRPO's group), never as trained tokens.
    trained = sum(len(c.completion_ids) for g in groups for c in g.completions
                  if c.loss_mask is None)
    assert stats.num_tokens == trained
    assert stats.mean_reward == pytest.approx(
        sum(sum(g.rewards) for g in groups) / (NUM_GROUPS * GROUP_SIZE))


def test_trained_tokens_without_a_prompt_are_refused_and_the_step_stays_usable() -> None:
    groups = rewarded_groups(8)
    step = StreamingStep(make_backend("torch", fresh_model(0), SGD), num_groups=NUM_GROUPS,
                         group_size=GROUP_SIZE, micro_batch_groups=1, loss=LossConfig(),
                         pad_id=PAD_ID)
    orphan = Completion([], [6, 7], [-1.0, -1.0])
    with pytest.raises(StepInputError, match="no prompt"):
        step.add_group(RewardedGroup(0, [orphan] * GROUP_SIZE, [0.0, 1.0, 0.0]))
    for g in groups:
        step.add_group(g)
    assert step.finish().num_groups == NUM_GROUPS
