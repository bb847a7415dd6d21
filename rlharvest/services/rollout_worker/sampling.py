"""Batched token sampling whose randomness is keyed by (request seed, token position).

RLBoost §4.2 migrates an in-flight request by re-sending prompt + generated tokens to another
worker, which prefills them and continues. For the continuation to be the one the request would
have produced uninterrupted, the noise that picks token number ``p`` must depend only on the
request's seed and ``p`` — never on a generator's running state, the batch the request sits in,
or the worker. So noise comes from a counter-based hash of (seed key, position, vocabulary index)
and sampling is Gumbel-max over the filtered distribution: every step is one vectorised pass over
the whole batch, with no per-request generator objects.

All functions are pure (tensors in, tensors out) and work on any device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK32 = 0xFFFFFFFF
_INV_2_POW_24 = 1.0 / (1 << 24)
# Temperatures below this are greedy (as in vLLM): dividing logits by ~0 would overflow to inf.
GREEDY_BELOW = 1e-5


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32), exactly and without int64 overflow.

    A constant >= 2**31 is replaced by c - 2**32, which is congruent mod 2**32 and keeps
    |x * c| < 2**63; ``&`` then takes the low 32 bits of the two's complement product.
    """
    return (x * (c - (1 << 32) if c >= 1 << 31 else c)) & _MASK32


def hash32(x: torch.Tensor) -> torch.Tensor:
    """Chris Wellons' "lowbias32" integer hash on int64 tensors holding values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def seed_key(seed: int) -> int:
    """Folds an arbitrary Python int seed into the 32-bit key the noise is derived from."""
    folded = seed & 0xFFFFFFFFFFFFFFFF  # negative seeds map to their two's complement
    lo = torch.tensor(folded & _MASK32, dtype=torch.int64)
    hi = torch.tensor(folded >> 32, dtype=torch.int64)
    return int(hash32(hash32(lo) ^ hi))


def uniform_noise(keys: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, V] uniforms in (0, 1): row b depends only on (keys[b], positions[b]).

    keys: [B] int64 from ``seed_key``; positions: [B] int64 index of the token being sampled.
    """
    row = hash32(keys ^ hash32(positions & _MASK32))
    idx = torch.arange(vocab_size, device=keys.device, dtype=torch.int64)
    bits = hash32((row[:, None] + idx) & _MASK32)
    # The top 24 bits fill a float32 mantissa exactly; +0.5 keeps u away from 0 and 1.
    return ((bits >> 8).to(torch.float32) + 0.5) * _INV_2_POW_24


def gumbel_noise(keys: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    return -torch.log(-torch.log(uniform_noise(keys, positions, vocab_size)))


def filter_top_k_top_p(scaled_logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                       top_k_bound: int = 0) -> torch.Tensor:
    """Masks (to -inf) tokens outside each row's top-k, then outside its nucleus.

    As in HF and vLLM, top-k applies first and top-p is taken over the distribution renormalised
    after the top-k cut; the nucleus is the smallest set of most likely tokens whose mass reaches
    top_p, so the most likely token always survives. top_k: [B] int64, 0 = no cut; top_p: [B].
    ``top_k_bound`` > 0 promises every row's top_k is in 1..bound: only that many candidates are
    ranked (a partial top-k instead of a full sort of the vocabulary).
    """
    vocab = scaled_logits.shape[-1]
    candidates = top_k_bound if 0 < top_k_bound < vocab else vocab
    if candidates < vocab:
        ranked, order = scaled_logits.topk(candidates, dim=-1)
    else:
        ranked, order = scaled_logits.sort(dim=-1, descending=True)
    ranks = torch.arange(candidates, device=scaled_logits.device)
    k = torch.where(top_k > 0, top_k, vocab)
    keep = ranks[None, :] < k[:, None]
    probs = ranked.masked_fill(~keep, float("-inf")).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    # top_p = 1 must cut nothing, even where float32 cumsum reaches 1.0 before the tail ends.
    keep &= (mass_before < top_p[:, None]) | (top_p[:, None] >= 1)
    kept = torch.zeros_like(scaled_logits, dtype=torch.bool).scatter_(1, order, keep)
    return scaled_logits.masked_fill(~kept, float("-inf"))


@dataclass
class SamplingBatch:
    """Per-row sampling parameters of one batch, as tensors on the logits' device."""

    temperature: torch.Tensor  # [B] float32; below GREEDY_BELOW means greedy
    top_k: torch.Tensor  # [B] int64; 0 means no cut
    top_p: torch.Tensor  # [B] float32 in (0, 1]
    keys: torch.Tensor  # [B] int64 from seed_key
    positions: torch.Tensor  # [B] int64: index of the token being sampled in its completion
    any_sampled: bool = True  # False when every row is greedy: skip the noise
    any_filtered: bool = True  # False when no row has a top-k or top-p cut: skip the sort
    top_k_bound: int = 0  # > 0: every row has a top-k cut <= this (see filter_top_k_top_p)


def sample(logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Picks one token per row; returns (token ids [B] int64, logprobs [B] float32).

    The logprob is log-softmax of the *unmodified* logits (temperature 1, no top-k/top-p cut) at
    the chosen token: the policy's own probability, which is what the trainer's importance ratio
    compares against. Temperature and cuts shape only which token is drawn.
    """
    logits = logits.float()
    greedy = logits.argmax(dim=-1)
    if batch.any_sampled:
        is_greedy = batch.temperature < GREEDY_BELOW
        temperature = torch.where(is_greedy, 1.0, batch.temperature)
        scaled = logits / temperature[:, None]
        if batch.any_filtered:
            scaled = filter_top_k_top_p(scaled, batch.top_k, batch.top_p, batch.top_k_bound)
        noise = gumbel_noise(batch.keys, batch.positions, logits.shape[-1])
        drawn = (scaled + noise).argmax(dim=-1)
        tokens = torch.where(is_greedy, greedy, drawn)
    else:
        tokens = greedy
    logprobs = logits.log_softmax(dim=-1).gather(1, tokens[:, None]).squeeze(1)
    return tokens, logprobs
