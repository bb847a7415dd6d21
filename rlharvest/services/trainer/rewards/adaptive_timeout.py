"""RollPacker's adaptive sandbox timeout (§4.3, "Code Sandbox Execution").

Per test case, T_anchor is the longest execution time of a *correct* response seen so far; a
run is cut off at T = min(max(T_min, lambda * T_anchor), T_max). Doomed runs (infinite loops,
exponential algorithms) then fail fast instead of holding the reward stage for T_max.
Defaults are the paper's: lambda = 1.5, T_min = 2 s, T_max = 30 s.

Pure: elapsed times are passed in by the caller, nothing here reads a clock.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass


@dataclass(frozen=True)
class TimeoutPolicy:
    t_min_s: float = 2.0
    t_max_s: float = 30.0
    slack: float = 1.5  # the paper's lambda: headroom for CPU contention on the sandbox hosts

    def __post_init__(self) -> None:
        if not 0 < self.t_min_s <= self.t_max_s:
            raise ValueError(
                f"need 0 < t_min_s <= t_max_s, got t_min_s={self.t_min_s}, t_max_s={self.t_max_s}")
        if self.slack < 1.0:
            raise ValueError(f"slack (lambda) below 1 would cut off the anchor run itself, "
                             f"got {self.slack}")

    def timeout(self, anchor_s: float | None) -> float:
        if anchor_s is None:
            # No correct run yet: nothing says how long a correct one takes, so allow the most.
            return self.t_max_s
        return min(max(self.t_min_s, self.slack * anchor_s), self.t_max_s)


class AdaptiveTimeout:
    """Anchors per test case, updated from observed runs; hands out per-case timeouts."""

    def __init__(self, policy: TimeoutPolicy) -> None:
        self._policy = policy
        self._anchors: dict[Hashable, float] = {}

    def anchor(self, case_id: Hashable) -> float | None:
        return self._anchors.get(case_id)

    def timeout_for(self, case_id: Hashable) -> float:
        return self._policy.timeout(self._anchors.get(case_id))

    def observe(self, case_id: Hashable, elapsed_s: float, correct: bool) -> None:
        """Record a finished run. Only correct runs move the anchor, and only upwards: the
        slowest correct run is the evidence of how long a correct answer may need."""
        if elapsed_s < 0:
            raise ValueError(f"elapsed_s must be >= 0, got {elapsed_s}")
        if not correct:
            return
        previous = self._anchors.get(case_id)
        if previous is None or elapsed_s > previous:
            self._anchors[case_id] = elapsed_s

    def snapshot(self) -> dict[Hashable, float]:
        """The anchors, for checkpoints (a restarted trainer should not relearn them)."""
        return dict(self._anchors)

    def restore(self, anchors: dict[Hashable, float]) -> None:
        self._anchors = dict(anchors)
