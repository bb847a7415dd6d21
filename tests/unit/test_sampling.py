"""Sampling keyed by (seed, position): the pure functions behind TorchEngine's token choice."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlharvest.services.rollout_worker.sampling import (
    SamplingBatch,
    filter_top_k_top_p,
    hash32,
    sample,
    seed_key,
    uniform_noise,
)

VOCAB = 16
fast = settings(max_examples=40, deadline=None)


def lowbias32_reference(x: int) -> int:
    """Wellons' lowbias32 in plain Python integers, the specification hash32 must meet."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def batch_of(rows: int, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
             seed: int = 0, first_position: int = 0) -> SamplingBatch:
    return SamplingBatch(
        temperature=torch.full((rows,), temperature), top_k=torch.full((rows,), top_k),
        top_p=torch.full((rows,), top_p), keys=torch.full((rows,), seed_key(seed)),
        positions=torch.arange(first_position, first_position + rows))


def nucleus(probs: list[float], top_p: float) -> set[int]:
    """Reference: the most likely tokens, taken in order until their mass reaches top_p."""
    kept, mass = set(), 0.0
    for token in sorted(range(len(probs)), key=lambda t: -probs[t]):
        if probs[token] == 0 or (mass >= top_p and top_p < 1):
            break
        kept.add(token)
        mass += probs[token]
    return kept


@fast
@given(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=64))
def test_hash32_is_exact_32_bit_lowbias32_despite_int64_arithmetic(values):
    got = hash32(torch.tensor(values, dtype=torch.int64)).tolist()
    assert got == [lowbias32_reference(v) for v in values]


def test_seed_key_separates_seeds_including_negative_and_huge_ones():
    seeds = [0, 1, 2, -1, -2, 2**32, 2**32 + 1, 2**63 - 1, 12345]
    keys = [seed_key(s) for s in seeds]
    assert len(set(keys)) == len(seeds)
    assert all(0 <= k < 2**32 for k in keys)


@fast
@given(st.lists(st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 10**6)),
                min_size=2, max_size=12), st.randoms())
def test_noise_of_a_row_depends_only_on_its_seed_and_position(rows, rng):
    keys = torch.tensor([k for k, _ in rows])
    positions = torch.tensor([p for _, p in rows])
    together = uniform_noise(keys, positions, VOCAB)
    order = list(range(len(rows)))
    rng.shuffle(order)
    shuffled = uniform_noise(keys[order], positions[order], VOCAB)
    assert torch.equal(shuffled, together[order])
    alone = uniform_noise(keys[:1], positions[:1], VOCAB)
    assert torch.equal(alone[0], together[0])


def test_noise_changes_with_position_and_seed():
    key = torch.tensor([seed_key(3)])
    at_0 = uniform_noise(key, torch.tensor([0]), VOCAB)
    at_1 = uniform_noise(key, torch.tensor([1]), VOCAB)
    other_seed = uniform_noise(torch.tensor([seed_key(4)]), torch.tensor([0]), VOCAB)
    assert not torch.equal(at_0, at_1)
    assert not torch.equal(at_0, other_seed)


def test_noise_is_uniform_in_the_open_unit_interval():
    noise = uniform_noise(torch.full((4000,), seed_key(9)), torch.arange(4000), VOCAB).flatten()
    assert noise.min() > 0 and noise.max() < 1
    counts = torch.histc(noise, bins=10, min=0, max=1)
    expected = noise.numel() / 10
    chi_square = float(((counts - expected) ** 2 / expected).sum())
    assert chi_square < 40  # 9 degrees of freedom: p < 1e-5 for a uniform source


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_draws_follow_the_softmax_of_logits_over_temperature(temperature):
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    draws = 20000
    tokens, _ = sample(logits.expand(draws, -1), batch_of(draws, temperature, seed=11))
    freq = torch.bincount(tokens, minlength=len(logits)).float() / draws
    expected = (logits / temperature).softmax(-1)
    assert torch.allclose(freq, expected, atol=0.015), (freq, expected)


@fast
@given(st.integers(0, 2**31), st.floats(0.1, 3.0))
def test_top_k_1_equals_greedy(seed, temperature):
    logits = torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(seed))
    greedy, _ = sample(logits, batch_of(8, temperature=0.0, seed=seed))
    top1, _ = sample(logits, batch_of(8, temperature, top_k=1, seed=seed))
    assert torch.equal(greedy, logits.argmax(-1))
    assert torch.equal(top1, greedy)


