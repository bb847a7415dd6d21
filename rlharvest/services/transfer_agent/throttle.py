"""A token bucket: the sender-side rate limit that emulates a slow link (WEAVE's cross-cluster
Ethernet) and that benchmarks and fault tests use to slow a pull down. Pure: the caller passes
the clock reading and does the waiting."""

from __future__ import annotations


class TokenBucket:
    """``rate`` bytes per second with bursts up to ``burst`` bytes. ``reserve(n, now)`` takes n
    bytes (going into debt if need be, so a chunk larger than the burst still passes) and says
    how many seconds the sender must wait before sending them."""

    def __init__(self, rate: float, burst: float, now: float) -> None:
        if rate <= 0 or burst <= 0:
            raise ValueError(f"TokenBucket needs rate > 0 and burst > 0, got {rate}, {burst}")
        self.rate = rate
        self.burst = burst
        self._tokens = burst
        self._at = now

    def reserve(self, nbytes: int, now: float) -> float:
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
        self._at = now
        self._tokens -= nbytes
        return 0.0 if self._tokens >= 0 else -self._tokens / self.rate
