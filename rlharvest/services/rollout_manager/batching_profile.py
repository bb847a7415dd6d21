"""The inference batching profile P of RLBoost Algorithm 2 (§4.2.1, lines 23-24).

P maps batch size -> decode throughput (tokens/s). It is captured online during the previous step
(never profiled offline) and the batching plateau B is the smallest batch reaching (1 - ε) of the
best throughput. Until one step has been captured there is no plateau, so CONTINUOUSLB migrates
executing requests only from the second step on, as in the paper.

Samples are true ones: each is one engine step a worker reported (``StepStats``: its batch size,
wall time and tokens), taken by ``decode_sample`` at the mean context of the worker's requests.
A step collects its samples in ``ProfileSamples``; when it finishes, ``ThroughputProfile.freeze``
makes them P (step_book.py says which step freezes P, and when).

Calibration for context length (the paper calibrates P "for the current average context length"
but does not say how; this is our choice). A decode step reads the weights once and every
sequence's KV cache, so its time is roughly ``a + c * batch * context``, and throughput is
``batch / (a + c * batch * context)``. Written in KV tokens in flight, ``x = batch * context``,
``throughput * context = x / (a + c * x)`` no longer depends on context. So each batch-size bucket
is stored at ``x = batch * mean_context`` with ``throughput * mean_context``, the plateau is found
once in KV tokens (``x*``), and at the current mean context ``L_now``:

    B(L_now) = ceil(x* / L_now)

This keeps P one-dimensional (the paper found two-dimensional fits unreliable), uses every sample
whatever context it was taken at, and moves B the right way: longer contexts saturate memory
bandwidth at smaller batches. Compute-bound terms (cost per sequence independent of context) make
it approximate; the error is towards migrating slightly more than needed at long contexts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol


class StepStatsLike(Protocol):
    """One engine step as a worker reports it: ``StepStats`` or the wire ``EngineStepStats``."""

    @property
    def batch_size(self) -> int: ...
    @property
    def duration_s(self) -> float: ...
    @property
    def decode_tokens(self) -> int: ...
    @property
    def prefill_tokens(self) -> int: ...


@dataclass(frozen=True)
class StepStats:
    """One engine step (mirrors the wire ``EngineStepStats``)."""

    batch_size: int  # requests that decoded in the step
    duration_s: float
    decode_tokens: int
    prefill_tokens: int = 0


def decode_sample(stats: StepStatsLike) -> tuple[int, float] | None:
    """(batch size, decode tokens/s) of one engine step, or None when it says nothing about
    decode batching: an idle or unmeasured step, or one that prefilled more than it decoded.

    Heavy prefill is left out because such a step's time is mostly the prefill's (compute-bound,
    growing with the prompt tokens), not the decode batch's (memory-bound): filed under the decode
    batch size it would make that batch look slower than it is, pull B down, and migrate executing
    requests that gain nothing. A light prefill (a short prompt or two joining) hardly moves a
    memory-bound step, so those steps stay: dropping every step with any prefill would leave few
    samples with engines that mix prefill chunks into most steps (chunked prefill).
    """
    batch, seconds, tokens = stats.batch_size, stats.duration_s, stats.decode_tokens
    if batch <= 0 or seconds <= 0 or tokens <= 0 or stats.prefill_tokens > tokens:
        return None
    return batch, tokens / seconds


@dataclass
class _Bucket:
    samples: int = 0
    tokens_per_s: float = 0.0  # sums, turned into means when a step is frozen
    context: float = 0.0
    normalized: float = 0.0  # sum of tokens_per_s * context (see the module docstring)


class ProfileSamples:
    """Throughput samples of one step for one kind of worker, summed per batch size."""

    def __init__(self) -> None:
        self.buckets: dict[int, _Bucket] = {}

    def record(self, batch_size: int, tokens_per_s: float, mean_context: float) -> None:
        """One engine step's decode throughput at ``batch_size`` and the mean context then."""
        if batch_size <= 0 or tokens_per_s <= 0 or mean_context <= 0:
            return  # an idle step says nothing about batching
        bucket = self.buckets.get(batch_size)
        if bucket is None:
            bucket = self.buckets[batch_size] = _Bucket()
        bucket.samples += 1
        bucket.tokens_per_s += tokens_per_s
        bucket.context += mean_context
        bucket.normalized += tokens_per_s * mean_context


@dataclass(frozen=True)
class FrozenProfile:
    """P as captured over one step: mean throughput and mean context per batch size."""

    throughput: dict[int, float]
    context: dict[int, float]
    normalized: dict[int, float]  # mean of tokens_per_s * context, per batch size

    def plateau_kv_tokens(self, epsilon: float) -> float:
        """x*: the fewest KV tokens in flight reaching (1 - ε) of the best context-normalised
        throughput (see the module docstring)."""
        points = {b * self.context[b]: self.normalized[b] for b in self.throughput}
        best = max(points.values())
        return min(x for x, t in points.items() if t >= (1.0 - epsilon) * best)

    def raw_plateau(self, epsilon: float) -> int:
        """B as the paper states it, ignoring context: smallest batch within ε of the best."""
        best = max(self.throughput.values())
        return min(b for b, t in self.throughput.items() if t >= (1.0 - epsilon) * best)


class ThroughputProfile:
    """P for one kind of worker; ``plateau`` answers from the last step frozen into it."""

    def __init__(self, epsilon: float = 0.1, min_samples: int = 3) -> None:
        if not 0.0 < epsilon < 1.0:
            raise ValueError(f"epsilon={epsilon} must be in (0, 1): the plateau is the smallest "
                             "batch reaching (1 - epsilon) of the best throughput")
        self._epsilon = epsilon
        self._min_samples = min_samples  # a batch size seen once or twice is noise, not a point
        self._previous: FrozenProfile | None = None
        self._x_star = 0.0  # the previous profile's plateau in KV tokens, found once per freeze

    def freeze(self, samples: ProfileSamples) -> bool:
        """Make a finished step's samples P for the next step. Batch sizes seen fewer than
        ``min_samples`` times are left out; with none left the old P stays (returns False)."""
        kept = {b: k for b, k in samples.buckets.items() if k.samples >= self._min_samples}
        if not kept:
            return False
        self._previous = FrozenProfile(
            throughput={b: k.tokens_per_s / k.samples for b, k in kept.items()},
            context={b: k.context / k.samples for b, k in kept.items()},
            normalized={b: k.normalized / k.samples for b, k in kept.items()})
        # Read for every worker on every tick (control_loop._load): found once here.
        self._x_star = self._previous.plateau_kv_tokens(self._epsilon)
        return True

    @property
    def captured(self) -> FrozenProfile | None:
        return self._previous

    def plateau(self, mean_context: float) -> int | None:
        """B for the current mean context length, or None before a step has been captured."""
        if self._previous is None:
            return None
        if mean_context <= 0:
            return self._previous.raw_plateau(self._epsilon)
        return max(1, math.ceil(self._x_star / mean_context))