@fast
@given(st.integers(0, 2**31), st.floats(0.05, 1.0))
def test_top_p_filter_keeps_exactly_the_nucleus(seed, top_p):
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
    kept = filter_top_k_top_p(logits, torch.zeros(6, dtype=torch.int64), torch.full((6,), top_p))
    for row in range(6):
        survivors = set(torch.nonzero(kept[row].isfinite()).flatten().tolist())
        assert survivors == nucleus(logits[row].softmax(-1).tolist(), top_p)


@fast
@given(st.integers(0, 2**31), st.integers(1, VOCAB), st.floats(0.05, 1.0))
def test_top_p_applies_to_the_distribution_left_by_top_k(seed, top_k, top_p):
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
    kept = filter_top_k_top_p(logits, torch.full((4,), top_k), torch.full((4,), top_p))
    # Ranking only top_k_bound candidates (partial top-k) must keep the same tokens.
    bounded = filter_top_k_top_p(logits, torch.full((4,), top_k), torch.full((4,), top_p),
                                 top_k_bound=top_k + 2)
    assert torch.equal(bounded, kept)
    for row in range(4):
        top = logits[row].topk(top_k).indices.tolist()
        renormalised = [0.0] * VOCAB
        for token, p in zip(top, logits[row, top].softmax(-1).tolist()):
            renormalised[token] = p
        survivors = set(torch.nonzero(kept[row].isfinite()).flatten().tolist())
        assert survivors == nucleus(renormalised, top_p)


def test_sampled_tokens_stay_inside_top_k_and_nucleus():
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(5)) * 2
    draws = 3000
    by_k, _ = sample(logits.expand(draws, -1), batch_of(draws, top_k=3, seed=1))
    assert set(by_k.tolist()) == set(logits.topk(3).indices.tolist())
    by_p, _ = sample(logits.expand(draws, -1), batch_of(draws, top_p=0.6, seed=2))
    assert set(by_p.tolist()) == nucleus(logits.softmax(-1).tolist(), 0.6)


@fast
@given(st.integers(0, 2**31), st.floats(0.0, 3.0), st.integers(0, VOCAB), st.floats(0.05, 1.0))
def test_logprob_is_the_policys_own_unmodified_log_softmax(seed, temperature, top_k, top_p):
    logits = torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(seed)) * 2
    tokens, logprobs = sample(logits, batch_of(8, temperature, top_k, top_p, seed=seed))
    expected = logits.log_softmax(-1).gather(1, tokens[:, None]).squeeze(1)
    assert torch.allclose(logprobs, expected, atol=1e-6)


def test_mixed_batch_treats_each_row_by_its_own_parameters():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(8))
    mixed = SamplingBatch(temperature=torch.tensor([0.0, 1.0, 1.0]),
                          top_k=torch.tensor([0, 1, 0]), top_p=torch.tensor([1.0, 1.0, 0.7]),
                          keys=torch.tensor([seed_key(1), seed_key(2), seed_key(3)]),
                          positions=torch.tensor([5, 6, 7]))
    tokens, _ = sample(logits, mixed)
    for row in range(3):
        one = SamplingBatch(temperature=mixed.temperature[row:row + 1],
                            top_k=mixed.top_k[row:row + 1], top_p=mixed.top_p[row:row + 1],
                            keys=mixed.keys[row:row + 1], positions=mixed.positions[row:row + 1])
        alone, _ = sample(logits[row:row + 1], one)
        assert alone.item() == tokens[row].item()
    assert tokens[0].item() == logits[0].argmax().item()
    assert tokens[1].item() == logits[1].argmax().item()


def test_near_zero_temperature_is_greedy_not_an_overflow():
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(2))
    tokens, logprobs = sample(logits, batch_of(4, temperature=1e-30, top_p=0.9, seed=5))
    assert torch.equal(tokens, logits.argmax(-1)) and torch.isfinite(logprobs).all()


def test_all_greedy_fast_path_needs_no_noise():
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0))
    batch = batch_of(4, temperature=0.0)
    batch.any_sampled = batch.any_filtered = False
    tokens, logprobs = sample(logits, batch)
    assert torch.equal(tokens, logits.argmax(-1))
    assert all(math.isfinite(lp) and lp <= 0 for lp in logprobs.tolist())
