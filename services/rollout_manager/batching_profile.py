"""The inference batching profile P of RLBoost Algorithm 2 (§4.2.1, lines 23-24).

P maps batch size -> decode throughput (tokens/s). It is captured online during the previous step
(never profiled offline) and the batching plateau B is the smallest batch reaching (1 - ε) of the
best throughput. Until one step has been captured there is no plateau, so CONTINUOUSLB migrates
executing requests only from the second step on, as in the paper.

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


@dataclass
class _Bucket:
    samples: int = 0
    tokens_per_s: float = 0.0  # sums, turned into means when a step is frozen
    context: float = 0.0
    normalized: float = 0.0  # sum of tokens_per_s * context (see the module docstring)


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
    """Online (batch size -> tokens/s) samples; ``plateau`` answers from the previous step's."""

    def __init__(self, epsilon: float = 0.1, min_samples: int = 3) -> None:
        if not 0.0 < epsilon < 1.0:
            raise ValueError(f"epsilon={epsilon} must be in (0, 1): the plateau is the smallest "
                             "batch reaching (1 - epsilon) of the best throughput")
        self._epsilon = epsilon
        self._min_samples = min_samples  # a batch size seen once or twice is noise, not a point
        self._current: dict[int, _Bucket] = {}
        self._previous: FrozenProfile | None = None

    def record(self, batch_size: int, tokens_per_s: float, mean_context: float) -> None:
        """One observation from a worker's engine step (or a short window of steps)."""
        if batch_size <= 0 or tokens_per_s <= 0 or mean_context <= 0:
            return  # an idle or empty window says nothing about batching
        bucket = self._current.setdefault(batch_size, _Bucket())
        bucket.samples += 1
        bucket.tokens_per_s += tokens_per_s
        bucket.context += mean_context
        bucket.normalized += tokens_per_s * mean_context

    def finish_step(self) -> None:
        """Freeze this step's samples as P for the next step; keep the old P if too few came."""
        kept = {b: k for b, k in self._current.items() if k.samples >= self._min_samples}
        if kept:
            self._previous = FrozenProfile(
                throughput={b: k.tokens_per_s / k.samples for b, k in kept.items()},
                context={b: k.context / k.samples for b, k in kept.items()},
                normalized={b: k.normalized / k.samples for b, k in kept.items()})
        self._current = {}

    @property
    def captured(self) -> FrozenProfile | None:
        return self._previous

    def plateau(self, mean_context: float) -> int | None:
        """B for the current mean context length, or None before a step has been captured."""
        if self._previous is None:
            return None
        if mean_context <= 0:
            return self._previous.raw_plateau(self._epsilon)
        return max(1, math.ceil(self._previous.plateau_kv_tokens(self._epsilon) / mean_context))
