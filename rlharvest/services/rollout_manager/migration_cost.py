"""What the cost-aware migration rule (balancer.py, ``MoveCosts``) reads: a request's expected
remaining tokens, and each worker's decode pace and prefill rate, measured from its engine steps.

Pure and I/O-free, like the rest of the core: the control loop feeds them engine steps and ended
steps, the balancer reads them through ``MoveCosts``.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass

from rlharvest.services.rollout_manager.batching_profile import StepStatsLike, decode_sample

__all__ = ["LengthModel", "WorkerPace", "PACE_WEIGHT"]

# Weight of the newest engine step in a worker's pace (an exponential moving average): about the
# last ten steps count, so a worker slowed down (a noisy neighbour, a throttled GPU) shows within a
# second of decoding, and one step's jitter moves the estimate by a tenth.
PACE_WEIGHT = 0.1


class LengthModel:
    """Completion lengths of the last finished step: a request that has generated g tokens is
    expected to end at the mean of those lengths above g (the long tail's conditional mean),
    never beyond its max_tokens; with no length above g (or no history) at its max_tokens, the
    only bound left. The same history RollPacker's stream scaling projects from
    (stream_scaling.py), read as a mean instead of a quantile: the rule weighs expected times."""

    def __init__(self, lengths: Iterable[int] = ()) -> None:
        self._sorted = sorted(int(n) for n in lengths)
        # _suffix[i]: the sum of _sorted[i:]
        self._suffix = [0] * (len(self._sorted) + 1)
        for i in range(len(self._sorted) - 1, -1, -1):
            self._suffix[i] = self._suffix[i + 1] + self._sorted[i]

    def __len__(self) -> int:
        return len(self._sorted)

    def expected_remaining_many(self, pairs: Iterable[tuple[int, int]]) -> list[float]:
        """``expected_remaining`` of each (generated, max_tokens): many running requests share
        a pair (same max_tokens, same count so far), each pair is computed once."""
        memo: dict[tuple[int, int], float] = {}
        out = []
        for pair in pairs:
            value = memo.get(pair)
            if value is None:
                value = memo[pair] = self.expected_remaining(*pair)
            out.append(value)
        return out

    def expected_remaining(self, generated: int, max_tokens: int) -> float:
        """Tokens the request is expected to generate still (0 once at max_tokens)."""
        bound = max(0, max_tokens - generated)
        i = bisect.bisect_right(self._sorted, generated)
        above = len(self._sorted) - i
        if not above:
            return float(bound)
        return min(float(bound), self._suffix[i] / above - generated)


@dataclass
class WorkerPace:
    """A worker's decode pace (tokens/s per request in its batch) and prefill rate (tokens/s),
    moving averages over its engine steps; None until a step measured them."""

    per_request: float | None = None
    batch: float = 1.0  # the batch size the pace was measured at (averaged alike)
    prefill: float | None = None

    def record(self, stats: StepStatsLike) -> None:
        """One engine step. A decode step (``decode_sample``: not prefill-dominated) gives the
        pace; a step that prefilled more than it decoded gives the prefill rate (its time counted
        whole, so the rate is a slight underestimate: a move's cost is not undercounted)."""
        sample = decode_sample(stats)
        if sample is not None:
            batch, tokens_per_s = sample
            first = self.per_request is None
            self.per_request = _average(self.per_request, tokens_per_s / batch)
            self.batch = float(batch) if first else _average(self.batch, float(batch))
        elif stats.prefill_tokens > 0 and stats.duration_s > 0:
            self.prefill = _average(self.prefill, stats.prefill_tokens / stats.duration_s)


def _average(old: float | None, new: float) -> float:
    return new if old is None else old + PACE_WEIGHT * (new - old)
