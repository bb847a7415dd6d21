"""Preemptive memory sharing of the KV pool (ROSE §4.1, App. C): serving first, rollout in what
serving does not need.

The paper's three steps, over ``page_pool.PagePool``:

1. At each RL step start (a new weight version activates) the rollout budget B_roll is set from
   serving's recent KV use, keeping a headroom H for serving. [vague in the paper; ours:]
   B_roll = pool - P99(serving pages over the last 60 s) - H, floored at 0.
2. Burst trigger and emergency cut: when serving's use crosses a high watermark inside H
   ([vague]; ours: half of H above serving's expected share, pool - B_roll - H), the executor is
   in PRESSURE and B_roll is halved at once; rollout pages over the new budget are reclaimed at
   request granularity (``victims``).
3. Freeze: B_roll does not rise again until the next step start (one cut per step: it avoids
   churn under bursty traffic).

Reclaim order ([vague]; ours): requests whose lease expired, then cached prefixes least recently
used first, then running requests with the fewest generated tokens (the least work to redo
elsewhere: their tokens go back to the manager with the abort, so nothing is regenerated
anyway). Serving is never refused while rollout holds pages: ``victims`` for a serving shortfall
may take rollout pages within the budget too.

``static`` mode is Table 2's baseline: half the pool each, fixed, no cut. Pure: times are
arguments.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

from rlharvest.common.errors import InvalidArgument
from rlharvest.services.coexecutor.page_pool import Owner, PagePool


class MemoryState(enum.Enum):
    NORMAL = "normal"
    PRESSURE = "pressure"


@dataclass(frozen=True)
class MemoryConfig:
    headroom: float = 0.2  # H, a share of the pool (the paper: of GPU memory)
    usage_window_s: float = 60.0
    usage_quantile: float = 0.99
    watermark: float = 0.5  # how much of H serving may eat before PRESSURE
    cut_factor: float = 2.0
    static: bool = False  # Table 2's static partition: half each, never cut

    def __post_init__(self) -> None:
        checks = {"headroom": 0 < self.headroom < 1, "usage_window_s": self.usage_window_s > 0,
                  "usage_quantile": 0 < self.usage_quantile <= 1,
                  "watermark": 0 <= self.watermark <= 1, "cut_factor": self.cut_factor > 1}
        bad = [key for key, ok in checks.items() if not ok]
        if bad:
            raise InvalidArgument(f"memory sharing setting {bad[0]} = {getattr(self, bad[0])} "
                                  "is out of range (headroom in (0, 1), usage_quantile in "
                                  "(0, 1], watermark in [0, 1], cut_factor > 1, window > 0)")


class MemorySharing:
    def __init__(self, pool: PagePool, config: MemoryConfig = MemoryConfig()) -> None:
        self.pool = pool
        self.config = config
        self.state = MemoryState.NORMAL
        self.headroom_pages = math.ceil(config.headroom * pool.total_pages)
        self.cuts = 0  # pressure events, for the metric
        self._samples: deque[tuple[float, int]] = deque()
        self._sample_sum = 0
        # Serving's mean share of the pool over the window: what lending ranks co-executors by
        # (ROSE §5: "lowest KV usage over a recent window"). One float, so another thread may
        # read it while the engine thread writes.
        self.recent_serving_share = 0.0
        self._step_budget = pool.rollout_budget
        self.start_step(0.0)

    @property
    def budget(self) -> int:
        return self.pool.rollout_budget

    @property
    def serving_limit(self) -> int:
        """Pages serving may hold: all of them, but in the static partition its half."""
        total = self.pool.total_pages
        return total - total // 2 if self.config.static else total

    @property
    def watermark_pages(self) -> int:
        """Serving use at which PRESSURE starts (inside H, above serving's expected share)."""
        expected = self.pool.total_pages - self._step_budget - self.headroom_pages
        return expected + math.ceil(self.config.watermark * self.headroom_pages)

    def observe(self, now: float, serving_pages: int) -> None:
        """Record serving's KV use (call every tick)."""
        self._samples.append((now, serving_pages))
        self._sample_sum += serving_pages
        horizon = now - self.config.usage_window_s
        while self._samples and self._samples[0][0] < horizon:
            self._sample_sum -= self._samples.popleft()[1]
        self.recent_serving_share = self._sample_sum / len(self._samples) / self.pool.total_pages

    def start_step(self, now: float) -> int:
        """A new weight version activates: set B_roll from serving's recent use and end the
        freeze. Returns the new budget."""
        total = self.pool.total_pages
        if self.config.static:
            budget = total // 2
        else:
            recent = sorted(pages for t, pages in self._samples
                            if t >= now - self.config.usage_window_s)
            used = recent[min(len(recent) - 1, math.ceil(self.config.usage_quantile
                                                          * len(recent)) - 1)] if recent else 0
            budget = max(0, total - used - self.headroom_pages)
        self.pool.rollout_budget = self._step_budget = budget
        self.state = MemoryState.NORMAL
        return budget

    def on_serving_use(self, now: float, serving_pages: int) -> bool:
        """Serving's use now; True when it triggers the one cut of this step (B_roll halved)."""
        self.observe(now, serving_pages)
        if self.config.static or self.state is MemoryState.PRESSURE:
            return False
        if serving_pages < self.watermark_pages:
            return False
        self.state = MemoryState.PRESSURE
        self.pool.rollout_budget = math.floor(self.pool.rollout_budget / self.config.cut_factor)
        self.cuts += 1
        return True

    def victims(self, now: float, generated: Mapping[str, int], serving_need: int = 0) -> list[str]:
        """Rollout requests to free, in reclaim order, so that rollout is back within B_roll
        and ``serving_need`` more pages are free (expired leases always go). ``generated``:
        tokens generated so far per running rollout request."""
        pool = self.pool
        tables = pool.tables(Owner.ROLLOUT)
        expired = pool.expired(now)
        must = max(pool.rollout_pages - pool.rollout_budget, serving_need - pool.free_pages, 0)
        chosen, freed = list(expired), sum(len(tables[r].pages) for r in expired)
        gone = set(expired)
        rest = [r for r in tables if r not in gone]
        cached = sorted((tables[r].last_used, r) for r in rest if tables[r].cached)
        active = sorted((generated.get(r, 0), tables[r].last_used, r) for r in rest
                        if not tables[r].cached)
        for rid in [r for *_, r in cached] + [r for *_, r in active]:
            if freed >= must:
                break
            chosen.append(rid)
            freed += len(tables[rid].pages)
        return chosen
