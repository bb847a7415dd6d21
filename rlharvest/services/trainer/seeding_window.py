"""RLBoost's adaptive partial-response seeding (Algorithm 1, §4.1): the seeding window T_seed and
the remote-instance cap N_prem, tuned once per step from that step's timings.

During [0, T_seed] of a step the training cluster rolls out itself; then its unfinished requests
("seeds") migrate with their tokens to remote (spot) instances and it trains. Per step::

    T_seed <- T_seed + (t_train_wait - t_remote_wait) / eta                        (line 9)
    N_prem <- (t_remote * n_mean + T_seed * N_resv) / t_train                     (line 10)
    if n_mean == n_next:  M[n_next] <- T_seed           (availability held: remember)  (11-12)
    if n_next in M:       T_seed <- M[n_next]           (a known level: start from it) (13-14)

Pure and synchronous: the trainer and the manager measure, this decides (``tests/unit/
test_seeding_window.py``). Where the paper is silent, decided here:

- T_seed is clamped to [0, ``t_seed_cap``], the measured time of a whole local rollout: a window
  that long *is* the co-located fallback (no remote instance needed), and longer only idles.
- N_prem is rounded up (too few instances stretch the step; one too many costs one instance)
  and clamped to [1, max(1, n_next)]: more than are available cannot be used, and at least one
  keeps a slot open for the next instance to arrive (with none available, N_prem is 1).
- t_train <= 0 (nothing trained: the step failed or had no groups) keeps both values: line 10
  would divide by it, and line 9's waits of a failed step say nothing about the window.
- "n_mean == n_next" compares a time-weighted mean with a count, so equality is taken within
  1e-9: availability constant over the whole step, which is what the memory is for (§4.1).
- Line 10 uses the line-9 T_seed (before a memory restore), as written.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

_SAME_LEVEL = 1e-9


@dataclass(frozen=True)
class StepTimings:
    """One step as measured: the trainer's compute and idle time, the remote instances' compute
    and idle time (per instance, after their last response), their time-weighted mean count
    over the step and their count when the next step starts."""

    t_train: float
    t_train_wait: float
    t_remote: float
    t_remote_wait: float
    n_prem_mean: float
    n_prem_next: int


@dataclass(frozen=True)
class Schedule:
    t_seed: float  # seconds the training cluster rolls out at the start of the next step
    n_prem: int  # at most this many remote instances take work in the next step


@dataclass
class SeedingWindow:
    """Algorithm 1. ``n_resv``: local rollout engines the training cluster splits into while
    seeding; ``eta``: adaptation rate (larger: smaller, steadier steps); ``t_init``: T_seed of the
    first step; ``t_seed_cap``: a whole local rollout's time (None: not measured yet, no cap)."""

    n_resv: int
    eta: float
    t_init: float
    t_seed_cap: float | None = None
    memory: dict[int, float] = field(default_factory=dict)
    schedule: Schedule = field(init=False)

    def __post_init__(self) -> None:
        if self.n_resv < 1:
            raise ValueError(f"n_resv must be >= 1 local rollout engine, got {self.n_resv}")
        if not self.eta > 0:
            raise ValueError(f"eta must be > 0, got {self.eta}")
        if self.t_init < 0:
            raise ValueError(f"t_init must be >= 0 seconds, got {self.t_init}")
        self.schedule = Schedule(self._clamp(self.t_init), self.n_resv)  # line 3: N_resv

    def observe(self, step: StepTimings) -> Schedule:
        """Lines 6-14 after a step; returns (and keeps) the next step's schedule."""
        if step.t_train <= 0:
            return self.schedule
        t_seed = self._clamp(self.schedule.t_seed + (step.t_train_wait - step.t_remote_wait)
                             / self.eta)
        n_prem = self._cap((step.t_remote * step.n_prem_mean + t_seed * self.n_resv)
                           / step.t_train, step.n_prem_next)
        if abs(step.n_prem_mean - step.n_prem_next) <= _SAME_LEVEL:
            self.memory[step.n_prem_next] = t_seed
        if step.n_prem_next in self.memory:
            t_seed = self._clamp(self.memory[step.n_prem_next])  # the cap may have moved
        self.schedule = Schedule(t_seed, n_prem)
        return self.schedule

    def measured_full_rollout(self, seconds: float) -> None:
        """The time a whole step's rollout took on the training cluster alone: the cap."""
        if seconds < 0:
            raise ValueError(f"a rollout time is >= 0 seconds, got {seconds}")
        self.t_seed_cap = seconds
        self.schedule = Schedule(self._clamp(self.schedule.t_seed), self.schedule.n_prem)

    def _clamp(self, t_seed: float) -> float:
        upper = math.inf if self.t_seed_cap is None else self.t_seed_cap
        return min(max(t_seed, 0.0), upper)

    @staticmethod
    def _cap(n_prem: float, available: int) -> int:
        if n_prem >= available:  # also a huge value from a tiny t_train
            return max(available, 1)
        return max(math.ceil(n_prem - 1e-9), 1)  # 2.0000000001 from float noise is 2, not 3
